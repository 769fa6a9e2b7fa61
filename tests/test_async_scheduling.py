"""Async scheduling: step n+1 is planned and dispatched before step n's ids reach the host, decodes
read their in-flight token on the device, and the outputs equal the synchronous engine's."""

from __future__ import annotations

import numpy as np
import pytest

from engine_utils import greedy, make_core, run_all, tiny_model
from jaxserve.core.config import EngineConfig
from jaxserve.engine.page_allocator import PageAllocator
from jaxserve.core.request import FinishReason, Request
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.core.step_plan import PENDING_TOKEN
from jaxserve.engine.scheduler import Scheduler
from jaxserve.runner.step_inputs import StepInputBuilder


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    cfg, weights, _ = tiny_model(tmp_path_factory.mktemp("a"), "qwen3-qknorm", seed=11)
    return cfg, weights


@pytest.fixture(scope="module")
def cores(model):
    """{async_scheduling: a warmed-up EngineCore}; tests leave them idle."""
    return {flag: make_core(*model, async_scheduling=flag) for flag in (True, False)}


def _assert_idle(core):
    alloc = core.allocator
    alloc.check_invariants()
    assert not core.has_work()
    assert alloc.num_free_pages == alloc.num_pages
    assert all(alloc.ref_count(p) == 0 for p in range(alloc.num_pages))


def _decode_batch(tag: str) -> list[Request]:
    return [Request(f"{tag}{i}", [i + 1, 7, 19, 3 * i + 2], greedy(8)) for i in range(4)]


def _trace(core) -> list[tuple[str, object]]:
    """Records the order of the runner's dispatches and fetches (the real calls, passed through)."""
    log: list[tuple[str, object]] = []
    sample, fetch = core.runner.sample, core.runner.fetch

    def traced_sample(*args):  # a step is dispatched once its sampler is (the forward goes first)
        out = sample(*args)
        log.append(("dispatch", out))
        return out

    def traced_fetch(out):
        log.append(("fetch", out))
        return fetch(out)

    core.runner.sample, core.runner.fetch = traced_sample, traced_fetch
    return log


def _overlapped_fetches(log) -> tuple[int, int]:
    """(fetches made after the next step was already dispatched, all fetches)."""
    dispatched = [out for kind, out in log if kind == "dispatch"]
    overlapped = total = 0
    for i, (kind, out) in enumerate(log):
        if kind != "fetch":
            continue
        total += 1
        k = next(j for j, d in enumerate(dispatched) if d is out)
        later = [d for what, d in log[:i] if what == "dispatch"]
        overlapped += len(later) > k + 1
    return overlapped, total


def test_step_n_plus_1_is_dispatched_before_step_n_is_fetched(model):
    outputs, overlap = {}, {}
    for flag in (True, False):
        core = make_core(*model, async_scheduling=flag)
        log = _trace(core)
        outputs[flag] = run_all(core, _decode_batch("d"))
        overlap[flag] = _overlapped_fetches(log)
        _assert_idle(core)
    done, total = overlap[True]
    assert total >= 8 and done == total - 1  # every step but the last overlaps the next one's dispatch
    assert overlap[False] == (0, overlap[False][1])
    assert outputs[True] == outputs[False]


def test_a_sequence_stopping_on_eos_emits_nothing_from_the_step_in_flight(cores):
    core = cores[True]
    prompt = [5, 17, 33, 2, 9]
    tokens = run_all(core, [Request("probe", prompt, greedy(10))])["probe"][0]
    stop_at = next(i for i in range(2, len(tokens)) if tokens[i] not in tokens[:i])
    eos = tokens[stop_at]
    discarded = core.scheduler.num_discarded_tokens
    core.add_request(Request("e", prompt, SamplingParams(temperature=0.0, max_tokens=10),
                             eos_token_ids=frozenset({eos})))
    core.add_request(Request("other", [1, 2, 3], greedy(16)))  # keeps the engine stepping
    got, reasons = [], []
    while core.has_work():
        for e in core.step():
            if e.request_id == "e":
                assert not reasons or reasons[-1] is None, "event after the sample finished"
                got.append(e.token_id)
                reasons.append(e.finish_reason)
                if e.finish_reason is not None:  # its pages go back at once
                    assert not core.allocator.has_sequence("e#0")
    assert got == tokens[:stop_at + 1] and reasons[-1] is FinishReason.STOP
    assert core.scheduler.num_discarded_tokens == discarded + 1  # the step-n+1 decode ran and was dropped
    _assert_idle(core)


