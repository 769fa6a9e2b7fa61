"""Scheduler: budgets, chunked prefill, prefix hits, preemption, abort/finish, rejection, n > 1,
priorities and stop conditions. The "model" is a deterministic function of (seq_id, position)."""

import dataclasses
import logging
import zlib

import pytest

from jaxserve.core.config import EngineConfig
from jaxserve.engine.page_allocator import PageAllocator
from jaxserve.core.request import FinishReason, Request
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.core.step_plan import PENDING_TOKEN, SampledRows, StepPlan
from jaxserve.engine.scheduler import Scheduler

EOS = 0


def fake_token(seq_id: str, position: int) -> int:
    """The token a sequence samples at `position`: never EOS (tests that want EOS say so)."""
    return 1 + zlib.crc32(f"{seq_id}:{position}".encode()) % 997


LIMITS = dict(max_num_seqs=64, max_num_batched_tokens=512, max_model_len=2048)


def make(num_pages: int = 64, page_size: int = 16, **kw) -> Scheduler:
    cfg = EngineConfig(num_kv_pages=num_pages, page_size=page_size, **{**LIMITS, **kw})
    return Scheduler(cfg, PageAllocator(num_pages, page_size, cfg.enable_prefix_caching))


def req(rid: str, prompt: list[int], max_tokens: int | None = 4, **kw) -> Request:
    fields = {f.name for f in dataclasses.fields(Request)}
    rkw = {k: v for k, v in kw.items() if k in fields}
    params = SamplingParams(max_tokens=max_tokens, **{k: v for k, v in kw.items() if k not in fields})
    return Request(rid, prompt, params, eos_token_ids=frozenset({EOS}), **rkw)


def step(s: Scheduler, model=fake_token) -> tuple[StepPlan, list]:
    plan = s.schedule()
    s.allocator.check_invariants()
    assert plan.num_tokens <= s.config.max_num_batched_tokens
    ids = [model(c.seq_id, c.start_pos + len(c.token_ids)) for c in plan.chunks if c.sample]
    sampled = SampledRows(ids, [-0.5] * len(ids), [[]] * len(ids), [[]] * len(ids))
    events = s.update(plan, sampled)
    s.allocator.check_invariants()
    return plan, events


def run_all(s: Scheduler, max_steps: int = 500, model=fake_token) -> dict:
    """Steps until idle; returns {(request_id, sample_index): [token events]}."""
    out: dict = {}
    for _ in range(max_steps):
        if not s.has_work():
            return out
        plan, events = step(s, model)
        for e in plan.finished + events:
            out.setdefault((e.request_id, e.sample_index), []).append(e)
    raise AssertionError("scheduler did not drain")


def tokens_of(events) -> list[int]:
    return [e.token_id for e in events if e.token_id is not None]


# ---- prefix caching -------------------------------------------------------------------------------

def test_second_request_with_shared_512_token_prefix_prefills_only_its_suffix():
    s = make(num_pages=128, max_num_batched_tokens=256, max_model_len=1024)
    prefix = [(7 * i) % 1000 + 1 for i in range(512)]
    s.add(req("a", prefix + [5, 6, 7]))
    first = run_all(s)
    assert first[("a", 0)][-1].finish_reason is FinishReason.LENGTH

    s.add(req("b", prefix + [8, 9, 10, 11]))
    plan, events = step(s)
    (chunk,) = plan.chunks
    assert chunk.start_pos == 512 and chunk.token_ids == [8, 9, 10, 11] and plan.num_tokens == 4
    assert len(chunk.page_table) == 33 and chunk.sample
    events += run_all(s)[("b", 0)]
    assert all(e.num_cached_prompt_tokens == 512 for e in events)
    assert len(tokens_of(events)) == 4
    st = s.stats()
    assert st.prefix_cache_queries == 515 + 516 and st.prefix_cache_hits == 512


