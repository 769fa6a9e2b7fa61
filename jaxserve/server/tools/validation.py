"""Validation of the tool-calling request fields: `tools`, `tool_choice`, `parallel_tool_calls`.

Errors are `ValueError`s whose message starts with the path of the offending value (for example
"tools[1].function.name must be ..."), so the server can hand them to the client as a 400 as-is.
Validated values come back normalised: fresh dicts in OpenAI's shape, absent optionals left out.
"""

from __future__ import annotations

import re
from typing import Any

_NAME_RE = re.compile(r"[a-zA-Z0-9_-]{1,64}")
_TOOL_KEYS = frozenset({"type", "function"})
_FUNCTION_KEYS = frozenset({"name", "description", "parameters", "strict"})
TOOL_CHOICE_MODES = ("none", "auto", "required")


def validate_tools(value: Any) -> list[dict]:
    """`tools` -> a list of {"type": "function", "function": {...}}; None means no tools."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise ValueError(f"tools must be a list of tool objects, got {_kind(value)}")
    tools: list[dict] = []
    seen: dict[str, int] = {}
    for i, tool in enumerate(value):
        path = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise ValueError(f"{path} must be an object, got {_kind(tool)}")
        _no_unknown_keys(tool, _TOOL_KEYS, path)
        if tool.get("type") != "function":
            raise ValueError(f"{path}.type must be 'function', got {tool.get('type')!r}")
        function = _validate_function(tool.get("function"), f"{path}.function")
        name = function["name"]
        if name in seen:
            raise ValueError(f"{path}.function.name {name!r} repeats the name of tools[{seen[name]}]")
        seen[name] = i
        tools.append({"type": "function", "function": function})
    return tools


def _validate_function(fn: Any, path: str) -> dict:
    if not isinstance(fn, dict):
        raise ValueError(f"{path} must be an object with a 'name', got {_kind(fn)}")
    _no_unknown_keys(fn, _FUNCTION_KEYS, path)
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise ValueError(f"{path}.name must be a string of 1 to 64 letters, digits, '_' or '-', got {name!r}")
    out: dict[str, Any] = {"name": name}
    description = fn.get("description")
    if description is not None:
        if not isinstance(description, str):
            raise ValueError(f"{path}.description must be a string, got {_kind(description)}")
        out["description"] = description
    parameters = fn.get("parameters")
    if parameters is not None:
        # The arguments a model writes are always a JSON object, so the schema must describe one.
        if not isinstance(parameters, dict):
            raise ValueError(f"{path}.parameters must be a JSON schema object, got {_kind(parameters)}")
        if parameters.get("type", "object") != "object":
            raise ValueError(f"{path}.parameters must describe an object (\"type\": \"object\"), "
                             f"got type {parameters.get('type')!r}")
        out["parameters"] = parameters
    strict = fn.get("strict")
    if strict is not None:
        if not isinstance(strict, bool):
            raise ValueError(f"{path}.strict must be a boolean, got {_kind(strict)}")
        out["strict"] = strict
    return out


def validate_tool_choice(value: Any, tools: list[dict] | None) -> str | dict:
    """`tool_choice` -> "none" | "auto" | "required" | {"type": "function", "function": {"name": N}}.

    Absent (None) defaults as OpenAI's does: "auto" when there are tools, else "none". `tools` is
    the already validated list (None: no tools); a choice that needs tools ("required", a named
    function) without them is an error.
    """
    if value is None:
        return "auto" if tools else "none"
    if isinstance(value, str):
        if value not in TOOL_CHOICE_MODES:
            raise ValueError(f"tool_choice must be one of 'none', 'auto', 'required' or an object naming a "
                             f"function, got {value!r}")
        if value == "required" and not tools:
            raise ValueError("tool_choice 'required' needs a non-empty 'tools' list")
        return value
    if not isinstance(value, dict):
        raise ValueError(f"tool_choice must be a string or an object, got {_kind(value)}")
    if value.get("type") != "function":
        raise ValueError(f"tool_choice.type must be 'function', got {value.get('type')!r}")
    fn = value.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ValueError("tool_choice.function must be an object with a string 'name'")
    name = fn["name"]
    if not tools:
        raise ValueError(f"tool_choice names function {name!r}, but the request has no 'tools'")
    if name not in {t["function"]["name"] for t in tools}:
        raise ValueError(f"tool_choice names function {name!r}, which is not in tools")
    return {"type": "function", "function": {"name": name}}


def validate_parallel_tool_calls(value: Any) -> bool:
    """`parallel_tool_calls`: a boolean, True when absent."""
    if value is None:
        return True
    if not isinstance(value, bool):
        raise ValueError(f"parallel_tool_calls must be a boolean, got {_kind(value)}")
    return value


def _no_unknown_keys(obj: dict, known: frozenset[str], path: str) -> None:
    # Refused rather than ignored: a field we do not know may change what the client expects.
    unknown = sorted(str(k) for k in obj if k not in known)
    if unknown:
        raise ValueError(f"{path} has unknown field {unknown[0]!r}; expected only {sorted(known)}")


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__
