"""Speculative decoding in the scheduler: drafts ride on decodes, the accepted run is emitted with the
usual stop checks, rejected drafts are rolled back and never reach the prefix cache, and the token
stream equals plain decoding's. The "model" is a function of the position only, so a draft that
matches what it would sample is accepted and plain decoding is the oracle."""

import dataclasses
import zlib

import pytest

from jaxserve.core.config import EngineConfig
from jaxserve.engine.page_allocator import PageAllocator
from jaxserve.core.request import FinishReason, Request
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.core.step_plan import SampledRows
from jaxserve.engine.scheduler import Scheduler

EOS = 0
PATTERN = [11, 12, 13, 14, 15]
NGRAM = dict(method="ngram", num_speculative_tokens=3, prompt_lookup_max=3)


def periodic(seq_id: str, position: int) -> int:
    """Repeats PATTERN (so prompt lookup finds it) with a deviation at one position in six."""
    if zlib.crc32(f"{seq_id}:{position}".encode()) % 6 == 0:
        return 20 + position % 7
    return PATTERN[position % len(PATTERN)]


def make(spec=NGRAM, num_pages=64, page_size=4, **kw) -> Scheduler:
    limits = dict(max_num_seqs=16, max_num_batched_tokens=64, max_model_len=256)
    cfg = EngineConfig(num_kv_pages=num_pages, page_size=page_size, speculative_config=spec, **{**limits, **kw})
    return Scheduler(cfg, PageAllocator(num_pages, page_size, cfg.enable_prefix_caching))


def req(rid: str, prompt: list[int], **kw) -> Request:
    return Request(rid, prompt, SamplingParams(**{"max_tokens": 24, **kw}), eos_token_ids=frozenset({EOS}))


def sampled_rows(plan, model=periodic) -> SampledRows:
    """Row j of a chunk with d drafts samples the token after position start + len - (d + 1) + j."""
    out = []
    for c in plan.chunks:
        first = c.start_pos + len(c.token_ids) - c.num_sample_rows
        out += [model(c.seq_id, first + j + 1) for j in range(c.num_sample_rows)]
    return SampledRows(out)


def drain(s: Scheduler, model=periodic, on_plan=None) -> dict:
    out: dict = {}
    for _ in range(1000):
        if not s.has_work():
            return out
        plan = s.schedule()
        s.allocator.check_invariants()
        if on_plan:
            on_plan(plan)
        for e in plan.finished + s.update(plan, sampled_rows(plan, model)):
            out.setdefault((e.request_id, e.sample_index), []).append((e.token_id, e.finish_reason))
        s.allocator.check_invariants()
        _check_commits(s)
    raise AssertionError("scheduler did not drain")


def _check_commits(s: Scheduler) -> None:
    """Every running sequence's committed pages cover only tokens it has (known, verified)."""
    ps = s.allocator.page_size
    for seq in s._running:
        if s.allocator.has_sequence(seq.seq_id):
            assert s.allocator.num_committed_pages(seq.seq_id) * ps <= seq.num_tokens
            assert seq.num_computed_tokens <= seq.num_tokens + seq.num_inflight


def _workload() -> list[Request]:
    base = PATTERN * 3
    return [req("greedy", base + [11]),
            req("eos-inside-run", base + [12], max_tokens=40),
            req("min-tokens", base + [13], min_tokens=9, stop_token_ids=[14]),
            req("stop-id", base + [14], stop_token_ids=[13]),
            req("exact-length", base, max_tokens=7),
            req("n2", base + [15, 11], n=2, max_tokens=12),
            req("no-lookup", [30, 31, 32, 33], max_tokens=10)]


def _with_eos(seq_id: str, position: int) -> int:
    """periodic(), but one sequence meets EOS in the middle of a repeating stretch."""
    return EOS if seq_id.startswith("eos-inside-run") and position == 31 else periodic(seq_id, position)


