"""Host-path behaviours of issue 41 that are not timings: a request blocked at the head of the
line is hashed once, not at every step it waits; a step's events reach the event loop in one
hand-off; the scheduler's second pass looks only at what the first did not schedule. (The
persistent rows: test_batch_rows.py; the off-thread adapter read: lora/test_lora_engine.py; the
leader's single pickle: test_multihost.py; timings: scripts/bench_host.py.)"""

from __future__ import annotations

import asyncio

from jaxserve.core.request import FinishReason, Request, TokenEvent
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.engine import async_engine
from jaxserve.engine.page_allocator import PageAllocator
from test_scheduler import make, req, step


def test_a_blocked_head_of_line_request_is_hashed_once(monkeypatch):
    s = make(num_pages=8, page_size=4, max_num_batched_tokens=64, max_model_len=64)
    hashed = []
    real = PageAllocator.prefix_keys
    monkeypatch.setattr(PageAllocator, "prefix_keys",
                        lambda self, tokens, ns: hashed.append(len(tokens)) or real(self, tokens, ns))
    s.add(req("running", list(range(1, 25)), max_tokens=6))
    step(s)  # 24 tokens: 6 of the 8 pages
    s.add(req("blocked", list(range(30, 50)), max_tokens=4))  # needs 5 pages: waits
    for _ in range(4):
        plan, _ = step(s)
        assert [c.seq_id for c in plan.chunks] == ["running#0"]
    assert hashed.count(20) == 1  # the blocked prompt, once while it waited 4 steps
    while s.has_work():
        step(s)
    assert hashed.count(20) == 1 and s.stats().num_running == 0


class _Core:
    """Just enough of EngineCore for Engine: each step emits one token for every open request."""

    def __init__(self) -> None:
        self.requests: list[Request] = []
        self.left: dict[str, int] = {}
        self.stalled = False
        self.runner = type("R", (), {"background": None})()

    def add_request(self, request: Request) -> Request:
        self.requests.append(request)
        self.left[request.request_id] = 3
        return request

    def has_work(self) -> bool:
        return any(self.left.values())

    def step(self) -> list[TokenEvent]:
        events = []
        for rid, left in self.left.items():
            if left:
                self.left[rid] = left - 1
                events.append(TokenEvent(rid, 0, 7, None, None, FinishReason.LENGTH if left == 1 else None, 2, 0))
        return events


def test_a_steps_events_reach_the_event_loop_in_one_hand_off():
    async def main() -> tuple[int, dict[str, list[int]]]:
        loop = asyncio.get_running_loop()
        calls = []
        real = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *a: calls.append(a) or real(*a)
        engine = async_engine.Engine(_Core())
        streams = [engine.submit(Request(f"r{i}", [1, 2], SamplingParams(max_tokens=3))) for i in range(40)]
        engine.start()
        got = {}
        for stream in streams:
            got[stream.request.request_id] = [e.token_id async for e in stream]
        engine.shutdown()
        return len(calls), got

    calls, got = asyncio.run(main())
    assert got == {f"r{i}": [7, 7, 7] for i in range(40)}
    assert calls == 3  # three steps of 40 events each
