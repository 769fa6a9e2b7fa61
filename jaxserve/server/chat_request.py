"""/v1/chat/completions bodies -> a validated GenerationRequest: the messages rendered by the chat
template (with the tools, and the caller's template kwargs, never the reserved ones), tool_choice
checked against the tools and the server's parser."""

from __future__ import annotations

from typing import Any

from jaxserve.core.sampling_params import MAX_LOGPROBS
from jaxserve.server.errors import bad_request, server_error
from jaxserve.server.protocol import (CHAT_FIELDS, GenerationRequest, ModelContext, bool_field, check_lengths,
    common_fields, int_field, refuse, show, warn_ignored)
from jaxserve.server.tools.validation import validate_tool_choice, validate_tools
from jaxserve.text.tokenizer import ChatTemplateUnavailable

_RESERVED_TEMPLATE_KWARGS = frozenset({"conversation", "messages", "tokenize", "add_generation_prompt",
                                       "return_dict", "return_tensors", "tools", "documents"})


def parse_chat(body: dict[str, Any], ctx: ModelContext) -> GenerationRequest:
    """A /v1/chat/completions body -> GenerationRequest (raises APIError(400) naming the field, or
    APIError(500) when the server cannot render chat templates)."""
    warn_ignored(body, CHAT_FIELDS)
    refuse(body, "functions", why="(the legacy function-calling field) is not supported; use 'tools'")
    tools, tool_choice, parallel = _tools(body, ctx)
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = int_field(body, name, None, 1)
    want = bool_field(body, "logprobs", False)
    top = int_field(body, "top_logprobs", None, 0, MAX_LOGPROBS)
    if top is not None and not want:
        raise bad_request("'top_logprobs' requires 'logprobs': true", "top_logprobs")
    logprobs = (top or 0) if want else None
    messages, kwargs = chat_inputs(body)
    add_generation_prompt = bool_field(body, "add_generation_prompt", True)
    gen = common_fields("chat", body, ctx, max_tokens, logprobs)
    if tool_choice not in ("none", "auto") and gen.params.structured_outputs is not None:
        raise bad_request(f"'tool_choice' {show(tool_choice)} forces tool calls; it cannot be combined with "
                          f"'{gen.structured_field}'", "tool_choice")
    gen.tools, gen.tool_choice, gen.parallel_tool_calls = tools, tool_choice, parallel
    if tools is not None:
        kwargs = {**kwargs, "tools": tools}
    ids = render_chat(ctx, messages, add_generation_prompt, kwargs)
    if not ids:
        raise bad_request("'messages' render to zero tokens", "messages")
    gen.prompts = [ids]
    check_lengths(gen.prompts, max_tokens, ctx, "messages", name if max_tokens is not None else None)
    if ctx.reasoning_parser is not None:  # where the reasoning stands when generation begins
        gen.prompt_text = ctx.tokenizer.decode(ids, skip_special_tokens=False)
    return gen


def chat_inputs(body: dict) -> tuple[list, dict[str, Any]]:
    """(messages, chat_template_kwargs) of a chat body, checked: a non-empty list, and template
    variables that are identifiers other than the ones the server sets itself."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list of message objects", "messages")
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict) or any(not isinstance(k, str) or not k.isidentifier() or
                                           k in _RESERVED_TEMPLATE_KWARGS for k in kwargs):
        raise bad_request("'chat_template_kwargs' must be an object of template variables", "chat_template_kwargs")
    return messages, kwargs


def render_chat(ctx: ModelContext, messages: list, add_generation_prompt: bool, kwargs: dict[str, Any],
                add_special_tokens: bool = False) -> list[int]:
    """The messages through the chat template, encoded: APIError(400) where the messages are at
    fault, APIError(500) where the server cannot render templates."""
    try:
        return ctx.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                 add_special_tokens=add_special_tokens, **kwargs)
    except (ValueError, TypeError) as e:
        raise bad_request(str(e), "messages") from None
    except ChatTemplateUnavailable as e:  # the server's fault: the cause is logged with the 500
        raise server_error(str(e), "chat_template_unavailable") from e


def _tools(body: dict, ctx: ModelContext) -> tuple[list[dict] | None, str | dict, bool]:
    """(validated tools or None, tool_choice, parallel_tool_calls); OpenAI's defaults: "auto" with
    tools, "none" without."""
    parallel = bool_field(body, "parallel_tool_calls", True)
    raw_tools = body.get("tools")
    try:
        tools = validate_tools(raw_tools) if raw_tools is not None else None
    except ValueError as e:
        raise bad_request(str(e), "tools") from None
    raw_choice = body.get("tool_choice")
    if raw_choice is None:
        raw_choice = "auto" if tools else "none"
    try:
        choice = validate_tool_choice(raw_choice, tools)
    except ValueError as e:
        raise bad_request(str(e), "tool_choice") from None
    if not tools:
        return None, "none", parallel
    if choice == "auto" and not ctx.auto_tool_choice:
        raise bad_request('tool_choice "auto" needs a server started with --enable-auto-tool-choice and '
                          '--tool-call-parser; use "required", a named function, or "none"', "tool_choice")
    return tools, choice, parallel
