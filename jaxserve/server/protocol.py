"""Request validation for /v1/completions and /v1/chat/completions.

A JSON body becomes a `GenerationRequest` (token ids per prompt + SamplingParams) or an
`APIError(400)` that names the offending field. Nothing malformed gets past this module: types are
checked here, ranges by `SamplingParams.validate`, lengths against the engine's max_model_len.
Unknown fields are accepted and logged once per request at WARNING (as vLLM does), except features
we do not implement (echo, suffix, ...), which are refused rather than silently dropped. Output
constraints (response_format, structured_outputs, guided_*) are read by structured_fields.py, tools
by server/tools/validation.py; compiling their grammars happens after this module (app.py).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from collections.abc import Mapping
from typing import Any, Literal, Protocol

from jaxserve.core.sampling_params import INT64_MAX, INT64_MIN, MAX_LOGPROBS, SamplingParams
from jaxserve.server.errors import bad_request, model_not_found
from jaxserve.server.structured_fields import STRUCTURED_FIELDS, parse_structured
from jaxserve.server.tools.tags import ToolTags
from jaxserve.structured.spec import StructuredOutputs

logger = logging.getLogger("jaxserve.server")

MAX_PROMPTS = 128              # prompts in one /v1/completions list
MAX_CACHE_SALT_CHARS = 1024
# Every field the parsers below read; anything else in a body is logged as ignored.
_COMMON_FIELDS = frozenset({
    "model", "max_tokens", "logprobs", "n", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
    "presence_penalty", "frequency_penalty", "logit_bias", "seed", "min_tokens", "stop", "stop_token_ids",
    "ignore_eos", "skip_special_tokens", "stream", "stream_options", "user", "cache_salt", "priority",
    "include_stop_str_in_output", *STRUCTURED_FIELDS})
COMPLETION_FIELDS = _COMMON_FIELDS | {"prompt", "echo", "suffix", "best_of"}
CHAT_FIELDS = _COMMON_FIELDS | {"messages", "max_completion_tokens", "top_logprobs", "tools", "functions",
                                "tool_choice", "parallel_tool_calls", "chat_template_kwargs",
                                "add_generation_prompt"}


class TokenizerLike(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...
    def apply_chat_template(self, messages: Any, add_generation_prompt: bool = True, add_special_tokens: bool = False,
                            **kw: Any) -> list[int]: ...
    def decode(self, token_ids: Any, skip_special_tokens: bool = True) -> str: ...
    def convert_ids_to_tokens(self, token_ids: Any) -> list[str]: ...


@dataclasses.dataclass(frozen=True)
class ModelContext:
    """What validation needs to know about the served model."""

    served_model_names: tuple[str, ...]
    max_model_len: int
    vocab_size: int             # the model's embedding rows: valid token ids are [0, vocab_size)
    tokenizer: TokenizerLike
    reasoning_parser: type | None = None   # server/reasoning/ class (--reasoning-parser)
    tool_parser: type | None = None        # server/tools/ class (--tool-call-parser, default hermes)
    tool_tags: ToolTags = ToolTags()       # how the vocabulary holds tool_parser's tags
    auto_tool_choice: bool = False         # --enable-auto-tool-choice: tool_choice "auto" is parsed
    lora_names: tuple[str, ...] = ()       # --lora-modules: a request's `model` may name an adapter
    sampling_defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # --generation-config


@dataclasses.dataclass
class GenerationRequest:
    kind: Literal["completion", "chat"]
    model: str
    prompts: list[list[int]]    # one engine request per prompt; each samples params.n choices
    params: SamplingParams
    stream: bool
    include_usage: bool
    priority: int
    cache_salt: str | None
    include_stop_str_in_output: bool
    structured_field: str | None = None     # the request field that set params.structured_outputs
    tools: list[dict] | None = None         # chat: validated OpenAI tools
    tool_choice: str | dict = "none"        # "none" | "auto" | "required" | {"type": "function", ...}
    parallel_tool_calls: bool = True
    prompt_text: str = ""                   # chat with a reasoning parser: the rendered prompt
    grammar: Any = None                     # CompiledGrammar, attached after parsing (app.py)

    @property
    def forces_tool_calls(self) -> bool:
        return self.tools is not None and self.tool_choice not in ("none", "auto")

    @property
    def parses_tool_calls(self) -> bool:
        return self.tools is not None and self.tool_choice != "none"


# ---------------------------------------------------------------- body -> JSON object


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """Strict UTF-8 JSON object: no NaN/Infinity literals, no lone surrogates, bounded nesting."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad_request(f"request body is not valid UTF-8 (byte {e.start})") from None
    if text.startswith("\ufeff"):
        text = text[1:]
    try:
        obj = json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise bad_request("request body nests JSON too deeply") from None
    except ValueError as e:  # JSONDecodeError, NaN/Infinity, integers over 4300 digits
        raise bad_request(f"request body is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise bad_request(f"request body must be a JSON object, got {type(obj).__name__}")
    try:  # "\ud800" escapes decode to lone surrogates, which no tokenizer can take
        json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise bad_request("request body contains an unpaired UTF-16 surrogate escape") from None
    except RecursionError:
        raise bad_request("request body nests JSON too deeply") from None
    return obj


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


# ---------------------------------------------------------------- typed field readers


def int_field(body: dict, name: str, default: Any = None, lo: int | None = None, hi: int | None = None) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"'{name}' must be an integer, got {show(value)}", name)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise bad_request(f"'{name}' must be in [{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}], "
                          f"got {value}", name)
    return value


