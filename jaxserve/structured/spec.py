"""What a request asks its output to match, in vLLM's vocabulary (`StructuredOutputs`), and its
translation into an llguidance grammar.

Host side, no jax. Exactly one of the constraint fields is set. `grammar_entry()` turns it into one
entry of llguidance's top-level grammar list; `compose()` puts that entry behind an optional Lark
prefix (a reasoning block that must come first: structured/reasoning.py).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

MAX_GRAMMAR_CHARS = 256 * 1024  # schema / regex / grammar text of one request
MAX_CHOICES = 1024

# JSON is generated compactly, with the separators json.dumps uses: free whitespace between tokens
# lets a weak (or random) model emit whitespace forever.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

_FIELDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclasses.dataclass(frozen=True)
class StructuredOutputs:
    """One output constraint. `json`: a JSON schema (dict or JSON text); `regex`: a Rust-regex the whole
    output must match; `choice`: the output is one of these strings; `grammar`: a Lark (llguidance
    dialect) or GBNF grammar; `json_object`: any JSON object; `structural_tag`: vLLM's JSON
    `{"structures": [{"begin", "schema", "end"}], "triggers": [...]}` (free text with constrained
    tagged segments)."""

    json: dict | str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False
    structural_tag: str | dict | None = None

    def __post_init__(self) -> None:
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))

    @property
    def kind(self) -> str:
        set_ = [f for f in _FIELDS if getattr(self, f) not in (None, False)]
        if len(set_) != 1:
            raise ValueError(f"structured_outputs must set exactly one of {', '.join(_FIELDS)}; got "
                             f"{', '.join(set_) if set_ else 'none'}")
        return set_[0]

    def validate(self) -> None:
        """Types and sizes (raises ValueError naming the field); whether the grammar compiles is
        checked by the compiler."""
        kind = self.kind
        value = getattr(self, kind)
        name = f"structured_outputs.{kind}"
        if kind == "json":
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError as e:
                    raise ValueError(f"{name} is not valid JSON: {e}") from None
            if not isinstance(value, (dict, bool)):
                raise ValueError(f"{name} must be a JSON schema object, got {type(value).__name__}")
        elif kind in ("regex", "grammar"):
            if not isinstance(value, str) or not value:
                raise ValueError(f"{name} must be a non-empty string")
        elif kind == "choice":
            if not value or not all(isinstance(c, str) and c for c in value):
                raise ValueError(f"{name} must be a non-empty list of non-empty strings")
            if len(value) > MAX_CHOICES:
                raise ValueError(f"{name} holds {len(value)} choices; at most {MAX_CHOICES}")
        elif kind == "json_object":
            if value is not True:
                raise ValueError(f"{name} must be true")
        elif kind == "structural_tag":
            _structural_tag(value)
        if len(self.text) > MAX_GRAMMAR_CHARS:
            raise ValueError(f"{name} is {len(self.text)} characters; at most {MAX_GRAMMAR_CHARS}")

    @property
    def text(self) -> str:
        """Canonical text of the constraint: the grammar cache's key (with the kind)."""
        value = getattr(self, self.kind)
        if isinstance(value, str):
            return value
        return json.dumps(value, sort_keys=True, ensure_ascii=False)

    def grammar_entry(self) -> dict[str, Any]:
        """One grammar of llguidance's top-level list (without its name)."""
        import llguidance

        kind = self.kind
        if kind == "json":
            schema = json.loads(self.json) if isinstance(self.json, str) else self.json
            return {"json_schema": _with_json_options(schema)}
        if kind == "json_object":
            return {"json_schema": _with_json_options({"type": "object"})}
        if kind == "regex":
            return {"lark_grammar": f"start: /{llguidance.regex_to_lark(self.regex, '')}/"}
        if kind == "choice":
            return {"lark_grammar": "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in self.choice)}
        if kind == "grammar":
            return {"lark_grammar": _lark(self.grammar)}
        return {"lark_grammar": _structural_tag_lark(_structural_tag(self.structural_tag))}


def compose(body: dict[str, Any], prefix: str = "") -> str:
    """llguidance grammar text: `body` alone, or the Lark `prefix` followed by it."""
    if not prefix:
        return json.dumps({"grammars": [body]})
    return json.dumps({"grammars": [{"lark_grammar": f"start: {prefix} @body"}, {"name": "body", **body}]})


def _with_json_options(schema: Any) -> Any:
    if not isinstance(schema, dict):
        return schema  # true / false schemas
    guidance = {**JSON_OPTIONS, **(schema.get("x-guidance") or {})}
    return {**schema, "x-guidance": guidance}


def _lark(grammar: str) -> str:
    """A Lark grammar as is; a GBNF one (`root ::= ...`) converted to Lark."""
    if "::=" not in grammar:
        return grammar
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        return any_to_lark(grammar)
    except Exception as e:  # the converter raises plain exceptions on syntax errors
        raise ValueError(f"structured_outputs.grammar is not a valid GBNF grammar: {e}") from None


def _structural_tag(value: Any) -> dict:
    name = "structured_outputs.structural_tag"
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ValueError(f"{name} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be an object with 'structures' and 'triggers'")
    structures, triggers = value.get("structures"), value.get("triggers")
    if not isinstance(structures, list) or not structures or not isinstance(triggers, list) or not triggers:
        raise ValueError(f"{name} needs non-empty 'structures' and 'triggers' lists")
    for i, s in enumerate(structures):
        if not (isinstance(s, dict) and isinstance(s.get("begin"), str) and isinstance(s.get("end"), str)
                and isinstance(s.get("schema"), (dict, bool))):
            raise ValueError(f"{name}.structures[{i}] needs 'begin' and 'end' strings and a 'schema' object")
        if not any(isinstance(t, str) and t and s["begin"].startswith(t) for t in triggers):
            raise ValueError(f"{name}.structures[{i}].begin {s['begin']!r} starts with none of the triggers")
    return value


def _structural_tag_lark(value: dict) -> str:
    from llguidance import StructTag

    tags = []
    for s in value["structures"]:
        trigger = next(t for t in value["triggers"] if s["begin"].startswith(t))
        tags.append(StructTag(trigger=trigger, begin=s["begin"], grammar=_with_json_options(s["schema"]),
                              end=s["end"]))
    return StructTag.to_grammar(tags)
