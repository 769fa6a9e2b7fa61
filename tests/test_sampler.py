"""Sampler arithmetic, seeds, logprobs, vocab padding and compilation behaviour (exact checks).

Shapes are shared across tests (R=8 rows, logits width 24, vocab 16) so the jitted functions
compile only a handful of times.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.core.buckets import history_buckets
from jaxserve.runner.sampler import argmax_rows, process_logits, sample
from jaxserve.runner.sampling_tensors import PADDING_TEMPERATURE, SamplingRow, SamplingTensors
from jaxserve.core.sampling_params import SamplingParams

R, WIDTH, VOCAB = 8, 24, 16
SAMPLE = jax.jit(sample, static_argnames="vocab_size")
PROCESS = jax.jit(process_logits, static_argnames="vocab_size")


def _logits(seed: int = 0, rows: int = R, width: int = WIDTH, vocab: int = VOCAB) -> np.ndarray:
    x = np.random.default_rng(seed).normal(size=(rows, width)).astype(np.float32) * 2
    x[:, vocab:] = 50.0  # padding columns: would win everything if they were not masked
    return x


def _processed_row(logits_row, params, prompt=(), output=(), eos=frozenset()):
    row = SamplingRow(params, 0, list(prompt), list(output), eos)
    t = SamplingTensors.from_rows([row], R, VOCAB)
    x = np.zeros((R, WIDTH), np.float32)
    x[0] = logits_row
    return np.asarray(PROCESS(x, t, vocab_size=VOCAB))[0]


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    l = _logits(1)[0]
    l[1], l[2], l[3] = 2.0, -1.0, 0.6
    got = _processed_row(l, SamplingParams(repetition_penalty=1.5), prompt=[1, 2, 1], output=[3])
    want = l.copy()
    want[1], want[2], want[3] = 2.0 / 1.5, -1.0 * 1.5, 0.6 / 1.5
    want[VOCAB:] = -np.inf
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_presence_and_frequency_penalties_count_output_tokens_only():
    l = _logits(2)[0]
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    got = _processed_row(l, params, prompt=[1, 3], output=[3, 3, 5])
    want = l.copy()
    want[3] -= 0.5 + 0.25 * 2
    want[5] -= 0.5 + 0.25 * 1
    want[VOCAB:] = -np.inf  # token 1 (prompt only) is untouched
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_logit_bias_adds_to_logits():
    l = _logits(3)[0]
    got = _processed_row(l, SamplingParams(logit_bias={2: 5.0, 7: -100.0, 15: 0.5}))
    want = l.copy()
    want[2] += 5.0
    want[7] -= 100.0
    want[15] += 0.5
    want[VOCAB:] = -np.inf
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_bias_then_repetition_then_presence_frequency_then_temperature():
    l = _logits(4)[0]
    l[4], l[6] = -1.0, 1.0
    params = SamplingParams(temperature=0.5, logit_bias={4: 3.0, 6: -3.0}, repetition_penalty=2.0,
                            presence_penalty=0.3, frequency_penalty=0.1)
    got = _processed_row(l, params, prompt=[4], output=[6, 6, 9])
    want = l.copy()
    want[4] = (-1.0 + 3.0) / 2.0                 # bias made it positive, so it is divided
    want[6] = (1.0 - 3.0) * 2.0 - 0.3 - 0.1 * 2  # bias made it negative, so it is multiplied
    want[9] = want[9] / 2.0 if want[9] > 0 else want[9] * 2.0
    want[9] -= 0.3 + 0.1
    want[VOCAB:] = -np.inf
    np.testing.assert_allclose(got, want / 0.5, rtol=1e-6)


def test_stop_and_eos_ids_banned_until_min_tokens():
    l = _logits(5)[0]
    params = SamplingParams(min_tokens=3, stop_token_ids=[2])
    before = _processed_row(l, params, output=[1, 1], eos=frozenset({7}))
    assert before[2] == -np.inf and before[7] == -np.inf
    np.testing.assert_array_equal(np.delete(before[:VOCAB], [2, 7]), np.delete(l[:VOCAB], [2, 7]))
    after = _processed_row(l, params, output=[1, 1, 1], eos=frozenset({7}))
    np.testing.assert_array_equal(after[:VOCAB], l[:VOCAB])
    ignoring = _processed_row(l, SamplingParams(min_tokens=3, ignore_eos=True), eos=frozenset({7}))
    np.testing.assert_array_equal(ignoring[:VOCAB], l[:VOCAB])


def test_greedy_rows_take_argmax_of_penalised_logits_whatever_the_seed():
    l = _logits(6)[0]
    top = int(np.argmax(l[:VOCAB]))
    params = SamplingParams(temperature=0.0, logit_bias={top: -20.0})
    rows = [SamplingRow(params, seed, [], [top] * seed) for seed in range(R)]
    out = SAMPLE(np.tile(l, (R, 1)), SamplingTensors.from_rows(rows, R, VOCAB), vocab_size=VOCAB)
    biased = l[:VOCAB].copy()
    biased[top] -= 20.0
    np.testing.assert_array_equal(np.asarray(out.token_ids), np.full(R, np.argmax(biased)))


def test_vocab_padding_columns_never_sampled_nor_listed():
    x = _logits(7)
    params = [SamplingParams(temperature=t, logprobs=5) for t in (0.0, 1.0, 5.0, 100.0)]
    tensors = [SamplingTensors.from_rows([SamplingRow(params[i % 4], 100 * k + i, [], [])
                                          for i in range(R)], R, VOCAB) for k in range(8)]
    for t in tensors:
        out = SAMPLE(x, t, vocab_size=VOCAB)
        assert np.all(np.asarray(out.token_ids) < VOCAB)
        top_ids = np.asarray(out.top_ids)
        assert np.all(top_ids[:, :VOCAB] < VOCAB) and np.all(top_ids[:, :VOCAB] >= 0)
        assert np.all(top_ids[:, VOCAB:] == -1)  # fewer real tokens than 20: -1 / -inf fill
        assert np.all(np.asarray(out.top_logprobs)[:, VOCAB:] == -np.inf)


def test_logprobs_are_log_softmax_of_processed_logits_and_top20_sorted():
    vocab, width = 40, 44  # more real tokens than the 20 returned
    x = _logits(8, width=width, vocab=vocab)
    ps = [SamplingParams(temperature=0.5, top_k=3, logprobs=20, repetition_penalty=1.3),
          SamplingParams(temperature=0.0, logprobs=0, presence_penalty=1.0),
          SamplingParams(temperature=1.5, top_p=0.5, min_p=0.1)]
    rows = [SamplingRow(ps[i % 3], i, [1, 2, 3], [4, 4, i]) for i in range(R)]
    t = SamplingTensors.from_rows(rows, R, vocab)
    out = SAMPLE(x, t, vocab_size=vocab)
    processed = np.asarray(PROCESS(x, t, vocab_size=vocab), np.float64)[:, :vocab]
    want = processed - np.log(np.sum(np.exp(processed - processed.max(1, keepdims=True)), 1,
                                     keepdims=True)) - processed.max(1, keepdims=True)
    tok = np.asarray(out.token_ids)
    asked = np.array([ps[i % 3].logprobs is not None for i in range(R)])
    np.testing.assert_allclose(np.asarray(out.logprobs)[asked], want[np.arange(R), tok][asked], rtol=1e-5,
                               atol=2e-5)
    assert np.all(np.asarray(out.logprobs)[~asked] == 0)  # no normaliser computed for them
    order = np.argsort(-want, axis=1, kind="stable")[:, :20]
    np.testing.assert_array_equal(np.asarray(out.top_ids), order)
    top_lp = np.asarray(out.top_logprobs)
    np.testing.assert_allclose(top_lp, np.take_along_axis(want, order, 1), rtol=1e-5, atol=2e-5)
    assert np.all(np.diff(top_lp, axis=1) <= 0)
    # greedy rows (temperature 0) report logprobs at temperature 1
    greedy = [i for i in range(R) if i % 3 == 1]
    np.testing.assert_array_equal(tok[greedy], np.argmax(processed[greedy], axis=1))


def test_top_logprobs_skipped_when_no_row_asks():
    rows = [SamplingRow(SamplingParams(), i, [], []) for i in range(R)]
    out = SAMPLE(_logits(9), SamplingTensors.from_rows(rows, R, VOCAB), vocab_size=VOCAB)
    assert np.all(np.asarray(out.top_ids) == -1)
    assert np.all(np.asarray(out.logprobs) == 0)


def _target_and_filler(seed: int):
    target = SamplingRow(SamplingParams(temperature=1.2, top_k=10, top_p=0.95,
                                        repetition_penalty=1.1), seed, [1, 2], [5, 6, 7])
    rng = np.random.default_rng(seed)
    fillers = [SamplingRow(SamplingParams(temperature=float(rng.uniform(0, 2)),
                                          top_k=int(rng.integers(-1, 8)),
                                          frequency_penalty=float(rng.uniform(-1, 1)),
                                          logit_bias={int(rng.integers(VOCAB)): 1.0}),
                           int(rng.integers(1 << 40)), list(range(int(rng.integers(70)))), [3] * 5)
               for _ in range(15)]
    return target, fillers


def test_seeded_row_gives_same_token_whatever_the_batch():
    row_logits = _logits(10)[0]
    tokens = {}
    for seed in range(12):
        target, fillers = _target_and_filler(seed)
        layouts = [(R, 0, fillers[:0]), (R, 5, fillers[:7]), (2 * R, 13, fillers[:15])]
        got = []
        for num_rows, pos, others in layouts:
            rows = list(others)
            rows.insert(min(pos, len(rows)), target)
            x = _logits(seed + 100, rows=num_rows)
            x[rows.index(target)] = row_logits
            t = SamplingTensors.from_rows(rows, num_rows, VOCAB)
            got.append(int(SAMPLE(x, t, vocab_size=VOCAB).token_ids[rows.index(target)]))
        assert len(set(got)) == 1, (seed, got)
        tokens[seed] = got[0]
    assert len(set(tokens.values())) > 2  # the seed does drive the draw


def test_row_key_is_fold_in_of_seed_key_and_output_count():
    x = _logits(11)
    seeds = [0, 7, 2**31 + 5, 2**40 + 3, -1, -(2**63), 2**63 - 1, 123456789]
    rows = [SamplingRow(SamplingParams(), s, [], [0] * i) for i, s in enumerate(seeds)]
    out = SAMPLE(x, SamplingTensors.from_rows(rows, R, VOCAB), vocab_size=VOCAB)
    with jax.enable_x64(True):  # jax.random.key takes a 64-bit seed only under x64
        keys = [jax.random.key_data(jax.random.key(s, impl="threefry2x32")) for s in seeds]
    for i, kd in enumerate(keys):
        key = jax.random.fold_in(jax.random.wrap_key_data(jnp.asarray(kd, jnp.uint32),
                                                          impl="threefry2x32"), i)
        u = float(jax.random.uniform(key, (), jnp.float32))
        probs = np.where(np.arange(WIDTH) < VOCAB, np.exp(x[i] - x[i, :VOCAB].max()), 0.0).astype(np.float32)
        want = int(np.searchsorted(np.cumsum(probs), u * probs.sum(), side="right"))  # inverse CDF
        assert int(out.token_ids[i]) == want, (i, seeds[i])


class _CompileCounter:
    """Counts jaxpr traces and backend compiles (jax.monitoring events) inside a `with` block."""

    EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
              "/jax/core/compile/backend_compile_duration")

    def __enter__(self):
        self.count = 0
        jax.monitoring.register_event_duration_secs_listener(self._on_event)
        return self

    def _on_event(self, event, duration, **kwargs):
        self.count += event in self.EVENTS

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self._on_event)


def test_parameter_values_do_not_recompile():
    rows_bucket = 5  # a shape no other test uses, so the first call below really compiles
    f = jax.jit(sample, static_argnames="vocab_size")
    rng = np.random.default_rng(12)

    def random_tensors(n_prompt):
        rows = [SamplingRow(SamplingParams(
            temperature=float(rng.choice([0.0, rng.uniform(0.1, 3)])),
            top_k=int(rng.integers(-1, 20)), top_p=float(rng.uniform(0.05, 1)),
            min_p=float(rng.uniform(0, 0.5)), repetition_penalty=float(rng.uniform(0.5, 2)),
            presence_penalty=float(rng.uniform(-2, 2)), frequency_penalty=float(rng.uniform(-2, 2)),
            logit_bias={int(rng.integers(VOCAB)): float(rng.uniform(-100, 100))},
            logprobs=int(rng.integers(0, 21)), min_tokens=int(rng.integers(0, 8)),
            stop_token_ids=[int(rng.integers(VOCAB))]), int(rng.integers(1 << 62)),
            list(rng.integers(VOCAB, size=n_prompt)), list(rng.integers(VOCAB, size=4)))
            for _ in range(int(rng.integers(1, rows_bucket + 1)))]
        return SamplingTensors.from_rows(rows, rows_bucket, VOCAB)

    x = _logits(13, rows=rows_bucket)
    with _CompileCounter() as first:
        jax.block_until_ready(f(x, random_tensors(5), vocab_size=VOCAB))
    assert first.count >= 1  # the counter does see a compilation
    with _CompileCounter() as later:
        for n_prompt in (1, 5, 9, 12):
            jax.block_until_ready(f(x * n_prompt, random_tensors(n_prompt), vocab_size=VOCAB))
    assert later.count == 0
    # No penalty/bias in the batch: token-table width 0 is another declared shape -> compiles once.
    plain = SamplingTensors.from_rows([SamplingRow(SamplingParams(top_p=0.5), 3, [1], [2])],
                                      rows_bucket, VOCAB)
    with _CompileCounter() as other_bucket:
        f(x, plain, vocab_size=VOCAB)
        f(x, plain._replace(temperature=plain.temperature + 1), vocab_size=VOCAB)
    assert other_bucket.count >= 1
    with _CompileCounter() as again:
        f(x, random_tensors(3), vocab_size=VOCAB)
        f(x, plain._replace(top_p=plain.top_p * 0.5), vocab_size=VOCAB)
    assert again.count == 0


def test_from_rows_padding_rows_are_neutral_and_table_skipped_without_penalties():
    rows = [SamplingRow(SamplingParams(temperature=0.9, top_k=4, top_p=0.5, min_p=0.1, logprobs=3),
                        42, [1, 2], [3])]
    t = SamplingTensors.from_rows(rows, 4, VOCAB)
    assert not t.needs_history and t.table_ids.shape == (4, 0)
    # padding rows are marked: neither greedy nor sampled, so they never select a branch
    np.testing.assert_array_equal(t.temperature, [np.float32(0.9), PADDING_TEMPERATURE, PADDING_TEMPERATURE,
                                                  PADDING_TEMPERATURE])
    np.testing.assert_array_equal(t.top_k, [4, 0, 0, 0])
    np.testing.assert_array_equal(t.top_p, [0.5, 1, 1, 1])
    np.testing.assert_array_equal(t.min_p, [np.float32(0.1), 0, 0, 0])
    np.testing.assert_array_equal(t.repetition_penalty, [1, 1, 1, 1])
    np.testing.assert_array_equal(t.num_output_tokens, [1, 0, 0, 0])
    np.testing.assert_array_equal(t.num_logprobs, [3, -1, -1, -1])
    np.testing.assert_array_equal(t.seed_words[0], [0, 42])
    # top_k >= vocab and tiny temperatures mean "off" / greedy
    t2 = SamplingTensors.from_rows([SamplingRow(SamplingParams(top_k=VOCAB, temperature=1e-7), 0,
                                                [], [])], 1, VOCAB)
    assert t2.top_k[0] == 0 and t2.temperature[0] == 0


def test_from_rows_table_holds_distinct_ids_with_counts_and_flags():
    rows = [SamplingRow(SamplingParams(repetition_penalty=1.2, frequency_penalty=0.5,
                                       logit_bias={9: 2.0}), 1, [4, 2, 4], [2, 5, 5, 5])]
    t = SamplingTensors.from_rows(rows, 2, VOCAB)
    assert t.needs_history and t.table_ids.shape == (2, min(64, VOCAB))  # widths never exceed the vocab
    n = 4
    np.testing.assert_array_equal(t.table_ids[0, :n], [2, 4, 5, 9])
    np.testing.assert_array_equal(t.table_output_counts[0, :n], [1, 0, 3, 0])
    np.testing.assert_array_equal(t.table_seen[0, :n], [True, True, True, False])
    np.testing.assert_array_equal(t.table_bias[0, :n], [0, 0, 0, 2.0])
    assert np.all(t.table_ids[0, n:] == -1) and np.all(t.table_ids[1] == -1)


def test_history_buckets_cover_every_table_width_from_rows_produces():
    max_len, vocab = 200, 1000
    buckets = history_buckets(max_len, vocab)
    assert buckets[0] == 0 and buckets == sorted(buckets)
    worst = SamplingRow(SamplingParams(repetition_penalty=1.1, stop_token_ids=list(range(64)),
                                       min_tokens=1, logit_bias={i: 1.0 for i in range(700, 1000)}),
                        0, list(range(64, 64 + max_len)), [])
    t = SamplingTensors.from_rows([worst], 1, vocab)
    assert t.table_ids.shape[1] in buckets
    assert history_buckets(10**6, 151_936)[-1] >= 151_936


@pytest.mark.parametrize("bad", ["rows", "token", "seed"])
def test_from_rows_rejects_bad_input(bad):
    p = SamplingParams(repetition_penalty=1.1)
    if bad == "rows":
        rows, match = [SamplingRow(p, 0, [], [])] * 3, "row bucket"
    elif bad == "token":
        rows, match = [SamplingRow(p, 0, [VOCAB], [])], "token ids"
    else:
        rows, match = [SamplingRow(p, None, [], [])], "seed"
    with pytest.raises(ValueError, match=match):
        SamplingTensors.from_rows(rows, 2, VOCAB)


def test_sample_rejects_mismatched_shapes():
    t = SamplingTensors.from_rows([], R, VOCAB)
    with pytest.raises(ValueError, match="rows"):
        sample(jnp.zeros((R + 1, WIDTH)), t, VOCAB)
    with pytest.raises(ValueError, match="vocab_size"):
        sample(jnp.zeros((R, WIDTH)), t, WIDTH + 1)


@pytest.mark.parametrize("width", [1, 127, 128, 300, 151_936])
def test_argmax_rows_equals_jnp_argmax_with_ties_and_inf(width):
    rng = np.random.default_rng(width)
    x = rng.standard_normal((6, width)).astype(np.float32)
    x[1] = -np.inf                                    # a fully masked row: index 0, like jnp.argmax
    if width > 3:
        x[2, [width // 3, width - 1]] = 100.0          # a tie: the first index wins
        x[3, [1, width - 2]] = np.inf                  # +inf twice: the first wins
    x[4] = 0.0                                        # all equal
    got = np.asarray(jax.jit(argmax_rows)(jnp.asarray(x)))
    np.testing.assert_array_equal(got, np.asarray(jnp.argmax(jnp.asarray(x), axis=1)))