def _number(body: dict, name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad_request(f"'{name}' must be a number, got {show(value)}", name)
    if isinstance(value, int) and abs(value) > 2**53:  # float() of a 400-digit int overflows
        raise bad_request(f"'{name}' is out of range", name)
    value = float(value)
    if not math.isfinite(value):
        raise bad_request(f"'{name}' must be a finite number", name)
    return value


def bool_field(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"'{name}' must be a boolean, got {show(value)}", name)
    return value


def str_field(body: dict, name: str) -> str | None:
    """body[name], None or a string (else a 400 naming it)."""
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise bad_request(f"'{name}' must be a string, got {show(value)}", name)
    return value


def show(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=True, default=str)
    return f"{type(value).__name__} {text[:40]}{'...' if len(text) > 40 else ''}"


def _stop(body: dict) -> list[str]:
    value = body.get("stop")
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise bad_request("'stop' must be a string or a list of strings", "stop")
    return value


def token_list(value: Any, name: str, vocab_size: int, allow_empty: bool = False) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise bad_request(f"'{name}' must be a list of integer token ids", name)
    if not value and not allow_empty:
        raise bad_request(f"'{name}' must not be empty", name)
    bad = next((t for t in value if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise bad_request(f"'{name}' holds token id {bad}, outside the vocabulary [0, {vocab_size})", name)
    return value


def _logit_bias(body: dict) -> dict[int, float] | None:
    value = body.get("logit_bias")
    if value is None:
        return None
    if not isinstance(value, dict):
        raise bad_request("'logit_bias' must be an object mapping token ids to biases", "logit_bias")
    out: dict[int, float] = {}
    for key, bias in value.items():
        try:
            tok = int(key)
        except ValueError:
            raise bad_request(f"'logit_bias' key {key!r} is not an integer token id", "logit_bias") from None
        if isinstance(bias, bool) or not isinstance(bias, (int, float)):
            raise bad_request(f"'logit_bias' value for {key!r} must be a number", "logit_bias")
        out[tok] = float(bias)
    return out


def refuse(body: dict, name: str, allowed: tuple = (None,), why: str = "is not supported") -> None:
    if body.get(name) not in allowed:
        raise bad_request(f"'{name}' {why}", name)


# ---------------------------------------------------------------- shared request parts


def model_field(body: dict, ctx: ModelContext) -> str:
    model = str_field(body, "model")
    if model is None:
        return ctx.served_model_names[0]
    if model not in ctx.served_model_names and model not in ctx.lora_names:
        raise model_not_found(model, ctx.served_model_names + ctx.lora_names)
    return model


def warn_ignored(body: dict, known: frozenset[str]) -> None:
    """Unknown fields are accepted (clients send newer OpenAI fields) but never silently."""
    ignored = sorted(set(body) - known)
    if ignored:
        logger.warning("The following fields were present in the request but ignored: {%s}",
                       ", ".join(repr(name) for name in ignored))


def _sampling(body: dict, ctx: ModelContext, max_tokens: int | None, logprobs: int | None,
              structured: StructuredOutputs | None) -> SamplingParams:
    stop_token_ids = body.get("stop_token_ids")
    defaults = ctx.sampling_defaults
    params = SamplingParams(
        n=int_field(body, "n", 1),
        temperature=_number(body, "temperature", defaults.get("temperature", 1.0)),
        top_p=_number(body, "top_p", defaults.get("top_p", 1.0)),
        top_k=int_field(body, "top_k", defaults.get("top_k", -1)),
        min_p=_number(body, "min_p", defaults.get("min_p", 0.0)),
        repetition_penalty=_number(body, "repetition_penalty", defaults.get("repetition_penalty", 1.0)),
        presence_penalty=_number(body, "presence_penalty", 0.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0),
        logit_bias=_logit_bias(body),
        seed=int_field(body, "seed", None, INT64_MIN, INT64_MAX),
        max_tokens=max_tokens,
        min_tokens=int_field(body, "min_tokens", 0),
        stop=_stop(body),
        stop_token_ids=[] if stop_token_ids is None else token_list(stop_token_ids, "stop_token_ids",
                                                                    ctx.vocab_size, allow_empty=True),
        ignore_eos=bool_field(body, "ignore_eos", False),
        logprobs=logprobs,
        skip_special_tokens=bool_field(body, "skip_special_tokens", True),
        structured_outputs=structured,
    )
    try:
        params.validate(ctx.vocab_size)
    except ValueError as e:  # messages start with the field name
        field = str(e).split(" ", 1)[0].strip("'")
        raise bad_request(str(e), field) from None
    return params


def _stream_flags(body: dict) -> tuple[bool, bool]:
    stream = bool_field(body, "stream", False)
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not isinstance(options, dict):
        raise bad_request("'stream_options' must be an object", "stream_options")
    if not stream:
        raise bad_request("'stream_options' is only allowed when 'stream' is true", "stream_options")
    return stream, bool_field(options, "include_usage", False)


def check_lengths(prompts: list[list[int]], max_tokens: int | None, ctx: ModelContext, prompt_param: str,
                   max_tokens_param: str | None) -> None:
    """A prompt that fills the context alone is the prompt's fault; prompt + a max_tokens the client
    sent over the context is that field's fault (as OpenAI and vLLM name them). `max_tokens_param`
    is None when `max_tokens` is a default the client did not send."""
    for i, ids in enumerate(prompts):
        what = f"{prompt_param}[{i}]" if len(prompts) > 1 else prompt_param
        if len(ids) >= ctx.max_model_len:
            # the client sees why; the server's log gets one line (the access line says only "400")
            logger.info("refused a request: %s has %d tokens, max_model_len is %d", what, len(ids), ctx.max_model_len)
            raise bad_request(f"'{what}' has {len(ids)} tokens, which leaves no room for output within "
                              f"max_model_len {ctx.max_model_len}", prompt_param, "context_length_exceeded")
        if max_tokens is not None and len(ids) + max_tokens > ctx.max_model_len:
            limit = max_tokens_param or "the default max_tokens"
            logger.info("refused a request: %s has %d tokens + %s %d > max_model_len %d", what, len(ids), limit,
                        max_tokens, ctx.max_model_len)
            raise bad_request(f"'{what}' ({len(ids)} tokens) + {limit} ({max_tokens}) = {len(ids) + max_tokens} "
                              f"exceeds max_model_len ({ctx.max_model_len})", max_tokens_param or prompt_param,
                              "context_length_exceeded")


def common_fields(kind: Literal["completion", "chat"], body: dict, ctx: ModelContext, max_tokens: int | None,
            logprobs: int | None) -> GenerationRequest:
    """Every field but the prompt (validated first: they are cheap, tokenization is not)."""
    model = model_field(body, ctx)
    structured, structured_field = parse_structured(body)
    params = _sampling(body, ctx, max_tokens, logprobs, structured)
    stream, include_usage = _stream_flags(body)
    str_field(body, "user")  # accepted and ignored, but it must be a string
    salt = str_field(body, "cache_salt")
    if salt is not None and not 0 < len(salt) <= MAX_CACHE_SALT_CHARS:
        raise bad_request(f"'cache_salt' must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters",
                          "cache_salt")
    return GenerationRequest(kind, model, [], params, stream, include_usage,
                             priority=int_field(body, "priority", 0, INT64_MIN, INT64_MAX), cache_salt=salt,
                             include_stop_str_in_output=bool_field(body, "include_stop_str_in_output", False),
                             structured_field=structured_field)


# ---------------------------------------------------------------- the two endpoints


def parse_completion(body: dict[str, Any], ctx: ModelContext) -> GenerationRequest:
    """A /v1/completions body -> GenerationRequest (raises APIError(400) naming the field)."""
    warn_ignored(body, COMPLETION_FIELDS)
    refuse(body, "echo", (None, False), "= true is not supported")
    refuse(body, "suffix", (None, ""))
    refuse(body, "best_of", (None, 1), "> 1 is not supported")
    if "max_tokens" in body and body["max_tokens"] is None:
        max_tokens = None  # explicit null: up to the context limit
    else:
        max_tokens = int_field(body, "max_tokens", 16, 1)  # OpenAI's default for completions
    logprobs = int_field(body, "logprobs", None, 0, MAX_LOGPROBS)
    if body.get("prompt") is None:
        raise bad_request("'prompt' is required", "prompt")
    gen = common_fields("completion", body, ctx, max_tokens, logprobs)
    gen.prompts = _completion_prompts(body, ctx)
    sent = "max_tokens" if body.get("max_tokens") is not None else None  # else the default of 16 applies
    check_lengths(gen.prompts, max_tokens, ctx, "prompt", sent)
    return gen


def _completion_prompts(body: dict, ctx: ModelContext) -> list[list[int]]:
    prompt = body["prompt"]
    if isinstance(prompt, str):
        items: list[Any] = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        items = [prompt]  # one prompt given as token ids
    elif isinstance(prompt, list) and prompt:
        items = prompt
    else:
        raise bad_request("'prompt' must be a non-empty string, list of strings, list of token ids or list "
                          "of token-id lists", "prompt")
    if len(items) > MAX_PROMPTS:
        raise bad_request(f"'prompt' holds {len(items)} prompts; at most {MAX_PROMPTS} per request", "prompt")
    out = []
    for item in items:
        if isinstance(item, str):
            if not item:
                raise bad_request("'prompt' must not be an empty string", "prompt")
            out.append(ctx.tokenizer.encode(item))
        else:
            out.append(token_list(item, "prompt", ctx.vocab_size))
        if not out[-1]:
            raise bad_request("'prompt' encodes to zero tokens", "prompt")
    return out


