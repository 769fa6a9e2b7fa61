"""Statistical checks: sampled token frequencies match the analytic distribution (chi-square).

One jitted call draws N tokens for each configuration (every row the same logits over a small
vocabulary, a different seed or token index per row); the analytic distribution is computed here
in float64 with a sort-based reference. Tokens outside the kept set must never appear.
"""

import math

import jax
import numpy as np
import pytest

from jaxserve.runner.sampler import sample
from jaxserve.runner.sampling_tensors import SamplingRow, SamplingTensors
from jaxserve.core.sampling_params import SamplingParams

VOCAB, WIDTH, N = 16, 20, 3000
# Fixed, unsorted logits; the 4 padding columns are huge so an unmasked one would dominate.
LOGITS = np.array([0.3, 1.9, -0.8, 1.2, 0.0, 2.4, -1.5, 0.9, 1.6, -0.3, 0.5, -2.0, 1.1, 0.2, -0.6,
                   2.0], np.float64)

CONFIGS = {
    "temperature_1": SamplingParams(temperature=1.0),
    "temperature_0.7": SamplingParams(temperature=0.7),
    "top_k": SamplingParams(temperature=1.0, top_k=5),
    "top_p": SamplingParams(temperature=1.0, top_p=0.6),
    "top_k_and_top_p": SamplingParams(temperature=0.8, top_k=6, top_p=0.7),
    "min_p_hot": SamplingParams(temperature=2.0, min_p=0.2),
    "all_filters": SamplingParams(temperature=1.3, top_k=9, top_p=0.9, min_p=0.15),
    "token_index": SamplingParams(temperature=1.0),  # one seed; rows differ by num_output_tokens
}


def _softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max())
    return e / e.sum()


def reference_distribution(p: SamplingParams) -> np.ndarray:
    """Sort-based float64 reference of temperature -> top-k -> top-p (renormalised) -> min-p."""
    probs = _softmax(LOGITS / p.temperature)
    order = np.argsort(-probs, kind="stable")
    keep = np.ones(VOCAB, bool)
    if 0 < p.top_k < VOCAB:
        keep[order[p.top_k:]] = False
    if p.top_p < 1.0:
        kept_probs = np.where(keep, probs, 0.0)[order] / np.where(keep, probs, 0.0).sum()
        before = np.cumsum(kept_probs) - kept_probs      # mass strictly above each token
        gaps = np.abs(np.cumsum(kept_probs) - p.top_p)
        assert gaps.min() > 1e-3, "top_p sits on a cumulative-mass boundary: ambiguous test"
        keep[order[before >= p.top_p]] = False
    keep &= probs >= p.min_p * probs.max()
    out = np.where(keep, probs, 0.0)
    return out / out.sum()


def chi2_sf(stat: float, dof: int) -> float:
    """Chi-square survival function; scipy when present, else the regularized upper gamma Q."""
    try:
        from scipy.stats import chi2
        return float(chi2.sf(stat, dof))
    except ImportError:
        return _upper_gamma_q(dof / 2.0, stat / 2.0)