@pytest.mark.parametrize("num_pages", [64, 14])  # 14 pages of 4 tokens: preemptions
def test_speculation_emits_exactly_what_plain_decoding_emits(num_pages):
    plain, spec = make(spec=None, num_pages=num_pages), make(num_pages=num_pages)
    for s in (plain, spec):
        for r in _workload():
            s.add(dataclasses.replace(r))
    drafts = []
    expected = drain(plain, _with_eos)
    got = drain(spec, _with_eos, on_plan=lambda p: drafts.extend(c.draft_token_ids for c in p.chunks))
    assert got == expected
    stats = spec.spec_stats
    assert stats.num_drafts == sum(1 for d in drafts if d) and stats.num_draft_tokens == sum(map(len, drafts))
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # both accepted and rejected drafts
    assert max(map(len, drafts)) == 3
    assert expected[("eos-inside-run", 0)][-1] == (EOS, FinishReason.STOP)
    assert len(expected[("exact-length", 0)]) == 7 and expected[("exact-length", 0)][-1][1] is FinishReason.LENGTH
    if num_pages == 14:
        assert spec.stats().num_preemptions > 0
    assert spec.allocator.num_free_pages == spec.allocator.num_pages


def test_a_draft_chunk_computes_the_last_token_and_the_drafts_and_rolls_back_rejections():
    s = make()
    s.add(req("a", PATTERN * 2 + [11], max_tokens=10))
    plan = s.schedule()
    s.update(plan, sampled_rows(plan))                   # prefill: samples the token after 11
    (seq,) = s._running
    plan = s.schedule()
    (c,) = plan.chunks
    last = seq.output_token_ids[-1]
    assert c.draft_token_ids and c.token_ids == [last, *c.draft_token_ids] and c.start_pos == seq.num_tokens - 1
    assert c.num_sample_rows == 1 + len(c.draft_token_ids) == plan.num_samples
    assert seq.num_computed_tokens == seq.num_tokens - 1 + len(c.token_ids)
    wrong = SampledRows([99] * plan.num_samples)  # every draft rejected
    (event,) = s.update(plan, wrong)
    assert event.token_id == 99 and seq.num_computed_tokens == seq.num_tokens - 1
    assert s.spec_stats.num_accepted_tokens == 0 and s.spec_stats.num_drafts == 1


def test_drafts_stay_within_max_tokens_budget_and_free_pages():
    s = make(max_num_batched_tokens=16, max_num_seqs=16)
    s.add(req("short", PATTERN * 2 + [11], max_tokens=3))
    plan = s.schedule()
    s.update(plan, sampled_rows(plan))
    plan = s.schedule()
    assert len(plan.chunks[0].draft_token_ids) == 1      # 2 tokens left: 1 draft + the bonus
    # A's drafts need a fourth page: with none free its decode runs without them, preempting nobody
    for num_pages, drafts in ((6, 2), (5, 0)):
        s = make(num_pages=num_pages, page_size=4)
        s.add(req("a", PATTERN * 2 + [11], max_tokens=4))   # 11 tokens: 3 pages
        s.add(req("b", [40, 41, 42, 43, 44, 45, 46], max_tokens=4))  # 7 tokens: 2 pages
        plan = s.schedule()
        s.update(plan, sampled_rows(plan, lambda seq_id, pos: 12 if seq_id == "a#0" else 47))
        plan = s.schedule()
        (a,) = [c for c in plan.chunks if c.seq_id == "a#0"]
        assert len(a.draft_token_ids) == drafts and not plan.preempted


def test_disable_by_batch_size_turns_speculation_off_above_it():
    s = make(spec={**NGRAM, "disable_by_batch_size": 2})
    for i in range(3):
        s.add(req(f"r{i}", PATTERN * 2 + [11]))
    plan = s.schedule()
    s.update(plan, sampled_rows(plan))
    assert not s.speculation_active() and not s.schedule().has_drafts
    s2 = make(spec={**NGRAM, "disable_by_batch_size": 3})
    for i in range(3):
        s2.add(req(f"r{i}", PATTERN * 2 + [11]))
    plan = s2.schedule()
    s2.update(plan, sampled_rows(plan))
    assert s2.speculation_active() and s2.schedule().has_drafts
    # waiting sequences count too (vLLM's "enqueued"): 2 running + 2 waiting > 3
    s3 = make(spec={**NGRAM, "disable_by_batch_size": 3}, max_num_seqs=2)
    for i in range(4):
        s3.add(req(f"r{i}", PATTERN * 2 + [11]))
    plan = s3.schedule()
    s3.update(plan, sampled_rows(plan))
    assert s3.stats().num_running == 2 and s3.stats().num_waiting == 2
    assert not s3.speculation_active() and not s3.schedule().has_drafts