def test_penalty_rows_stay_async_and_match_the_sync_engine(cores):
    """Penalties need the output ids; the one still in flight is counted on the device
    (sampler.count_in_flight), so the steps stay asynchronous and the tokens are the sync engine's."""
    def batch():
        return [Request("pen", [4, 4, 9, 4], SamplingParams(temperature=0.0, presence_penalty=1.5,
                                                             frequency_penalty=0.5, max_tokens=10, ignore_eos=True)),
                Request("rep", [5, 6, 5, 6], SamplingParams(temperature=0.8, seed=3, repetition_penalty=1.8,
                                                             max_tokens=10, ignore_eos=True)),
                *_decode_batch("p")]

    before = cores[True].num_sync_steps
    got = run_all(cores[True], batch())
    assert cores[True].num_sync_steps == before
    assert got == run_all(cores[False], batch())
    assert len(set(got["pen"][0])) > 3  # the penalties change the greedy choice: not one token repeated
    for core in cores.values():
        _assert_idle(core)


def test_seeds_logprobs_and_min_tokens_stay_async_and_match_the_sync_engine(cores):
    def batch():
        return [Request("s", [3, 14, 15, 92], SamplingParams(temperature=1.0, top_k=20, seed=99, max_tokens=10,
                                                              logprobs=2, ignore_eos=True)),
                Request("m", [8, 8, 1], SamplingParams(temperature=0.9, seed=5, min_tokens=6, max_tokens=9,
                                                        logit_bias={3: 2.0}),
                        eos_token_ids=frozenset(range(0, 96, 2))),  # EOS banned until 6 tokens
                *_decode_batch("k")]

    def events(core):
        out = {}
        for r in batch():
            core.add_request(r)
        while core.has_work():
            for e in core.step():
                out.setdefault(e.request_id, []).append((e.token_id, e.logprob, e.top_logprobs, e.finish_reason))
        return out

    before = cores[True].num_sync_steps
    got = events(cores[True])
    assert cores[True].num_sync_steps == before
    assert len(got["m"]) >= 6
    want = events(cores[False])
    assert got.keys() == want.keys()
    for rid in got:  # same tokens and reasons; logprobs equal up to float noise of different batches
        assert [(t, r) for t, _, _, r in got[rid]] == [(t, r) for t, _, _, r in want[rid]]
        np.testing.assert_allclose([lp for _, lp, _, _ in got[rid] if lp is not None],
                                   [lp for _, lp, _, _ in want[rid] if lp is not None], rtol=1e-4, atol=1e-5)


# ---- step inputs of in-flight decodes (host only) ---------------------------------------------------

def _builder_and_scheduler():
    cfg = EngineConfig(page_size=4, num_kv_pages=16, max_num_seqs=4, max_num_batched_tokens=16,
                       max_model_len=32, token_buckets=(16,), seq_buckets=(4,))
    return StepInputBuilder(cfg, 16, 100), Scheduler(cfg, PageAllocator(16, 4))


def test_in_flight_decodes_point_at_their_row_of_the_previous_step():
    builder, s = _builder_and_scheduler()
    for rid, prompt in (("a", [1, 2, 3]), ("b", [4, 5])):
        s.add(Request(rid, prompt, SamplingParams(max_tokens=5, seed=1, min_tokens=3), eos_token_ids=frozenset({0})))
    p0 = s.schedule()
    p1 = s.schedule()
    assert [c.token_ids for c in p1.chunks] == [[PENDING_TOKEN], [PENDING_TOKEN]]
    arrays = builder.build(p1, p0).arrays
    assert arrays.prev_sample_row[:2].tolist() == [0, 1] and (arrays.prev_sample_row[2:] == -1).all()
    assert arrays.token_ids[:2].tolist() == [0, 0]
    sampling = builder.build(p1, p0).sampling
    assert sampling.num_output_tokens[:2].tolist() == [1, 1]  # the in-flight token counts for the seed
    assert (sampling.table_bias[:2] == -np.inf).any(axis=1).all()  # min_tokens still bans EOS
    assert (builder.build(p0).arrays.prev_sample_row == -1).all()
    with pytest.raises(ValueError, match="did not sample"):
        builder.build(p1, None)


