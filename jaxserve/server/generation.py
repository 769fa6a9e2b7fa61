"""A validated GenerationRequest -> engine requests -> an SSE stream or one JSON response.

A /v1/completions list prompt becomes one engine request per prompt; choice indices are
`prompt_index * n + sample_index`. Both response styles consume the same `merged_deltas`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
import uuid
from typing import Any, AsyncIterator, Callable

from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, StreamingResponse
from starlette.types import Send

from jaxserve.core.request import Request
from jaxserve.server import responses as R
from jaxserve.server.chat_output import ChoiceOutput, finish_reason
from jaxserve.server.errors import APIError, bad_request, timed_out, unavailable
from jaxserve.server.protocol import GenerationRequest
from jaxserve.server.state import ServerState
from jaxserve.server.streaming import SSE_DONE, RequestRun, RequestTimeout, merged_deltas, sse


class SSEResponse(StreamingResponse):
    """text/event-stream that always runs `on_close` (which aborts unfinished engine requests) when
    the response ends, also when the client went away before the body generator even started."""

    def __init__(self, body: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(body, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def stream_response(self, send: Send) -> None:
        try:
            async with contextlib.aclosing(self.body_iterator):  # type: ignore[type-var]
                await super().stream_response(send)
        finally:
            self._on_close()  # synchronous: this may run in a cancelled task


@dataclasses.dataclass
class _Response:
    """Identity shared by every chunk of one response."""

    id: str
    created: int
    model: str
    kind: str


def submit(state: ServerState, gen: GenerationRequest, arrival: float) -> tuple[_Response, list[RequestRun]]:
    """Creates and submits one engine request per prompt; on failure aborts what was submitted."""
    engine = state.require_ready()
    prefix = "cmpl" if gen.kind == "completion" else "chatcmpl"
    resp = _Response(f"{prefix}-{uuid.uuid4().hex}", int(time.time()), gen.model, gen.kind)
    timeout = state.config.request_timeout
    deadline = arrival + timeout if timeout is not None else None
    # A tool parser reads the text: its tags must survive decoding even where they are special tokens.
    decoder = state.model.tool_tags.decoder(state.tokenizer) if gen.parses_tool_calls else state.tokenizer
    runs = []
    for i, ids in enumerate(gen.prompts):
        request = Request(f"{resp.id}-{i}", ids, dataclasses.replace(gen.params), state.tokenizer.eos_token_ids,
                          priority=gen.priority, cache_salt=gen.cache_salt, grammar=gen.grammar,
                          lora_name=gen.model if gen.model in state.model.lora_names else None,
                          arrival_time=arrival)
        runs.append(RequestRun(engine, decoder, request, i * gen.params.n,
                               gen.include_stop_str_in_output, state.metrics, deadline))
    try:
        for run in runs:
            run.submit()
    except ValueError as e:  # the engine's own checks (n > max_num_seqs, KV pool too small, ...)
        _close(runs)
        raise bad_request(str(e)) from None
    except RuntimeError as e:  # the engine thread died
        _close(runs)
        raise unavailable(str(e), "engine_failed") from None
    return resp, runs


def _close(runs: list[RequestRun]) -> None:
    for run in runs:
        run.close()


def _usage(runs: list[RequestRun]) -> dict:
    return R.usage(sum(r.num_prompt_tokens for r in runs), sum(r.num_completion_tokens for r in runs),
                   sum(r.num_cached_tokens for r in runs))


# ---------------------------------------------------------------- streaming


def stream(state: ServerState, gen: GenerationRequest, resp: _Response, runs: list[RequestRun]) -> SSEResponse:
    body = _completion_events if gen.kind == "completion" else _chat_events
    return SSEResponse(body(state, gen, resp, runs), lambda: _close(runs))


async def _completion_events(state: ServerState, gen: GenerationRequest, resp: _Response,
                             runs: list[RequestRun]) -> AsyncIterator[str]:
    builders: dict[int, R.CompletionLogprobs] = {}
    try:
        async for d in merged_deltas(runs):
            if not d.text and d.finish_reason is None and not d.logprobs:
                continue  # the detokenizer is holding this token's text back
            logprobs = None
            if gen.params.logprobs is not None:
                builder = builders.setdefault(d.index, R.CompletionLogprobs(state.strings))
                logprobs = builder.build(d.logprobs)
            yield sse(R.completion_chunk(resp.id, resp.created, resp.model, d.index, d.text, logprobs,
                                         d.finish_reason, gen.include_usage))
        if gen.include_usage:
            yield sse(R.usage_chunk(gen.kind, resp.id, resp.created, resp.model, _usage(runs)))
    except RequestTimeout:
        yield sse(timed_out(state.config.request_timeout or 0.0).body())
    finally:
        _close(runs)
    yield SSE_DONE


def _choice_outputs(state: ServerState, gen: GenerationRequest, num_choices: int) -> list[ChoiceOutput]:
    ctx = state.model
    tool_cls = ctx.tool_parser if gen.parses_tool_calls else None
    return [ChoiceOutput(ctx.reasoning_parser, tool_cls, gen.tools, gen.prompt_text, gen.forces_tool_calls)
            for _ in range(num_choices)]


async def _chat_events(state: ServerState, gen: GenerationRequest, resp: _Response,
                       runs: list[RequestRun]) -> AsyncIterator[str]:
    outputs = _choice_outputs(state, gen, len(runs) * gen.params.n)
    try:
        for index in range(len(outputs)):
            yield sse(R.chat_chunk(resp.id, resp.created, resp.model, index, {"role": "assistant", "content": ""},
                                   None, None, gen.include_usage))
        async for d in merged_deltas(runs):
            if not d.text and d.finish_reason is None and not d.logprobs:
                continue
            out = outputs[d.index]
            if out.plain:
                delta = {"content": d.text} if d.text or d.finish_reason is None else {}
            else:
                delta = out.feed(d.text) if d.text else {}
                if d.finish_reason is not None:
                    delta = _merge(delta, out.finish(d.finish_reason == "length"))
                elif not delta and not d.logprobs:
                    continue  # held back by a parser (a partial tag)
            logprobs = R.chat_logprobs(d.logprobs, state.strings) if gen.params.logprobs is not None else None
            yield sse(R.chat_chunk(resp.id, resp.created, resp.model, d.index, delta, logprobs,
                                   finish_reason(d.finish_reason, out.made_tool_calls), gen.include_usage))
        if gen.include_usage:
            yield sse(R.usage_chunk(gen.kind, resp.id, resp.created, resp.model, _usage(runs)))
    except RequestTimeout:
        yield sse(timed_out(state.config.request_timeout or 0.0).body())
    finally:
        _close(runs)
    yield SSE_DONE


def _merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Two deltas of one chunk: texts concatenate, tool-call fragments follow each other."""
    out = dict(a)
    for key, value in b.items():
        out[key] = out[key] + value if key in out else value
    return out


