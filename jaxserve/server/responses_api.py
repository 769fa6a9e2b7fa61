"""/v1/responses bodies (OpenAI's Responses API) -> a validated `ResponsesRequest`.

The Responses vocabulary is translated into a chat body (input items -> messages, flat function
tools -> chat tools, `text.format` -> `response_format`, `max_output_tokens` -> `max_tokens`) which
`parse_chat` then validates and renders: one path from a request to its prompt, tools grammar and
sampling parameters for both APIs. Everything the translation reads is checked here first, so a
bad field gets a 400 in Responses' own names; the few errors that can only come from `parse_chat`
(the prompt's length, sampling ranges) are renamed on the way out.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxserve.server.errors import APIError, bad_request
from jaxserve.server.protocol import GenerationRequest, ModelContext, int_field, show, str_field, warn_ignored
from jaxserve.server.chat_request import parse_chat
from jaxserve.server.responses_store import ResponseStore
from jaxserve.server.tools.validation import validate_tools

STORE_FLAG = "--enable-response-store"
# Fields outside OpenAI's Responses API that vLLM's sampling also reads: passed through to the chat body.
_EXTRA_SAMPLING = ("seed", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
                   "stop", "stop_token_ids", "logit_bias", "min_tokens", "ignore_eos", "priority", "cache_salt",
                   "chat_template_kwargs")
RESPONSES_FIELDS = frozenset({
    "model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "tools", "tool_choice",
    "parallel_tool_calls", "text", "reasoning", "metadata", "user", "store", "previous_response_id", "stream",
    "stream_options", "include", "truncation", "background", "service_tier", "prompt_cache_key",
    "safety_identifier", "max_tool_calls", "top_logprobs", "conversation", "prompt", *_EXTRA_SAMPLING})
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS = {"input_text": "text", "output_text": "text", "refusal": "refusal"}
_ITEM_TYPES = "message, function_call, function_call_output, reasoning"
# parse_chat's names for what the Responses body calls otherwise (errors it raises are renamed)
_CHAT_NAMES = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text"}


@dataclasses.dataclass
class ResponsesRequest:
    gen: GenerationRequest
    echo: dict[str, Any]            # request fields the response object repeats (instructions, tools, ...)
    history: list[dict]             # chat messages answered here, without instructions (for the store)
    store: bool
    previous_response_id: str | None


def parse_responses(body: dict[str, Any], ctx: ModelContext, store: ResponseStore | None) -> ResponsesRequest:
    """A /v1/responses body -> ResponsesRequest (APIError(400) naming the field otherwise).
    `store`: the server's response store, None when --enable-response-store is off."""
    warn_ignored(body, RESPONSES_FIELDS)
    _refuse_unsupported(body)
    keep, previous_id, prior = _store_fields(body, store)
    instructions = str_field(body, "instructions")
    history = prior + _input_messages(body.get("input"))
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + history
    chat_tools, tools_echo = _tools(body.get("tools"))
    chat_choice, choice_echo = _tool_choice(body.get("tool_choice"), bool(chat_tools))
    response_format, text_echo = _text(body.get("text"))
    max_output_tokens = int_field(body, "max_output_tokens", None, 1)
    metadata = _metadata(body.get("metadata"))
    chat: dict[str, Any] = {
        "model": body.get("model"), "messages": messages, "stream": body.get("stream"),
        "max_tokens": max_output_tokens, "temperature": body.get("temperature"), "top_p": body.get("top_p"),
        "tools": chat_tools, "tool_choice": chat_choice, "parallel_tool_calls": body.get("parallel_tool_calls"),
        "response_format": response_format, "user": body.get("user"),
        **{k: body[k] for k in _EXTRA_SAMPLING if k in body}}
    try:
        gen = parse_chat({k: v for k, v in chat.items() if v is not None}, ctx)
    except APIError as e:
        raise _renamed(e) from None
    echo = {"instructions": instructions, "max_output_tokens": max_output_tokens, "metadata": metadata,
            "tools": tools_echo, "tool_choice": choice_echo, "text": text_echo,
            "parallel_tool_calls": gen.parallel_tool_calls, "temperature": gen.params.temperature,
            "top_p": gen.params.top_p, "user": body.get("user"), "reasoning": _reasoning(body.get("reasoning"))}
    return ResponsesRequest(gen, echo, history, keep, previous_id)


def _refuse_unsupported(body: dict) -> None:
    """Fields whose meaning this server does not implement: refused rather than silently changed."""
    for name, allowed, why in (
            ("background", (None, False), "= true is not supported: responses run while the request is open"),
            ("conversation", (None,), "is not supported; chain responses with 'previous_response_id'"),
            ("prompt", (None,), "(prompt templates) is not supported; send 'input' and 'instructions'"),
            ("truncation", (None, "disabled"), "'auto' is not supported: an over-long input is refused"),
            ("top_logprobs", (None, 0), "is not supported by /v1/responses; use /v1/chat/completions"),
            ("max_tool_calls", (None,), "is not supported")):
        if body.get(name) not in allowed:
            raise bad_request(f"'{name}' {why}", name)


