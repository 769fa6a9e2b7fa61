"""Every declared step shape: token and sequence buckets of the forward, history widths of the sampler,
and the list of programs they make (`serving_programs`: what warm-up compiles and `jaxserve plan`
lowers).

Pure Python (no jax): the capacity planner counts programs with it, step_inputs pads to it, the
model runner compiles exactly these shapes at warm-up.

Buckets grow by BUCKET_FACTOR (4) so the number of compiled programs stays logarithmic in the
limits, and the two largest token and sequence buckets are half the limit and the limit, so a busy
server's steps pad by at most 2x.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Sequence

from jaxserve.core.sampling_params import MAX_LOGIT_BIAS, MAX_STOP_TOKEN_IDS

if TYPE_CHECKING:
    from jaxserve.core.config import EngineConfig, ModelConfig

BUCKET_FACTOR = 4
MIN_TOKEN_BUCKET = 16
MIN_SEQ_BUCKET = 4
MIN_HISTORY_BUCKET = 64
HISTORY_FACTOR = 16
MAX_EOS_IDS = 64  # slack for EOS ids banned before min_tokens (bucket bound only)


def geometric_buckets(lo: int, hi: int) -> tuple[int, ...]:
    """lo x 4^k below hi/2, then hi/2 and hi; every bucket in [min(lo, hi), hi]."""
    if hi <= lo:
        return (hi,)
    out, b = set(), lo
    while b < hi // 2:
        out.add(b)
        b *= BUCKET_FACTOR
    out.update({max(lo, hi // 2), hi})
    return tuple(sorted(out))


def token_buckets(cfg: Any) -> tuple[int, ...]:
    """Declared step sizes in tokens: the config's list (kept below the budget, plus the budget),
    or the geometric ladder up to max_num_batched_tokens."""
    budget = cfg.max_num_batched_tokens
    if cfg.token_buckets:
        return tuple(sorted({b for b in cfg.token_buckets if b < budget} | {budget}))
    return geometric_buckets(min(MIN_TOKEN_BUCKET, budget), budget)


def seq_buckets(cfg: Any) -> tuple[int, ...]:
    """Declared sequence-row counts: the config's list (plus max_num_seqs), or the geometric ladder
    (half of max_num_seqs is a bucket: a decode step's lm_head and attention grow with its rows)."""
    top = cfg.max_num_seqs
    if cfg.seq_buckets:
        return tuple(sorted({b for b in cfg.seq_buckets if b < top} | {top}))
    return geometric_buckets(min(MIN_SEQ_BUCKET, top), top)


def decode_rows(cfg: Any) -> tuple[int, ...]:
    """Row counts S of the decode shapes (S, S): every sequence bucket within the token ladder, plus
    a factor-2 ladder from the smallest token bucket up to max_num_seqs. A step of n decodes has n
    tokens and n lm_head rows; the 4x sequence ladder alone would run 17-32 decodes (a burst's tail)
    through 64 vocabulary-wide lm_head rows, the step's largest cost on a small model."""
    tokens, seqs = token_buckets(cfg), seq_buckets(cfg)
    lo, hi = tokens[0], min(cfg.max_num_seqs, tokens[-1])
    ladder, s = set(), lo
    while s <= hi:
        ladder.add(s)
        s *= 2
    return tuple(sorted(ladder | {s for s in seqs if lo <= s <= tokens[-1]}))


def declared_buckets(cfg: Any) -> list[tuple[int, int]]:
    """All (T, S) forward shapes compiled at start-up, smallest first. A step of T tokens has at
    most T sequences, so sequence buckets above T are capped at T. Each of `decode_rows` also gets
    a decode shape (s, s): a step of n decodes has n tokens, and without it 65-128 decodes would run
    256 token rows through the layers (the token ladder grows 4x)."""
    tokens, seqs = token_buckets(cfg), seq_buckets(cfg)
    grid = {(t, min(s, t)) for t in tokens for s in seqs}
    return sorted(grid | {(s, s) for s in decode_rows(cfg)})


def logits_buckets(cfg: Any, tokens: int, rows: int) -> tuple[int, ...]:
    """Logits (sampler) row counts L declared for the forward bucket (tokens, rows): one per sequence
    row; with speculative decoding also up to 1 + k per sequence (drafts are sampled too), never
    more than the bucket's tokens. A step without drafts keeps L = S: the lm_head and the sampler
    cost grows with L (the sampler's top-p search reads [L, V] 32 times)."""
    spec = getattr(cfg, "speculative_config", None)
    if spec is None:
        return (rows,)
    return tuple(sorted({rows, min(tokens, rows * (1 + spec.num_speculative_tokens))}))


def choose_logits_rows(cfg: Any, tokens: int, rows: int, num_sample_rows: int) -> int:
    """The smallest declared L of bucket (tokens, rows) that holds `num_sample_rows`."""
    fitting = [b for b in logits_buckets(cfg, tokens, rows) if b >= num_sample_rows]
    if not fitting:
        raise ValueError(f"{num_sample_rows} sample rows exceed the logits rows of bucket T={tokens} S={rows} "
                         "(more drafts than speculative_config allows?)")
    return fitting[0]


def choose_bucket(buckets: Sequence[tuple[int, int]], num_tokens: int, num_seqs: int) -> tuple[int, int]:
    """The declared (T, S) that holds the step with the fewest sequence rows, then the fewest tokens:
    a sequence row costs a vocabulary-wide lm_head row, so a decode shape (s, s) must not take a
    step of few sequences that a (T, small S) shape holds."""
    fitting = [b for b in buckets if b[0] >= num_tokens and b[1] >= num_seqs]
    if not fitting:
        raise ValueError(f"no declared bucket holds {num_tokens} tokens and {num_seqs} sequences; "
                         f"largest is {max(buckets)}")
    return min(fitting, key=lambda b: (b[1], b[0]))


def history_buckets(max_model_len: int, vocab_size: int | None = None) -> list[int]:
    """Every token-table width H that the sampler's `from_rows` can produce (0 = no table).

    The model runner precompiles these (times its row buckets). Widths grow 16x (the table is
    small next to the vocab-wide work it feeds, so its padding costs little) until one holds the
    widest table possible: a row whose whole context is distinct tokens plus a full logit_bias and
    the stop/EOS ids. No width exceeds the vocabulary (a row's ids are distinct).
    """
    if max_model_len < 1:
        raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
    limit = max_model_len + MAX_LOGIT_BIAS + MAX_STOP_TOKEN_IDS + MAX_EOS_IDS
    if vocab_size is not None:
        limit = min(limit, vocab_size)
    buckets = [0]
    while buckets[-1] < limit:
        buckets.append(history_bucket(buckets[-1] + 1, vocab_size))
    return buckets


def history_bucket(n: int, vocab_size: int | None = None) -> int:
    """The declared width that holds a table of n distinct ids: 0, or 64 x 16^k capped at the vocab."""
    h = 0 if n == 0 else MIN_HISTORY_BUCKET
    while h < n:
        h *= HISTORY_FACTOR
    return h if vocab_size is None else min(h, vocab_size)


@dataclasses.dataclass(frozen=True)
class Program:
    """One compiled program of the serving set."""

    kind: str          # "forward" | "sample" | "copy"
    tokens: int = 0    # forward: T
    rows: int = 0      # forward: S sequence rows; sample: its logits rows
    history: int = 0   # sample: H (width of the penalty / bias table)
    logits: int = 0    # forward: logits rows L (S; with speculative decoding also more: logits_buckets)

    def __post_init__(self) -> None:
        if self.kind == "forward" and not self.logits:
            object.__setattr__(self, "logits", self.rows)

    @property
    def name(self) -> str:
        if self.kind == "forward":
            extra = f" L={self.logits}" if self.logits != self.rows else ""
            return f"forward T={self.tokens} S={self.rows}{extra}"
        if self.kind == "sample":
            return f"sample S={self.rows} H={self.history}"
        return "page copy"


def serving_programs(engine_cfg: "EngineConfig", model_cfg: "ModelConfig") -> list[Program]:
    """Every program warm-up compiles, in warm-up order (engine_cfg resolved: capacity.py)."""
    buckets = declared_buckets(engine_cfg)
    forwards = [Program("forward", t, s, logits=l) for t, s in buckets for l in logits_buckets(engine_cfg, t, s)]
    rows = sorted({p.logits for p in forwards})
    hist = history_buckets(engine_cfg.max_model_len, model_cfg.vocab_size)
    return (forwards
            + [Program("sample", rows=s, history=h) for s in rows for h in hist]
            + [Program("copy")])