# ---------------------------------------------------------------- one JSON response


async def complete(state: ServerState, gen: GenerationRequest, resp: _Response, runs: list[RequestRun],
                   http: HTTPRequest) -> JSONResponse:
    """Runs to the end (aborting if the client disconnects first) and returns the whole response."""
    num_choices = len(runs) * gen.params.n
    texts: list[list[str]] = [[] for _ in range(num_choices)]
    entries: list[list[R.TokenLogprob]] = [[] for _ in range(num_choices)]
    finish: list[str | None] = [None] * num_choices

    async def collect() -> None:
        async for d in merged_deltas(runs):
            texts[d.index].append(d.text)
            entries[d.index].extend(d.logprobs)
            if d.finish_reason is not None:
                finish[d.index] = d.finish_reason

    try:
        gone = await unless_disconnected(collect(), http)
    except RequestTimeout:
        raise timed_out(state.config.request_timeout or 0.0) from None
    finally:
        _close(runs)
    if gone:  # nobody to answer; the engine requests are aborted
        return JSONResponse(APIError(499, "client disconnected").body(), status_code=499)
    want = gen.params.logprobs is not None
    outputs = _choice_outputs(state, gen, num_choices) if gen.kind == "chat" else []
    choices: list[dict[str, Any]] = []
    for i in range(num_choices):
        text = "".join(texts[i])
        if gen.kind == "completion":
            lp = R.CompletionLogprobs(state.strings).build(entries[i]) if want else None
            choices.append({"index": i, "text": text, "logprobs": lp, "finish_reason": finish[i]})
        else:
            lp = R.chat_logprobs(entries[i], state.strings) if want else None
            message = outputs[i].message(text, finish[i] == "length")
            choices.append({"index": i, "message": message, "logprobs": lp,
                            "finish_reason": finish_reason(finish[i], "tool_calls" in message)})
    build = R.completion_response if gen.kind == "completion" else R.chat_response
    return JSONResponse(build(resp.id, resp.created, resp.model, choices, _usage(runs)))


async def unless_disconnected(work: Any, http: HTTPRequest) -> bool:
    """Awaits `work`; returns True (and cancels it) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(http))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            task.result()  # re-raises RequestTimeout and bugs
            return False
        return True
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()


async def _wait_disconnect(http: HTTPRequest) -> None:
    while True:  # the body is already read, so the next message is the disconnect
        message = await http.receive()
        if message["type"] == "http.disconnect":
            return