def test_different_cache_salts_never_share_pages():
    s = make(num_pages=64, max_num_batched_tokens=128)
    prompt = list(range(1, 70))
    s.add(req("a", prompt, cache_salt="tenant-a"))
    run_all(s)
    s.add(req("b", prompt, cache_salt="tenant-b"))
    plan, _ = step(s)
    assert plan.chunks[0].start_pos == 0 and plan.num_tokens == 69
    run_all(s)
    s.add(req("c", prompt, cache_salt="tenant-a"))
    plan, _ = step(s)
    assert plan.chunks[0].start_pos == 64  # same tenant: hit


# ---- budget and chunked prefill -------------------------------------------------------------------

def test_long_prompt_is_chunked_after_the_decodes_and_never_stalls_them():
    s = make(num_pages=64, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=256)
    for i in range(3):
        s.add(req(f"d{i}", [i + 1, 2, 3], max_tokens=20))
    step(s)  # the three short prompts prefill together (9 tokens)
    s.add(req("long", list(range(1, 101)), max_tokens=2))
    prefill_steps = 0
    while True:
        plan, _ = step(s)
        decodes = [c for c in plan.chunks if len(c.token_ids) == 1]
        assert sorted(c.seq_id for c in decodes) == ["d0#0", "d1#0", "d2#0"]  # every step, all of them
        assert plan.chunks[:3] == decodes  # decodes come first
        long_chunks = [c for c in plan.chunks if c.seq_id == "long#0"]
        assert plan.num_tokens <= 16
        if not long_chunks:
            break
        assert len(long_chunks[0].token_ids) == min(13, 100 - 13 * prefill_steps)  # the leftover budget
        prefill_steps += 1
        if long_chunks[0].sample:
            break
    assert prefill_steps == 8  # 100 tokens in chunks of 13


def test_partially_prefilled_sequence_continues_before_new_admissions():
    s = make(num_pages=64, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=256)
    s.add(req("a", list(range(1, 41))))
    plan, _ = step(s)
    assert [(c.seq_id, c.start_pos, len(c.token_ids)) for c in plan.chunks] == [("a#0", 0, 16)]
    s.add(req("b", list(range(101, 141))))
    plan, _ = step(s)
    assert [(c.seq_id, c.start_pos, len(c.token_ids)) for c in plan.chunks] == [("a#0", 16, 16)]
    plan, _ = step(s)
    assert [(c.seq_id, c.start_pos, len(c.token_ids)) for c in plan.chunks] == [("a#0", 32, 8), ("b#0", 0, 8)]


def test_max_num_seqs_caps_the_running_set():
    s = make(max_num_seqs=2, max_num_batched_tokens=64)
    for i in range(4):
        s.add(req(f"r{i}", [1, 2, 3], max_tokens=3))
    plan, _ = step(s)
    assert [c.seq_id for c in plan.chunks] == ["r0#0", "r1#0"]
    assert s.stats().num_running == 2 and s.stats().num_waiting == 2
    run_all(s)


# ---- preemption -----------------------------------------------------------------------------------

def run_alone(request: Request) -> list[int]:
    s = make(num_pages=64, page_size=4, max_num_batched_tokens=64, max_model_len=256)
    s.add(dataclasses.replace(request))
    return tokens_of(run_all(s)[(request.request_id, 0)])


