"""POST /tokenize and /detokenize in vLLM's shapes, and GET /version: the served model's tokenizer
without the engine (clients count a prompt's tokens, or check a chat template's rendering, before
they send it).

/tokenize takes a text (`prompt`, special tokens added by default) or a chat (`messages`, rendered
by the chat template as /v1/chat/completions renders them; `add_generation_prompt`,
`continue_final_message`, `chat_template_kwargs`, `tools`) and answers `count`, `max_model_len`,
`tokens` and, with `return_token_strs`, each token's string. /detokenize takes `tokens` and answers
the text, special tokens included.
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

from jaxserve.server.chat_request import chat_inputs, render_chat
from jaxserve.server.errors import bad_request
from jaxserve.server.protocol import ModelContext, bool_field, model_field, token_list, warn_ignored
from jaxserve.server.tools.validation import validate_tools

TOKENIZE_FIELDS = frozenset({"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt",
                             "continue_final_message", "return_token_strs", "chat_template_kwargs", "tools"})
DETOKENIZE_FIELDS = frozenset({"model", "tokens"})


def tokenize(body: dict[str, Any], ctx: ModelContext) -> dict[str, Any]:
    """A /tokenize body -> its response (APIError(400) naming the field at fault)."""
    warn_ignored(body, TOKENIZE_FIELDS)
    model_field(body, ctx)
    if ("prompt" in body) == ("messages" in body):
        raise bad_request("give either 'prompt' (a text) or 'messages' (a chat), not both and not neither",
                          "prompt")
    if "prompt" in body:
        if not isinstance(body["prompt"], str):
            raise bad_request("'prompt' must be a string", "prompt")
        ids = ctx.tokenizer.encode(body["prompt"], add_special_tokens=bool_field(body, "add_special_tokens", True))
    else:
        ids = _chat_tokens(body, ctx)
    strs = ctx.tokenizer.convert_ids_to_tokens(ids) if bool_field(body, "return_token_strs", False) else None
    return {"count": len(ids), "max_model_len": ctx.max_model_len, "tokens": ids, "token_strs": strs}


def _chat_tokens(body: dict[str, Any], ctx: ModelContext) -> list[int]:
    messages, kwargs = chat_inputs(body)
    add_generation_prompt = bool_field(body, "add_generation_prompt", True)
    if bool_field(body, "continue_final_message", False):
        if add_generation_prompt:  # the last message is left open: no new turn after it
            raise bad_request("'continue_final_message' needs 'add_generation_prompt': false",
                              "continue_final_message")
        kwargs = {**kwargs, "continue_final_message": True}
    if body.get("tools") is not None:
        try:
            kwargs = {**kwargs, "tools": validate_tools(body["tools"])}
        except ValueError as e:
            raise bad_request(str(e), "tools") from None
    return render_chat(ctx, messages, add_generation_prompt, kwargs,
                       add_special_tokens=bool_field(body, "add_special_tokens", False))


def detokenize(body: dict[str, Any], ctx: ModelContext) -> dict[str, Any]:
    """A /detokenize body -> {"prompt": text} (APIError(400) for ids outside the vocabulary)."""
    warn_ignored(body, DETOKENIZE_FIELDS)
    model_field(body, ctx)
    ids = token_list(body.get("tokens"), "tokens", ctx.vocab_size, allow_empty=True)
    return {"prompt": ctx.tokenizer.decode(ids, skip_special_tokens=False)}


def version() -> dict[str, str]:
    return {"version": importlib.metadata.version("jaxserve")}