def _store_fields(body: dict, store: ResponseStore | None) -> tuple[bool, str | None, list[dict]]:
    """(keep this response, previous_response_id, the conversation it continues)."""
    keep = body.get("store")
    if keep is not None and not isinstance(keep, bool):
        raise bad_request(f"'store' must be a boolean, got {show(keep)}", "store")
    previous_id = str_field(body, "previous_response_id")
    if store is None:
        # OpenAI's default is store=true; a server without a store reads an omitted one as false.
        if keep:
            raise bad_request(f"'store': true needs a server started with {STORE_FLAG} (this one keeps no "
                              "responses); send 'store': false", "store")
        if previous_id is not None:
            raise bad_request(f"'previous_response_id' needs a server started with {STORE_FLAG} (this one keeps "
                              "no responses); send the earlier turns in 'input'", "previous_response_id")
        return False, None, []
    prior: list[dict] = []
    if previous_id is not None:
        found = store.get(previous_id)
        if found is None:
            raise bad_request(f"previous response {previous_id!r} was not found: it was never stored or the "
                              "store evicted it", "previous_response_id", "previous_response_not_found")
        prior = [dict(m) for m in found.history]
    return keep is not False, previous_id, prior


def _input_messages(value: Any) -> list[dict]:
    """`input` (a string, or a list of items) -> chat messages."""
    if isinstance(value, str):
        if not value:
            raise bad_request("'input' must not be empty", "input")
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise bad_request("'input' must be a non-empty string or a non-empty list of input items", "input")
    messages: list[dict] = []
    reasoning = ""  # a reasoning item goes with the assistant turn that follows it
    for i, item in enumerate(value):
        path = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"'{path}' must be an object, got {show(item)}", "input")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise bad_request(f"'{path}.role' must be one of {', '.join(_ROLES)}, got {show(role)}", "input")
            message = {"role": _ROLES[role], "content": _content(item.get("content"), f"{path}.content")}
            if role == "assistant" and reasoning:
                message["reasoning_content"], reasoning = reasoning, ""
            messages.append(message)
        elif kind == "function_call":
            call = {"id": _item_str(item, "call_id", path), "type": "function",
                    "function": {"name": _item_str(item, "name", path),
                                 "arguments": _item_str(item, "arguments", path, allow_empty=True)}}
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":  # parallel calls share one assistant turn
                last = {"role": "assistant", "content": ""}
                if reasoning:
                    last["reasoning_content"], reasoning = reasoning, ""
                messages.append(last)
            last.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": _item_str(item, "call_id", path),
                             "content": _output(item.get("output"), f"{path}.output")})
        elif kind == "reasoning":
            reasoning += _reasoning_text(item, path)
        else:
            raise bad_request(f"'{path}.type' {show(kind)} is not a supported input item; supported: {_ITEM_TYPES}",
                              "input")
    if not messages:
        raise bad_request("'input' holds no message, function_call or function_call_output item", "input")
    return messages


def _content(value: Any, path: str) -> str:
    """A message's content: a string, or a list of text parts (concatenated)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise bad_request(f"'{path}' must be a string or a list of content parts, got {show(value)}", "input")
    texts = []
    for j, part in enumerate(value):
        kind = part.get("type") if isinstance(part, dict) else None
        key = _TEXT_PARTS.get(kind)  # type: ignore[arg-type]
        if key is None:
            raise bad_request(f"'{path}[{j}]' must be a text part ({', '.join(_TEXT_PARTS)}); this server serves "
                              f"text only, got {show(part)}", "input")
        if not isinstance(part.get(key), str):
            raise bad_request(f"'{path}[{j}].{key}' must be a string", "input")
        texts.append(part[key])
    return "".join(texts)


def _output(value: Any, path: str) -> str:
    """A function_call_output's output: a string, or a list of input_text parts."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return _content(value, path)
    raise bad_request(f"'{path}' must be a string or a list of input_text parts, got {show(value)}", "input")


def _reasoning_text(item: dict, path: str) -> str:
    """A reasoning item handed back: its reasoning_text parts, else its summary."""
    for key, part_type in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = item.get(key)
        if parts is None:
            continue
        if not isinstance(parts, list) or not all(isinstance(p, dict) and p.get("type") == part_type and
                                                  isinstance(p.get("text"), str) for p in parts):
            raise bad_request(f"'{path}.{key}' must be a list of {part_type} parts", "input")
        if parts:
            return "".join(p["text"] for p in parts)
    return ""


def _item_str(item: dict, key: str, path: str, allow_empty: bool = False) -> str:
    value = item.get(key)
    if not isinstance(value, str) or (not value and not allow_empty):
        raise bad_request(f"'{path}.{key}' must be a non-empty string, got {show(value)}", "input")
    return value