def test_preemption_recomputes_the_newest_and_its_output_continues_unchanged():
    # 6 pages of 4 tokens; two requests each growing to 12 tokens (3 pages) + a third one.
    s = make(num_pages=6, page_size=4, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64)
    reqs = [req(f"r{i}", [10 * i + 1, 10 * i + 2, 10 * i + 3, 10 * i + 4], max_tokens=8) for i in range(3)]
    for r in reqs:
        s.add(r)
    out: dict = {}
    preempted: list[str] = []
    recompute_chunks = []  # (chunk tokens, prompt + output at schedule time) of recomputed sequences
    for _ in range(200):
        if not s.has_work():
            break
        plan = s.schedule()
        recompute_chunks += [(c.token_ids, c.request.prompt_token_ids + c.output_token_ids)
                             for c in plan.chunks if c.start_pos == 0 and c.output_token_ids and c.sample]
        events = s.update(plan, SampledRows([fake_token(c.seq_id, c.start_pos + len(c.token_ids))
                                             for c in plan.chunks if c.sample]))
        s.allocator.check_invariants()
        preempted += plan.preempted
        for e in events:
            out.setdefault(e.request_id, []).append(e)
    assert preempted and preempted[0] == "r2#0"  # the newest goes first
    assert s.stats().num_preemptions >= 1
    # a recomputed sequence prefills its prompt + what it already generated, and samples a new token
    assert recompute_chunks and all(chunk == full for chunk, full in recompute_chunks)
    for r in reqs:
        events = out[r.request_id]
        assert len(events) == 8 and [e.finish_reason for e in events].count(FinishReason.LENGTH) == 1
        assert tokens_of(events) == run_alone(r)  # no token lost, repeated or changed
    assert s.allocator.num_free_pages == 6


def test_priority_policy_preempts_the_lowest_priority():
    s = make(num_pages=4, page_size=4, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64,
             scheduling_policy="priority")
    s.add(req("low", [1, 2, 3, 4], max_tokens=8, priority=5))
    s.add(req("high", [5, 6, 7, 8], max_tokens=8, priority=0))
    preempted = []
    for _ in range(100):
        if not s.has_work():
            break
        plan, _ = step(s)
        preempted += plan.preempted
    assert preempted and set(preempted) == {"low#0"}


def test_a_step_that_preempts_admits_nobody():
    s = make(num_pages=5, page_size=4, max_num_seqs=2, max_num_batched_tokens=16, max_model_len=64,
             scheduling_policy="priority")
    s.add(req("a", [1, 2, 3, 4], max_tokens=12, priority=0))
    s.add(req("b", [5, 6, 7, 8], max_tokens=8, priority=5))
    step(s)
    s.add(req("c", [9, 10], max_tokens=2, priority=0))  # waits: max_num_seqs is 2
    for _ in range(20):
        plan, _ = step(s)
        if plan.preempted:
            break
    assert plan.preempted == ["b#0"]
    assert sorted(c.seq_id for c in plan.chunks) == ["a#0"]  # c (which would fit) waits a step
    plan, _ = step(s)
    assert "c#0" in [c.seq_id for c in plan.chunks]


# ---- abort / finish -------------------------------------------------------------------------------

def test_abort_frees_pages_but_shared_prefix_pages_stay_for_the_other_request():
    s = make(num_pages=32, page_size=4, max_num_batched_tokens=64)
    prefix = list(range(1, 17))  # 4 full pages
    s.add(req("a", prefix + [50], max_tokens=20))
    step(s)  # a's prefix is computed and cached
    s.add(req("b", prefix + [60, 61], max_tokens=20))
    plan, _ = step(s)
    assert [c.start_pos for c in plan.chunks if c.seq_id == "b#0"] == [16]
    alloc = s.allocator
    shared = alloc.page_table("a#0")[:4]
    assert alloc.page_table("b#0")[:4] == shared and all(alloc.ref_count(p) == 2 for p in shared)
    free_before = alloc.num_free_pages
    s.abort("b")
    plan, events = step(s)
    assert [(e.request_id, e.finish_reason, e.token_id) for e in plan.finished] == [("b", FinishReason.ABORT, None)]
    assert all(e.request_id == "a" for e in events) and "b#0" not in [c.seq_id for c in plan.chunks]
    assert not alloc.has_sequence("b#0") and all(alloc.ref_count(p) == 1 for p in shared)
    assert alloc.page_table("a#0")[:4] == shared
    assert alloc.num_free_pages == free_before + 1  # b's one private page
    s.abort("b")  # twice, or after the end: ignored
    s.abort("never-seen")
    plan, _ = step(s)
    assert plan.finished == []


