"""Request fields that constrain the output -> one `StructuredOutputs` and the field it came from.

Three vocabularies ask for the same thing: OpenAI's `response_format` (json_object, json_schema),
vLLM's `structured_outputs` object, and vLLM's older `guided_json` / `guided_regex` /
`guided_choice` / `guided_grammar`. At most one of them may be set; every problem is a 400 naming
the field. Whether the schema or grammar compiles is checked later, by the grammar compiler.
"""

from __future__ import annotations

from typing import Any

from jaxserve.server.errors import bad_request
from jaxserve.structured.spec import StructuredOutputs

GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}
STRUCTURED_FIELDS = frozenset({"response_format", "structured_outputs", *GUIDED_FIELDS})
_SPEC_KEYS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


def parse_structured(body: dict[str, Any]) -> tuple[StructuredOutputs | None, str | None]:
    """(constraint, the request field that set it) or (None, None)."""
    given = [name for name in ("response_format", "structured_outputs", *GUIDED_FIELDS)
             if body.get(name) is not None and not (name == "response_format" and _is_text(body[name]))]
    if not given:
        return None, None
    if len(given) > 1:
        raise bad_request(f"only one of {', '.join(repr(g) for g in given)} may constrain the output", given[1])
    field = given[0]
    value = body[field]
    if field == "response_format":
        spec = _response_format(value)
    elif field == "structured_outputs":
        spec = _structured_outputs(value)
    else:
        spec = _spec(field, **{GUIDED_FIELDS[field]: value})
    try:
        spec.validate()
    except ValueError as e:
        raise bad_request(f"'{field}': {e}", field) from None
    return spec, field


def _is_text(value: Any) -> bool:
    return isinstance(value, dict) and value.get("type") == "text" and len(value) == 1


def _response_format(value: Any) -> StructuredOutputs:
    name = "response_format"
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise bad_request("'response_format' must be an object with a 'type'", name)
    kind = value["type"]
    if kind == "json_object":
        return StructuredOutputs(json_object=True)
    if kind != "json_schema":
        raise bad_request(f"'response_format.type' must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                          name)
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise bad_request("'response_format.json_schema' must be an object with 'name' and 'schema'", name)
    if not isinstance(spec.get("name"), str) or not spec["name"]:
        raise bad_request("'response_format.json_schema.name' must be a non-empty string", name)
    if "strict" in spec and spec["strict"] is not None and not isinstance(spec["strict"], bool):
        raise bad_request("'response_format.json_schema.strict' must be a boolean", name)
    schema = spec.get("schema", {})  # OpenAI: a missing schema means any JSON object
    if not isinstance(schema, dict):
        raise bad_request("'response_format.json_schema.schema' must be a JSON schema object", name)
    return StructuredOutputs(json=schema or {"type": "object"})


def _structured_outputs(value: Any) -> StructuredOutputs:
    name = "structured_outputs"
    if not isinstance(value, dict):
        raise bad_request(f"'{name}' must be an object with one of {', '.join(_SPEC_KEYS)}", name)
    unknown = sorted(set(value) - set(_SPEC_KEYS))
    if unknown:
        raise bad_request(f"'{name}' has unsupported keys {unknown}; known: {', '.join(_SPEC_KEYS)}", name)
    return _spec(name, **{k: v for k, v in value.items() if v is not None})


def _spec(field: str, **kwargs: Any) -> StructuredOutputs:
    choice = kwargs.get("choice")
    if choice is not None and not isinstance(choice, list):
        raise bad_request(f"'{field}' choice must be a list of strings", field)
    for key in ("regex", "grammar"):
        if key in kwargs and not isinstance(kwargs[key], str):
            raise bad_request(f"'{field}' {key} must be a string", field)
    if "json" in kwargs and not isinstance(kwargs["json"], (dict, str)):
        raise bad_request(f"'{field}' json must be a JSON schema (object or JSON text)", field)
    if "json_object" in kwargs and not isinstance(kwargs["json_object"], bool):
        raise bad_request(f"'{field}' json_object must be a boolean", field)
    try:
        return StructuredOutputs(**kwargs)
    except TypeError as e:
        raise bad_request(f"'{field}': {e}", field) from None
