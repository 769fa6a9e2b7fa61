"""Engine events -> per-choice text deltas, and Server-Sent Events framing.

`RequestRun` owns one engine request (n samples): it submits it, consumes its TokenEvents as they
arrive, detokenizes each sample incrementally (stop strings included: on a match it calls
`engine.finish` and drops the sample's later tokens), and yields one `ChoiceDelta` per event, so
a streamed response sends each token's text as soon as the detokenizer releases it. Streaming and
non-streaming responses consume the same deltas, which is why their texts agree.

Whatever ends the consumption early (client disconnect, timeout, server shutdown) runs the
generator's `finally`, which aborts the engine request; the engine frees its pages at the next step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from typing import Any, AsyncIterator

from jaxserve.text.detokenizer import IncrementalDetokenizer
from jaxserve.core.request import Request, TokenEvent
from jaxserve.server.metrics import RequestMetrics, ServerMetrics
from jaxserve.server.responses import TokenLogprob

_TIMEOUT = object()   # put into a request's event queue when its deadline passes


class RequestTimeout(Exception):
    pass


@dataclasses.dataclass
class ChoiceDelta:
    index: int                      # the choice index in the response
    text: str                       # new text (may be empty: held back by the detokenizer)
    logprobs: list[TokenLogprob]    # this event's token, when logprobs were requested
    finish_reason: str | None       # set on the choice's last delta


@dataclasses.dataclass
class _Sample:
    detok: IncrementalDetokenizer
    num_tokens: int = 0
    finish_reason: str | None = None


class RequestRun:
    """One engine request: submit, then iterate `deltas()` exactly once."""

    def __init__(self, engine: Any, tokenizer: Any, request: Request, choice_offset: int,
                 include_stop_str_in_output: bool = False, metrics: ServerMetrics | None = None,
                 deadline: float | None = None) -> None:
        self.engine = engine
        self.request = request
        self.choice_offset = choice_offset
        self.deadline = deadline          # time.monotonic() value, or None
        p = request.params
        self._samples = [_Sample(IncrementalDetokenizer(tokenizer, request.prompt_token_ids,
                                                        p.skip_special_tokens, p.stop,
                                                        include_stop_str_in_output)) for _ in range(p.n)]
        self._metrics = metrics
        self._stream: Any = None
        self._timer: asyncio.TimerHandle | None = None
        self.num_cached_tokens = 0
        self.closed = False

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return sum(s.num_tokens for s in self._samples)

    def submit(self) -> None:
        """Queues the request in the engine; raises ValueError if it can never run."""
        self._stream = self.engine.submit(self.request)
        self._req_metrics = RequestMetrics(self._metrics, self.request.request_id, self.request.arrival_time,
                                           self.request.params.n)
        if self.deadline is not None:
            loop = asyncio.get_running_loop()
            delay = self.deadline - time.monotonic()
            self._timer = loop.call_later(max(0.0, delay), self._stream.queue.put_nowait, _TIMEOUT)

    async def deltas(self) -> AsyncIterator[ChoiceDelta]:
        queue = self._stream.queue
        open_samples = set(range(len(self._samples)))
        want_logprobs = self.request.params.logprobs is not None
        try:
            while open_samples:
                event = await queue.get()
                if event is _TIMEOUT:
                    raise RequestTimeout()
                if event.sample_index not in open_samples:
                    continue  # sampled after this sample's stop string, in the step that was in flight
                delta = self._apply(event, want_logprobs)
                if delta.finish_reason is not None:
                    open_samples.discard(event.sample_index)
                yield delta
        finally:
            self._close(open_samples)

    def _apply(self, event: TokenEvent, want_logprobs: bool) -> ChoiceDelta:
        i = event.sample_index
        sample = self._samples[i]
        text, finish, logprobs = "", None, []
        if event.token_id is not None:
            self.num_cached_tokens = event.num_cached_prompt_tokens
            sample.num_tokens += 1
            self._req_metrics.token(i, event.num_prompt_tokens)
            result = sample.detok.push([event.token_id])
            text = result.delta
            if result.stopped:
                finish = "stop"
                self.engine.finish(self.request.request_id, i)
            if want_logprobs:
                top = tuple((t, lp) for t, lp in event.top_logprobs or () if t >= 0)  # -1: no alternative
                logprobs = [TokenLogprob(event.token_id, event.logprob if event.logprob is not None else 0.0, top)]
        if finish is None and event.finish_reason is not None:
            finish = event.finish_reason.value
            text += sample.detok.flush()
        if finish is not None:
            sample.finish_reason = finish
            self._req_metrics.finished(i, finish)
        return ChoiceDelta(self.choice_offset + i, text, logprobs, finish)

    def _close(self, open_samples: set[int]) -> None:
        """Synchronous on purpose: it may run inside a cancelled task, where awaiting is not possible."""
        if self.closed:
            return
        self.closed = True
        if self._timer is not None:
            self._timer.cancel()
        if open_samples:
            self.engine.abort(self.request.request_id)
            for i in open_samples:
                self._req_metrics.finished(i, "abort")
        self._req_metrics.ended()
        self.engine.release(self.request.request_id)

    def close(self) -> None:
        """Aborts the request if it was submitted and never consumed to the end."""
        if self._stream is not None and not self.closed:
            self._close({i for i, s in enumerate(self._samples) if s.finish_reason is None})


async def merged_deltas(runs: list[RequestRun]) -> AsyncIterator[ChoiceDelta]:
    """Deltas of several runs in arrival order (one pump task per run when there are several)."""
    if len(runs) == 1:
        try:
            async for d in runs[0].deltas():
                yield d
        finally:
            runs[0].close()  # deterministic abort even if the inner generator is left to the GC
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(run: RequestRun) -> None:
        try:
            async for d in run.deltas():
                queue.put_nowait(d)
        except Exception as e:  # RequestTimeout or a bug: surface it to the consumer
            queue.put_nowait(e)
        queue.put_nowait(done)

    tasks = [asyncio.create_task(pump(r)) for r in runs]
    try:
        remaining = len(runs)
        while remaining:
            item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        for r in runs:
            r.close()


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"