def test_abort_of_a_waiting_request_emits_one_abort_per_sample():
    s = make(max_num_seqs=2, max_num_batched_tokens=64)
    s.add(req("a", [1, 2, 3], max_tokens=50, n=2))
    s.add(req("w", [1, 2, 3], n=2))
    s.abort("w")
    plan, _ = step(s)
    assert sorted((e.request_id, e.sample_index, e.finish_reason) for e in plan.finished) == [
        ("w", 0, FinishReason.ABORT), ("w", 1, FinishReason.ABORT)]
    assert s.stats().num_waiting == 0


def test_finish_stops_a_request_without_an_event():
    s = make()
    s.add(req("a", [1, 2, 3], max_tokens=50, n=2))
    for _ in range(4):
        step(s)
    s.finish("a", sample_index=1)
    plan, events = step(s)
    assert plan.finished == [] and [e.sample_index for e in events] == [0]
    s.finish("a")
    plan, events = step(s)
    assert plan.chunks == [] and events == [] and not s.has_work()
    assert s.allocator.num_free_pages == 64


# ---- rejection ------------------------------------------------------------------------------------

def test_requests_that_can_never_fit_are_rejected_up_front():
    s = make(num_pages=4, page_size=16, max_num_seqs=4, max_model_len=100)
    with pytest.raises(ValueError, match="max_model_len"):
        s.add(req("a", list(range(1, 91)), max_tokens=11))
    with pytest.raises(ValueError, match="KV pages"):
        s.add(req("b", list(range(1, 60)), max_tokens=10))  # 69 tokens > 4 pages of 16
    with pytest.raises(ValueError, match="no room"):
        s.add(req("c", list(range(1, 65)), max_tokens=None))  # the pool caps the context at 64
    with pytest.raises(ValueError, match="non-empty"):
        s.add(req("d", [], max_tokens=1))
    with pytest.raises(ValueError, match="max_num_seqs"):
        s.add(req("e", [1], max_tokens=1, n=5))
    s.add(req("ok", list(range(1, 60)), max_tokens=5))
    with pytest.raises(ValueError, match="already in flight"):
        s.add(req("ok", [1], max_tokens=1))
    assert s.stats().num_waiting == 1


# ---- n > 1 ----------------------------------------------------------------------------------------

def test_n_samples_prefill_the_prompt_once_and_share_its_pages():
    s = make(num_pages=16, page_size=16, max_num_batched_tokens=64)
    prompt = list(range(1, 21))  # 1 full page + 4 tokens
    s.add(req("a", prompt, max_tokens=3, n=3, seed=0))
    plan, events = step(s)
    assert [(c.seq_id, c.start_pos, len(c.token_ids), c.sample) for c in plan.chunks] == [("a#0", 0, 19, False)]
    assert events == []
    plan, events = step(s)
    assert sorted(c.seq_id for c in plan.chunks) == ["a#0", "a#1", "a#2"]
    assert all(c.start_pos == 19 and c.token_ids == [20] and c.sample for c in plan.chunks)
    alloc = s.allocator
    tables = [alloc.page_table(f"a#{i}") for i in range(3)]
    assert tables[0][0] == tables[1][0] == tables[2][0] and alloc.ref_count(tables[0][0]) == 3
    assert len({t[1] for t in tables}) == 3  # the partial page: one private copy each
    assert len(plan.copies) == 2 and all(src == tables[2][1] for src, _ in plan.copies)
    assert alloc.num_pages - alloc.num_free_pages == 4  # 1 shared + 3 private (6 without sharing)
    assert sorted(e.sample_index for e in events) == [0, 1, 2]
    out = run_all(s)
    for i in range(3):
        assert len(tokens_of(out[("a", i)])) == 2  # + the first one above = max_tokens
    assert alloc.num_free_pages == 16


