"""The grammar's token bitmask inside the jitted sampler, against a numpy reference."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxserve.runner.sampler import apply_bitmask, bitmask_words, sample
from jaxserve.runner.sampling_tensors import SamplingRow, SamplingTensors
from jaxserve.core.sampling_params import SamplingParams

V = 200  # not a multiple of 32: the last word is partial


def _reference_allowed(mask: np.ndarray, v: int) -> np.ndarray:
    """[R, W] int32 -> [R, v] bool: bit j of word w allows token 32 w + j (llguidance's layout)."""
    bits = np.unpackbits(mask.view(np.uint8), axis=1, bitorder="little").astype(bool)
    return bits[:, :v]


def _random_mask(rng: np.random.Generator, rows: int, density: float) -> np.ndarray:
    allowed = rng.random((rows, bitmask_words(V) * 32)) < density
    allowed[:, 0] |= ~allowed.any(axis=1)  # at least one allowed token per row
    return np.packbits(allowed, axis=1, bitorder="little").view(np.int32)


def test_bitmask_words_rounds_up():
    assert bitmask_words(32) == 1 and bitmask_words(33) == 2 and bitmask_words(151936) == 4748


def test_apply_bitmask_masks_constrained_rows_only():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4, V)).astype(np.float32)
    mask = _random_mask(rng, 4, 0.3)
    constrained = np.array([True, False, True, False])
    got = np.asarray(jax.jit(apply_bitmask)(x, mask, constrained))
    allowed = _reference_allowed(mask, V)
    for r in range(4):
        if constrained[r]:
            np.testing.assert_array_equal(got[r], np.where(allowed[r], x[r], -np.inf))
        else:
            np.testing.assert_array_equal(got[r], x[r])
    # no constrained row: the logits pass through untouched
    np.testing.assert_array_equal(np.asarray(apply_bitmask(x, mask, np.zeros(4, bool))), x)


def _tensors(params: list[SamplingParams], constrained: list[bool]) -> SamplingTensors:
    rows = [SamplingRow(p, 7 + i, [1, 2], [], frozenset(), c) for i, (p, c) in enumerate(zip(params, constrained))]
    return SamplingTensors.from_rows(rows, len(rows), V)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_sampled_tokens_are_always_allowed_and_logprobs_use_the_masked_distribution(temperature):
    rng = np.random.default_rng(1)
    rows = 8
    logits = rng.normal(size=(rows, V)).astype(np.float32) * 3
    mask = _random_mask(rng, rows, 0.05)
    constrained = [True] * 6 + [False] * 2
    params = [SamplingParams(temperature=temperature, logprobs=3)] * rows
    t = _tensors(params, constrained)
    allowed = _reference_allowed(mask, V)
    fn = jax.jit(sample, static_argnames="vocab_size")
    seen = set()
    for step in range(20):
        t = t._replace(num_output_tokens=np.full(rows, step, np.int32))
        out = fn(logits, t, vocab_size=V, bitmask=mask)
        ids = np.asarray(out.token_ids)
        for r in range(6):
            assert allowed[r, ids[r]], (step, r, ids[r])
            seen.add((r, int(ids[r])))
            masked = np.where(allowed[r], logits[r] / max(temperature, 1.0), -np.inf)
            ref = masked - np.logaddexp.reduce(masked)
            np.testing.assert_allclose(float(out.logprobs[r]), ref[ids[r]], rtol=1e-4, atol=1e-4)
            top = np.asarray(out.top_ids[r, :3])
            assert all(allowed[r, i] for i in top if i >= 0)
        if temperature == 0:
            for r in range(6):
                assert ids[r] == np.argmax(np.where(allowed[r], logits[r], -np.inf))
    if temperature > 0:  # sampling still explores the allowed set
        assert len(seen) > 6


def test_unconstrained_rows_sample_as_without_a_mask():
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(4, V)).astype(np.float32)
    params = [SamplingParams(temperature=1.0)] * 4
    plain = sample(logits, _tensors(params, [False] * 4), V)
    mixed = sample(logits, _tensors(params, [True, False, False, False]), V, _random_mask(rng, 4, 0.1))
    np.testing.assert_array_equal(np.asarray(plain.token_ids)[1:], np.asarray(mixed.token_ids)[1:])


def test_the_sampler_program_never_copies_the_logits():
    """The serving sampler takes a bitmask for every batch (all-allowed when no row is constrained):
    no branch of its conds may pass the logits through unchanged, or XLA copies the [R, V] logits
    at the program's entry (and again in the branch) for every batch, a greedy one included (on a
    CPU: 64 x 151,936 greedy rows 6-7 ms instead of 1.4-2)."""
    from jaxserve.runner.packing import pack
    from jaxserve.runner.programs import sample_step

    rows = 8
    x = np.zeros((rows, V + 56), np.float32)  # padded logits width, like the lm_head's
    t = SamplingTensors.from_rows([SamplingRow(SamplingParams(temperature=0.0), 0, [1], [], frozenset())], rows, V)
    packed, spec = pack(t)
    mask = np.full((rows, bitmask_words(V)), -1, np.int32)
    prev_ids = np.zeros(rows, np.int32)
    hlo = sample_step.lower(x, packed, mask, prev_ids, spec=spec, vocab_size=V, width=rows).compile().as_text()
    copies = [line for line in hlo.splitlines() if " copy(" in line and f"f32[{rows},{V + 56}]" in line.split("copy(")[0]]
    assert not copies, copies
