"""A submitted /v1/responses request -> its SSE event stream or one JSON response object.

Both consume the engine's deltas through one `OutputBuilder` (responses_output.py); the stream
frames each event as `event: <type>` + `data: <json>` with a `sequence_number` counted from 0:

  response.created, response.in_progress,
  per item: response.output_item.added, [response.content_part.added],
            response.output_text.delta | response.reasoning_text.delta | response.function_call_arguments.delta ...,
            response.output_text.done | response.reasoning_text.done | response.function_call_arguments.done,
            [response.content_part.done], response.output_item.done,
  response.completed | response.incomplete (max_output_tokens) | response.failed (aborted)

A stored response (`store`, --enable-response-store) is kept once its last event is built, with
the conversation it answered, for GET /v1/responses/{id} and `previous_response_id`.
"""

from __future__ import annotations

import itertools
import json
import time
from typing import Any, AsyncIterator

from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response

from jaxserve.server.chat_output import ChoiceOutput
from jaxserve.server.errors import APIError, timed_out
from jaxserve.server.generation import SSEResponse, unless_disconnected
from jaxserve.server.responses_api import ResponsesRequest
from jaxserve.server.responses_output import OutputBuilder, as_messages, item_id, response_object, usage
from jaxserve.server.state import ServerState
from jaxserve.server.streaming import RequestRun, RequestTimeout, merged_deltas

_TERMINAL = {"completed": "response.completed", "incomplete": "response.incomplete", "failed": "response.failed"}


class _Run:
    """One response being generated: its identity, its builder, and how it ended."""

    def __init__(self, state: ServerState, rr: ResponsesRequest, runs: list[RequestRun]) -> None:
        gen, ctx = rr.gen, state.model
        self.state, self.rr, self.runs = state, rr, runs
        self.id = item_id("resp")
        self.created_at = int(time.time())
        tool_cls = ctx.tool_parser if gen.parses_tool_calls else None
        self.builder = OutputBuilder(ChoiceOutput(ctx.reasoning_parser, tool_cls, gen.tools, gen.prompt_text,
                                                  gen.forces_tool_calls))
        self.finish_reason: str | None = None

    def snapshot(self, status: str, output: list[dict], with_usage: bool) -> dict:
        u = None
        if with_usage:
            runs = self.runs
            out_tokens = sum(r.num_completion_tokens for r in runs)
            u = usage(sum(r.num_prompt_tokens for r in runs), out_tokens, sum(r.num_cached_tokens for r in runs),
                      min(self.builder.reasoning_tokens, out_tokens))
        response = response_object(self.id, self.created_at, self.rr.gen.model, self.rr.echo, status, output, u,
                                   self.rr.previous_response_id, self.rr.store)
        if status == "failed":
            response["error"] = {"code": "server_error", "message": "the request was aborted before it finished "
                                 "(the server is shutting down or the engine stopped)"}
        return response

    async def deltas(self) -> AsyncIterator[list[dict]]:
        """The events of each engine delta (often none: text held back by the parsers)."""
        async for d in merged_deltas(self.runs):
            events = self.builder.feed(d.text)
            if d.finish_reason is not None:
                self.finish_reason = d.finish_reason
                events += self.builder.finish(d.finish_reason == "length")
            yield events

    def final(self) -> dict:
        """The finished response object (kept in the store when it asked to be)."""
        status = {"length": "incomplete", "abort": "failed"}.get(self.finish_reason or "", "completed")
        response = self.snapshot(status, self.builder.items, True)
        store = self.state.responses
        if self.rr.store and store is not None:
            store.put(response, self.rr.history + as_messages(self.builder.items))
        return response


def respond(state: ServerState, rr: ResponsesRequest, runs: list[RequestRun], http: HTTPRequest) -> Any:
    """An awaitable JSONResponse, or the SSEResponse itself for `stream: true`."""
    run = _Run(state, rr, runs)
    if rr.gen.stream:
        return SSEResponse(_events(run), lambda: _close(runs))
    return _complete(run, http)


def _close(runs: list[RequestRun]) -> None:
    for run in runs:
        run.close()


async def _complete(run: _Run, http: HTTPRequest) -> Response:
    async def collect() -> None:
        async for _ in run.deltas():
            pass

    try:
        gone = await unless_disconnected(collect(), http)
    except RequestTimeout:
        raise timed_out(run.state.config.request_timeout or 0.0) from None
    finally:
        _close(run.runs)
    if gone:  # nobody to answer; the engine request is aborted
        return JSONResponse(APIError(499, "client disconnected").body(), status_code=499)
    return JSONResponse(run.final())


async def _events(run: _Run) -> AsyncIterator[str]:
    numbers = itertools.count()

    def frame(event: dict) -> str:
        event = {"type": event["type"], "sequence_number": next(numbers), **event}
        return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False, separators=(',', ':'))}\n\n"

    start = run.snapshot("in_progress", [], False)
    yield frame({"type": "response.created", "response": start})
    yield frame({"type": "response.in_progress", "response": start})
    try:
        async for events in run.deltas():
            for event in events:
                yield frame(event)
        response = run.final()
        yield frame({"type": _TERMINAL[response["status"]], "response": response})
    except RequestTimeout:
        error = timed_out(run.state.config.request_timeout or 0.0)
        yield frame({"type": "error", "code": error.code, "message": error.message, "param": None})
    finally:
        _close(run.runs)