def test_removing_sample_0_before_the_fork_hands_the_prefill_to_a_sibling():
    s = make(num_pages=16, page_size=4, max_num_seqs=4, max_num_batched_tokens=8)
    prompt = list(range(1, 22))
    s.add(req("a", prompt, max_tokens=3, n=3))
    plan, _ = step(s)
    assert [(c.seq_id, c.start_pos, len(c.token_ids)) for c in plan.chunks] == [("a#0", 0, 8)]
    s.finish("a", sample_index=0)
    plan, _ = step(s)
    # sample 1 takes over sample 0's pages and continues where it stopped
    assert [(c.seq_id, c.start_pos, len(c.token_ids)) for c in plan.chunks] == [("a#1", 8, 8)]
    out = run_all(s)
    assert sorted(out) == [("a", 1), ("a", 2)]
    assert all(len(tokens_of(out[k])) == 3 and out[k][-1].finish_reason is FinishReason.LENGTH for k in out)
    assert s.allocator.num_free_pages == 16


def test_n_samples_with_prompt_ending_on_a_page_boundary_need_no_copy():
    s = make(num_pages=16, page_size=4, max_num_batched_tokens=64)
    s.add(req("a", [1, 2, 3, 4, 5], max_tokens=2, n=2))
    step(s)
    plan, _ = step(s)
    assert plan.copies == [] and len(plan.chunks) == 2
    tables = [s.allocator.page_table(f"a#{i}") for i in range(2)]
    assert tables[0][0] == tables[1][0] and tables[0][1] != tables[1][1]


# ---- ordering -------------------------------------------------------------------------------------

def test_priority_policy_admits_lower_values_first_ties_by_arrival():
    s = make(max_num_seqs=1, max_num_batched_tokens=16, scheduling_policy="priority")
    for rid, prio, t in [("p3", 3, 0.0), ("p1", 1, 1.0), ("p2b", 2, 3.0), ("p2a", 2, 2.0)]:
        s.add(req(rid, [1, 2], max_tokens=1, priority=prio, arrival_time=t))
    order = []
    while s.has_work():
        plan, _ = step(s)
        order += [c.request.request_id for c in plan.chunks]
    assert order == ["p1", "p2a", "p2b", "p3"]


def test_fcfs_ignores_priority():
    s = make(max_num_seqs=1, max_num_batched_tokens=16)
    for rid, prio in [("a", 3), ("b", 1), ("c", 2)]:
        s.add(req(rid, [1, 2], max_tokens=1, priority=prio))
    order = []
    while s.has_work():
        plan, _ = step(s)
        order += [c.request.request_id for c in plan.chunks]
    assert order == ["a", "b", "c"]


# ---- stop conditions ------------------------------------------------------------------------------

def scripted(tokens: list[int]):
    """A model that samples tokens[k] as the k-th output of every sequence."""
    def model(seq_id: str, position: int) -> int:
        return tokens[position - 3]  # prompts below have 3 tokens
    return model


@pytest.mark.parametrize("kw, expected, reason", [
    ({}, [5, 6, EOS], FinishReason.STOP),
    ({"ignore_eos": True}, [5, 6, EOS, 7, 8, 9], FinishReason.LENGTH),
    ({"min_tokens": 3}, [5, 6, EOS, 7, 8, 9], FinishReason.LENGTH),   # EOS at output 3 is inside min_tokens
    ({"min_tokens": 2}, [5, 6, EOS], FinishReason.STOP),
    ({"stop_token_ids": [6]}, [5, 6], FinishReason.STOP),
    ({"stop_token_ids": [6], "min_tokens": 2}, [5, 6, EOS], FinishReason.STOP),
    ({"max_tokens": 2}, [5, 6], FinishReason.LENGTH),
])
def test_stop_conditions(kw, expected, reason):
    s = make()
    kw = {"max_tokens": 6, **kw}
    s.add(req("a", [1, 2, 3], logprobs=0, **kw))
    events = run_all(s, model=scripted([5, 6, EOS, 7, 8, 9, 10]))[("a", 0)]
    assert tokens_of(events) == expected
    assert [e.finish_reason for e in events] == [None] * (len(expected) - 1) + [reason]
    assert all(e.num_prompt_tokens == 3 and e.logprob == -0.5 for e in events)