def test_an_in_flight_decode_with_penalties_points_the_sampler_at_its_token():
    builder, s = _builder_and_scheduler()
    s.add(Request("a", [1, 2, 3], SamplingParams(max_tokens=5, seed=1, repetition_penalty=1.2)))
    p0 = s.schedule()
    p1 = s.schedule()
    sampling = builder.build(p1, p0).sampling
    assert sampling.pending_row[0] == 0 and (sampling.pending_row[1:] == -1).all()  # row 0 of p0 sampled it
    assert (sampling.table_ids[0] >= 0).sum() == 3 and sampling.table_ids.shape[1] > 3  # the prompt's ids, then room
    with pytest.raises(ValueError, match="did not sample"):
        builder.build(p1, None)


def test_threaded_engine_stream_ends_after_finish_and_is_dropped(tmp_path):
    """Engine.finish (a stop string downstream) closes that sample's stream with a STOP event; later
    tokens of it are never delivered and the engine forgets the stream."""
    import asyncio

    from engine_utils import make_core, tiny_model
    from jaxserve.engine.async_engine import Engine
    from jaxserve.core.request import FinishReason, Request
    from jaxserve.core.sampling_params import SamplingParams

    cfg, weights, _ = tiny_model(tmp_path, "qwen3-qknorm", seed=3)
    engine = Engine(make_core(cfg, weights))
    engine.start()

    async def consume():
        stream = engine.submit(Request("f", [1, 2, 3], SamplingParams(n=2, temperature=0, max_tokens=40,
                                                                       ignore_eos=True)))
        events = []
        async for event in stream:
            events.append(event)
            if event.sample_index == 0 and event.token_id is not None and len([e for e in events if e.sample_index == 0]) == 3:
                engine.finish("f", 0)
        return events

    try:
        events = asyncio.run(asyncio.wait_for(consume(), 60))
    finally:
        engine.shutdown()
    sample0 = [e for e in events if e.sample_index == 0]
    assert [e.token_id is not None for e in sample0] == [True, True, True, False]
    assert sample0[-1].finish_reason is FinishReason.STOP
    sample1 = [e for e in events if e.sample_index == 1]
    assert len(sample1) == 40 and sample1[-1].finish_reason is FinishReason.LENGTH
    assert "f" not in engine._streams


def test_tokens_already_queued_when_the_consumer_finishes_a_sample_are_dropped():
    """The engine thread may queue a sample's next token before the consumer's Engine.finish takes
    effect; the stream drops it, so the consumer sees STOP right after the last token it read."""
    import asyncio

    from jaxserve.engine.async_engine import RequestStream
    from jaxserve.core.request import FinishReason, Request, TokenEvent
    from jaxserve.core.sampling_params import SamplingParams

    async def run():
        stream = RequestStream(Request("r", [1, 2], SamplingParams(n=2, max_tokens=8)), asyncio.get_running_loop())
        for tok in (5, 6, 7):
            stream.queue.put_nowait(TokenEvent("r", 0, tok, None, None, None, 2, 0))
        # sample 1 finished on its own: the engine closed it before its queued token was read
        stream.closed_samples.add(1)
        stream.queue.put_nowait(TokenEvent("r", 1, 9, None, None, None, 2, 0))
        stream.queue.put_nowait(TokenEvent("r", 1, None, None, None, FinishReason.LENGTH, 2, 0))
        seen = []
        async for event in stream:
            seen.append(event.token_id)
            if event.token_id == 5:                       # the consumer ends the sample here...
                stream.ended_by_consumer.add(0)           # (what Engine.finish does under its lock)
                stream.queue.put_nowait(TokenEvent("r", 0, None, None, None, FinishReason.STOP, 2, 0))
        return seen

    # sample 0: 6 and 7, queued before the consumer ended it, never arrive; sample 1 loses nothing
    assert asyncio.run(run()) == [5, 9, None, None]