def _tools(value: Any) -> tuple[list[dict] | None, list[dict]]:
    """Responses' flat function tools -> (chat tools, validated; the tools as the response echoes them)."""
    if value is None:
        return None, []
    if not isinstance(value, list):
        raise bad_request(f"'tools' must be a list of tool objects, got {show(value)}", "tools")
    chat = []
    for i, tool in enumerate(value):
        if not isinstance(tool, dict):
            raise bad_request(f"'tools[{i}]' must be an object, got {show(tool)}", "tools")
        if tool.get("type") != "function":
            raise bad_request(f"'tools[{i}].type' {show(tool.get('type'))} is not supported: this server runs "
                              "function tools only", "tools")
        chat.append({"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}})
    try:
        chat = validate_tools(chat)
    except ValueError as e:
        raise bad_request(str(e).replace(".function", ""), "tools") from None
    echo = [{"type": "function", "name": t["function"]["name"], "description": t["function"].get("description"),
             "parameters": t["function"].get("parameters"), "strict": t["function"].get("strict")}
            for t in chat]
    return chat or None, echo


def _tool_choice(value: Any, has_tools: bool) -> tuple[str | dict | None, str | dict]:
    """Responses' tool_choice -> (chat's, the response's echo); "auto" is OpenAI's default either way."""
    if value is None:
        return None, "auto"
    if isinstance(value, str):
        if value not in ("none", "auto", "required"):
            raise bad_request(f"'tool_choice' must be 'none', 'auto', 'required' or an object naming a function, "
                              f"got {value!r}", "tool_choice")
        return value, value
    if not isinstance(value, dict) or value.get("type") != "function":
        raise bad_request(f"'tool_choice' must be 'none', 'auto', 'required' or {{\"type\": \"function\", \"name\": "
                          f"...}}; got {show(value)}", "tool_choice")
    name = value.get("name")
    if not isinstance(name, str) or not name:
        raise bad_request("'tool_choice.name' must name a function of 'tools'", "tool_choice")
    if not has_tools:
        raise bad_request(f"'tool_choice' names function {name!r}, but the request has no 'tools'", "tool_choice")
    return {"type": "function", "function": {"name": name}}, {"type": "function", "name": name}


def _text(value: Any) -> tuple[dict | None, dict]:
    """`text` ({"format": ...}) -> (chat's response_format or None, the response's echo)."""
    if value is None:
        return None, {"format": {"type": "text"}}
    if not isinstance(value, dict):
        raise bad_request(f"'text' must be an object, got {show(value)}", "text")
    fmt = value.get("format")
    echo = {k: value[k] for k in ("verbosity",) if value.get(k) is not None}
    if fmt is None or (isinstance(fmt, dict) and fmt.get("type") == "text"):
        return None, {"format": {"type": "text"}, **echo}
    if not isinstance(fmt, dict):
        raise bad_request(f"'text.format' must be an object, got {show(fmt)}", "text.format")
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}, {"format": {"type": "json_object"}, **echo}
    if fmt.get("type") != "json_schema":
        raise bad_request(f"'text.format.type' must be 'text', 'json_object' or 'json_schema', got "
                          f"{show(fmt.get('type'))}", "text.format")
    name, schema, strict = fmt.get("name"), fmt.get("schema"), fmt.get("strict")
    if not isinstance(name, str) or not name:
        raise bad_request("'text.format.name' must be a non-empty string", "text.format")
    if not isinstance(schema, dict):
        raise bad_request("'text.format.schema' must be a JSON schema object", "text.format")
    if strict is not None and not isinstance(strict, bool):
        raise bad_request("'text.format.strict' must be a boolean", "text.format")
    echoed = {"type": "json_schema", "name": name, "schema": schema, "strict": strict,
              "description": fmt.get("description")}
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": strict}}, \
        {"format": echoed, **echo}


def _metadata(value: Any) -> dict[str, str] | None:
    """OpenAI's limits: at most 16 pairs, keys up to 64 characters, string values up to 512."""
    if value is None:
        return None
    if (not isinstance(value, dict) or len(value) > 16 or
            not all(isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512
                    for k, v in value.items())):
        raise bad_request("'metadata' must be an object of at most 16 string values (keys up to 64 characters, "
                          "values up to 512)", "metadata")
    return value


def _reasoning(value: Any) -> dict:
    """`reasoning` is accepted and echoed: how much a model thinks is up to its chat template here."""
    if value is None:
        return {"effort": None, "summary": None}
    if not isinstance(value, dict):
        raise bad_request(f"'reasoning' must be an object, got {show(value)}", "reasoning")
    return {"effort": value.get("effort"), "summary": value.get("summary")}


def _renamed(e: APIError) -> APIError:
    """An error parse_chat raised, in the Responses body's names."""
    message = e.message
    for chat_name, name in _CHAT_NAMES.items():
        message = message.replace(f"'{chat_name}'", f"'{name}'")
    return APIError(e.status, message, e.type, _CHAT_NAMES.get(e.param or "", e.param), e.code)