def test_unbounded_max_tokens_stops_at_the_context_limit():
    s = make(num_pages=64, page_size=4, max_model_len=10)
    s.add(req("a", [1, 2, 3], max_tokens=None))
    events = run_all(s)[("a", 0)]
    assert len(events) == 7 and events[-1].finish_reason is FinishReason.LENGTH


# ---- plumbing -------------------------------------------------------------------------------------

def test_update_checks_the_sampled_tokens_against_the_plan():
    s = make()
    s.add(req("a", [1, 2, 3], logprobs=1))
    plan = s.schedule()
    with pytest.raises(ValueError, match="expected 1 sampled"):
        s.update(plan, SampledRows([]))
    with pytest.raises(ValueError, match="asked for logprobs"):
        s.update(plan, SampledRows([5]))
    (e,) = s.update(plan, SampledRows([5], [-0.25], [[5, 9]], [[-0.25, -3.0]]))
    assert (e.token_id, e.logprob, e.top_logprobs) == (5, -0.25, [(5, -0.25)])  # the request's 1, of the 2 sampled


def test_config_must_match_the_allocator():
    cfg = EngineConfig(num_kv_pages=8, page_size=16, **LIMITS)
    with pytest.raises(ValueError, match="page_size"):
        Scheduler(cfg, PageAllocator(8, 8))
    with pytest.raises(ValueError, match="num_kv_pages"):
        Scheduler(cfg, PageAllocator(9, 16))


def test_one_debug_line_per_step(caplog):
    s = make()
    s.add(req("a", [1, 2, 3], max_tokens=2))
    with caplog.at_level(logging.DEBUG, logger="jaxserve.engine.scheduler"):
        step(s)
        step(s)
    lines = [r.getMessage() for r in caplog.records if r.name == "jaxserve.engine.scheduler"]
    assert len(lines) == 2
    assert "running=1" in lines[0] and "tokens=3" in lines[0] and "preempted=0" in lines[0]
    assert "cache_hit_tokens=0" in lines[0]


# ---- async scheduling (schedule n+1 before update n) --------------------------------------------

def sampled_for(plan: StepPlan, model=fake_token) -> SampledRows:
    return SampledRows([model(c.seq_id, c.start_pos + len(c.token_ids)) for c in plan.chunks if c.sample])


def run_async(s: Scheduler, max_steps: int = 500, model=fake_token) -> list[tuple[StepPlan, list]]:
    """Steps as the async engine does: plan step n+1, then update step n. Returns (plan n+1,
    events of update n) per step."""
    history, inflight = [], None
    for _ in range(max_steps):
        if not (s.has_work() or inflight):
            return history
        plan = s.schedule()
        events = list(plan.finished)
        if inflight is not None:
            events += s.update(inflight, sampled_for(inflight, model))
        s.allocator.check_invariants()
        history.append((plan, events))
        inflight = plan if plan.chunks else None
    raise AssertionError("scheduler did not drain")


def test_async_plans_the_next_decode_on_the_in_flight_token_and_not_past_the_length():
    s = make(num_pages=16, page_size=4)
    s.add(req("a", [1, 2, 3], max_tokens=3))
    p0 = s.schedule()                      # the prompt: samples output 1 (position 3)
    p1 = s.schedule()                      # step 0 is still in flight: decode its token anyway
    (c,) = p1.chunks
    assert (c.token_ids, c.start_pos, c.sample, c.output_token_ids) == ([PENDING_TOKEN], 3, True, [])
    assert [e.token_id for e in s.update(p0, sampled_for(p0))] == [fake_token("a#0", 3)]
    p2 = s.schedule()                      # output 2 in flight; output 3 (the last) still needs this
    assert [(c.token_ids, c.start_pos) for c in p2.chunks] == [([PENDING_TOKEN], 4)]
    s.update(p1, sampled_for(p1))
    p3 = s.schedule()                      # the in-flight output 3 ends it by length: nothing to plan
    assert p3.chunks == []
    (last,) = s.update(p2, sampled_for(p2))
    assert last.finish_reason is FinishReason.LENGTH and not s.has_work()
    assert s.allocator.num_free_pages == 16
    s.add(req("b", [1, 2, 3], max_tokens=3))
    assert tokens_of(e for _, ev in run_async(s) for e in ev) == run_alone(req("b", [1, 2, 3], max_tokens=3))