class _Grammar:
    """A stand-in guide that allows tokens below 13 only (Guide's draft-facing surface)."""

    finished = False

    def valid_prefix(self, tokens):
        return next((i for i, t in enumerate(tokens) if t >= 13), len(tokens))

    def accept(self, token):
        return True

    def new_guide(self):
        return self


def test_a_constrained_sequence_drafts_only_what_its_grammar_allows():
    s = make()
    r = req("g", PATTERN * 2 + [11])
    s.add(dataclasses.replace(r, grammar=_Grammar()))
    plan = s.schedule()
    s.update(plan, SampledRows([12]))
    plan = s.schedule()
    assert plan.chunks[0].draft_token_ids == []           # after 11, 12 the pattern continues with 13
    s.update(plan, SampledRows([11]))
    plan = s.schedule()
    assert plan.chunks[0].draft_token_ids == [12]         # 11 -> 12 allowed, 13 is not


def test_a_speculating_sequence_is_not_planned_again_before_its_update():
    s = make()
    s.add(req("a", PATTERN * 2 + [11]))
    plan = s.schedule()
    s.update(plan, sampled_rows(plan))
    first = s.schedule()
    assert first.has_drafts
    assert s.schedule().chunks == []                      # async planning ahead finds nothing to run


def test_draft_model_slots_are_planned_then_filled_and_cut_by_the_grammar():
    s = make(spec={"method": "draft_model", "model": "unused", "num_speculative_tokens": 3})
    s.add(req("free", PATTERN * 2 + [11]))
    s.add(dataclasses.replace(req("g", PATTERN * 2 + [11]), grammar=_Grammar()))
    plan = s.schedule()
    s.update(plan, sampled_rows(plan, lambda seq_id, pos: 12))
    plan = s.schedule()
    assert all(len(c.draft_token_ids) == 3 and c.token_ids[1:] == c.draft_token_ids for c in plan.chunks)
    computed = {c.seq_id: plan.owners[c.seq_id].num_computed_tokens for c in plan.chunks}
    tokens = plan.num_tokens
    s.set_drafts(plan, [[12, 11, 13], [12, 11, 13]])        # the grammar refuses 13 for "g"
    free, g = sorted(plan.chunks, key=lambda c: c.seq_id)
    assert free.draft_token_ids == [12, 11, 13] and free.token_ids == [12, 12, 11, 13]
    assert g.draft_token_ids == [12, 11] and g.token_ids == [12, 12, 11]
    assert plan.num_tokens == tokens - 1 and plan.owners["g#0"].num_computed_tokens == computed["g#0"] - 1
    events = s.update(plan, sampled_rows(plan, lambda seq_id, pos: {12: 12, 13: 11}.get(pos, 12)))
    assert [e.token_id for e in events if e.request_id == "g"] == [12, 11, 12]   # both drafts accepted
    with pytest.raises(ValueError, match="proposals for"):
        s.set_drafts(s.schedule(), [])


def test_fruitless_proposals_back_off_exponentially_and_a_hit_resets():
    s = make()
    s.add(req("fresh", [30, 31, 32, 33], max_tokens=40))
    unique = lambda seq_id, pos: 100 + pos  # noqa: E731  never repeats: no n-gram ever matches
    active = []
    for _ in range(12):
        active.append(s.speculation_active())
        plan = s.schedule()
        assert not plan.has_drafts
        s.update(plan, sampled_rows(plan, unique))
    # nothing runs before step 1 (the prefill); misses at steps 2, 3 -> pause 1; at 5 -> pause 2; at 8 -> pause 4
    assert active == [False, True, True, False, True, False, False, True, False, False, False, False]
    (seq,) = s._running
    assert seq.draft_misses == 4
    s.drafting.outcome(seq, hit=True)
    assert seq.draft_misses == 0
