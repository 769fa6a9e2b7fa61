"""The async front: `Engine` runs an `EngineCore` on one background thread (its inbox is the
core's thread-safe add/abort/finish) and delivers each request's TokenEvents to an asyncio queue on
the caller's event loop: one `call_soon_threadsafe` per step and loop, carrying all of the step's
events. Nothing here decodes text: detokenization and
stop strings happen on the consumer's side, which calls `finish()` when a stop string ends a
sample."""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import AsyncIterator, Callable

from jaxserve.core.request import FinishReason, Request, TokenEvent
from jaxserve.engine.engine_core import EngineCore

logger = logging.getLogger("jaxserve.engine.async_engine")


class RequestStream:
    """The consumer's view of one request: TokenEvents as they are produced."""

    def __init__(self, request: Request, loop: asyncio.AbstractEventLoop) -> None:
        self.request = request
        self.queue: asyncio.Queue[TokenEvent] = asyncio.Queue()
        self.loop = loop
        self._open = request.params.n         # samples not yet finished, as the consumer sees them
        self.closed_samples: set[int] = set()  # finished samples, as the engine sees them (its lock)
        # Samples the consumer ended (Engine.finish): their tokens still queued are dropped here. Not
        # closed_samples, which also holds samples that finished on their own ahead of the queue.
        self.ended_by_consumer: set[int] = set()

    def deliver(self, event: TokenEvent) -> None:  # engine thread
        self.loop.call_soon_threadsafe(self.queue.put_nowait, event)

    async def __aiter__(self) -> AsyncIterator[TokenEvent]:
        while self._open:
            event = await self.queue.get()
            if event.finish_reason is None and event.sample_index in self.ended_by_consumer:
                continue  # queued before the consumer ended this sample (Engine.finish)
            if event.finish_reason is not None:
                self._open -= 1
            yield event


class Engine:
    """EngineCore on a background thread, with asyncio delivery of events."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self._streams: dict[str, RequestStream] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None
        self.on_step: Callable[[list[TokenEvent]], None] | None = None  # metrics hook
        self.error: BaseException | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="jaxserve-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop = True
        self._wake.set()
        if (background := self.core.runner.background) is not None:
            background.stop()  # no new background compile starts while the process winds down
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def num_waiting(self) -> int:
        return self.core.stats().num_waiting

    def submit(self, request: Request) -> RequestStream:
        """Queues the request (raises ValueError if it can never run) and returns its stream."""
        if self.error is not None:
            raise RuntimeError(f"engine stopped after an error: {self.error}")
        stream = RequestStream(request, asyncio.get_running_loop())
        with self._lock:
            if request.request_id in self._streams:
                raise ValueError(f"request_id {request.request_id!r} is already in flight")
            self._streams[request.request_id] = stream
        try:
            stream.request = self.core.add_request(request)
        except Exception:
            with self._lock:
                self._streams.pop(request.request_id, None)
            raise
        self._wake.set()
        return stream

    def abort(self, request_id: str) -> None:
        self.core.abort(request_id)
        self._wake.set()

    def abort_all(self) -> int:
        """Aborts every request with an open stream (each stream then ends with finish_reason
        "abort"); returns how many."""
        with self._lock:
            ids = list(self._streams)
        for request_id in ids:
            self.core.abort(request_id)
        self._wake.set()
        return len(ids)

    def finish(self, request_id: str, sample_index: int | None = None) -> None:
        """The consumer ended a sample (stop string): the stream gets a final STOP event for it (no
        token), later tokens of it are not delivered, and the stream is dropped once every sample
        has ended."""
        self.core.finish(request_id, sample_index)
        with self._lock:
            stream = self._streams.get(request_id)
            ended: list[int] = []
            if stream is not None:
                n = stream.request.params.n
                ended = [i for i in (range(n) if sample_index is None else [sample_index])
                         if i not in stream.closed_samples]
                stream.closed_samples.update(ended)
                stream.ended_by_consumer.update(ended)
                if len(stream.closed_samples) == n:
                    del self._streams[request_id]
        for i in ended:
            stream.deliver(TokenEvent(request_id, i, None, None, None, FinishReason.STOP,
                                      len(stream.request.prompt_token_ids), 0))
        self._wake.set()

    def release(self, request_id: str) -> None:
        """The consumer is gone (finished reading, or disconnected after an abort): drop the stream."""
        with self._lock:
            self._streams.pop(request_id, None)

    def _loop(self) -> None:
        try:
            while not self._stop:
                if not self.core.has_work():
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                events = self.core.step()
                self._deliver(events)
                if self.on_step is not None:
                    self.on_step(events)
                if self.core.stalled and not events:
                    self._wake.wait(0.002)
                    self._wake.clear()
        except BaseException as e:  # the loop must not die silently: fail every open stream
            logger.exception("engine loop failed")
            self.error = e
            with self._lock:
                streams = list(self._streams.values())
                self._streams.clear()
            for stream in streams:
                for i in range(stream.request.params.n):
                    stream.deliver(TokenEvent(stream.request.request_id, i, None, None, None,
                                              FinishReason.ABORT, len(stream.request.prompt_token_ids), 0))

    def _deliver(self, events: list[TokenEvent]) -> None:
        """A step's events, under one lock, handed to each event loop in one call (one wake-up of
        the loop per step, not per token)."""
        if not events:
            return
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, TokenEvent]]] = {}
        with self._lock:
            for event in events:
                stream = self._streams.get(event.request_id)
                if stream is None or event.sample_index in stream.closed_samples:
                    continue  # e.g. a token sampled after a stop string, in the step in flight
                if event.finish_reason is not None:
                    stream.closed_samples.add(event.sample_index)
                    if len(stream.closed_samples) == stream.request.params.n:
                        del self._streams[event.request_id]
                by_loop.setdefault(stream.loop, []).append((stream, event))
        for loop, batch in by_loop.items():
            loop.call_soon_threadsafe(_put_all, batch)


def _put_all(batch: list[tuple[RequestStream, TokenEvent]]) -> None:
    """On the event loop: a step's events into their streams' queues, in order."""
    for stream, event in batch:
        stream.queue.put_nowait(event)