def test_async_stop_at_step_n_discards_the_step_n_plus_1_token_and_frees_the_pages():
    s = make(num_pages=16, page_size=4)
    s.add(req("a", [1, 2, 3], max_tokens=10))
    p0 = s.schedule()
    p1 = s.schedule()
    (e,) = s.update(p0, SampledRows([EOS]))
    assert e.finish_reason is FinishReason.STOP
    assert s.allocator.num_free_pages == 16  # freed although step 1 still writes them (see scheduler.py)
    # The id is free again while step 1 is in flight; the new request must not receive its token.
    s.add(req("a", [7, 8, 9, 10, 11], max_tokens=2))
    p2 = s.schedule()
    assert [c.token_ids for c in p2.chunks] == [[7, 8, 9, 10, 11]]
    assert s.update(p1, SampledRows([42])) == [] and s.num_discarded_tokens == 1
    (e,) = s.update(p2, SampledRows([43]))
    assert (e.token_id, e.num_prompt_tokens, e.finish_reason) == (43, 5, None)


def test_async_preempted_sequence_keeps_its_in_flight_token():
    # 4 pages of 2 tokens; each request grows to 6 tokens (3 pages): the newer one is preempted
    # while its token is in flight, and that token is still emitted and then recomputed.
    s = make(num_pages=4, page_size=2, max_num_seqs=2, max_num_batched_tokens=8, max_model_len=16)
    reqs = [req("a", [1, 2], max_tokens=4), req("b", [3, 4], max_tokens=4)]
    for r in reqs:
        s.add(r)
    history = run_async(s)
    hit = [i for i, (plan, _) in enumerate(history) if "b#0" in plan.preempted]
    assert hit
    # the update that follows the preempting schedule still emits b's in-flight token
    assert any(e.request_id == "b" and e.token_id is not None for e in history[hit[0]][1])
    out: dict = {}
    for _, events in history:
        for e in events:
            out.setdefault(e.request_id, []).append(e)
    for r in reqs:
        assert tokens_of(out[r.request_id]) == run_alone(r)
        assert [e.finish_reason for e in out[r.request_id]].count(FinishReason.LENGTH) == 1
    assert s.allocator.num_free_pages == 4


def test_async_abort_with_a_token_in_flight_emits_only_the_abort():
    s = make(num_pages=16, page_size=4)
    s.add(req("a", [1, 2, 3], max_tokens=10))
    p0 = s.schedule()
    p1 = s.schedule()
    s.update(p0, sampled_for(p0))
    s.abort("a")
    p2 = s.schedule()
    assert [(e.request_id, e.finish_reason) for e in p2.finished] == [("a", FinishReason.ABORT)]
    assert p2.chunks == [] and s.allocator.num_free_pages == 16
    assert s.update(p1, sampled_for(p1)) == [] and not s.has_work()


def test_schedule_plans_at_most_one_step_ahead():
    s = make()
    for rid in ("a", "b", "c"):
        s.add(req(rid, [1, 2, 3], max_tokens=8))
    p0 = s.schedule()
    p1 = s.schedule()
    with pytest.raises(RuntimeError, match="2 plans await update"):
        s.schedule()
    s.update(p0, sampled_for(p0))
    assert [c.token_ids for c in s.schedule().chunks] == [[PENDING_TOKEN]] * 3  # the tokens of p1
    assert p1.chunks