def _upper_gamma_q(a: float, x: float) -> float:
    if x <= 0:
        return 1.0
    log_front = -x + a * math.log(x) - math.lgamma(a)
    if x < a + 1:  # series for P(a, x)
        term = total = 1.0 / a
        n = a
        while abs(term) > 1e-15 * abs(total):
            n += 1
            term *= x / n
            total += term
        return 1.0 - total * math.exp(log_front)
    # Lentz continued fraction for Q(a, x)
    tiny = 1e-300
    b = x + 1 - a
    c, d = 1 / tiny, 1 / b
    h = d
    for i in range(1, 1000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1 / d
        delta = d * c
        h *= delta
        if abs(delta - 1) < 1e-15:
            break
    return math.exp(log_front) * h


@pytest.fixture(scope="module")
def draws() -> dict[str, np.ndarray]:
    rows = []
    for c, (name, params) in enumerate(CONFIGS.items()):
        for j in range(N):
            if name == "token_index":
                rows.append(SamplingRow(params, 777, [], [0] * j))
            else:
                rows.append(SamplingRow(params, 10_000 * c + j, [], []))
    greedy = [SamplingRow(SamplingParams(temperature=0.0), s, [], []) for s in range(64)]
    rows += greedy
    logits = np.zeros((len(rows), WIDTH), np.float32)
    logits[:, :VOCAB] = LOGITS
    logits[:, VOCAB:] = 40.0
    tensors = SamplingTensors.from_rows(rows, len(rows), VOCAB)
    out = jax.jit(sample, static_argnames="vocab_size")(logits, tensors, vocab_size=VOCAB)
    tokens = np.asarray(out.token_ids)
    result = {name: tokens[c * N:(c + 1) * N] for c, name in enumerate(CONFIGS)}
    result["greedy"] = tokens[len(CONFIGS) * N:]
    return result


@pytest.mark.parametrize("name", list(CONFIGS))
def test_sample_frequencies_match_distribution(draws, name):
    want = reference_distribution(CONFIGS[name])
    counts = np.bincount(draws[name], minlength=WIDTH)
    assert counts[VOCAB:].sum() == 0, "a vocab padding column was sampled"
    assert counts[:VOCAB][want == 0].sum() == 0, "a truncated token was sampled"
    kept = np.flatnonzero(want > 0)
    assert kept.size >= 2
    observed, expected = _pooled_bins(counts[kept], N * want[kept])
    stat = float(np.sum((observed - expected) ** 2 / expected))
    p_value = chi2_sf(stat, observed.size - 1)
    assert p_value > 1e-3, (name, stat, p_value, counts[:VOCAB], np.round(N * want))


def _pooled_bins(observed: np.ndarray, expected: np.ndarray, min_expected: float = 5.0):
    """Merge the rarest tokens into shared bins until every bin expects >= 5 draws."""
    order = np.argsort(expected)
    obs_bins, exp_bins, o_acc, e_acc = [], [], 0.0, 0.0
    for i in order:
        o_acc, e_acc = o_acc + observed[i], e_acc + expected[i]
        if e_acc >= min_expected:
            obs_bins.append(o_acc)
            exp_bins.append(e_acc)
            o_acc = e_acc = 0.0
    if e_acc > 0:  # leftover rare mass joins the last bin
        obs_bins[-1] += o_acc
        exp_bins[-1] += e_acc
    return np.array(obs_bins), np.array(exp_bins)


def test_reference_truncates_as_configured():
    """The filtering configurations above really cut the vocabulary (else the test proves less)."""
    kept = {name: int((reference_distribution(p) > 0).sum()) for name, p in CONFIGS.items()}
    assert kept["top_k"] == 5
    assert 1 < kept["top_p"] < VOCAB and 1 < kept["min_p_hot"] < VOCAB
    assert 1 < kept["top_k_and_top_p"] < 6
    # top-p renormalised over the top-k set keeps fewer tokens than top-p over the full vocabulary
    p = CONFIGS["top_k_and_top_p"]
    top_p_only = SamplingParams(temperature=p.temperature, top_p=p.top_p)
    unrenormalised = reference_distribution(top_p_only)
    assert kept["top_k_and_top_p"] < min(p.top_k, int((unrenormalised > 0).sum()))
    assert 1 < kept["all_filters"] < 9


def test_greedy_is_exact_argmax(draws):
    assert np.all(draws["greedy"] == np.argmax(LOGITS))


def test_chi2_fallback_matches_known_quantiles():
    # 95% quantiles of the chi-square distribution for 1, 4 and 15 degrees of freedom
    for stat, dof in ((3.841459, 1), (9.487729, 4), (24.99579, 15)):
        assert abs(_upper_gamma_q(dof / 2, stat / 2) - 0.05) < 1e-5
    assert abs(_upper_gamma_q(1.0, 0.5) - math.exp(-0.5)) < 1e-12  # dof 2: Q = exp(-x/2)
