"""Shared helpers for engine-level tests: a tiny HF model, an EngineCore on it, a run-to-completion loop."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from checkpoints import load_model
from hf_models import make_hf_model
from jaxserve.core.config import EngineConfig
from jaxserve.engine.engine_core import EngineCore
from jaxserve.core.request import Request
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.parallel.sharding import make_mesh

SMALL_ENGINE = dict(page_size=4, num_kv_pages=96, max_num_seqs=8, max_num_batched_tokens=32,
                    max_model_len=96, token_buckets=(8, 32), seq_buckets=(8,))


def tiny_model(directory: Path, variant: str = "qwen3-qknorm", **overrides: Any):
    path, hf_model = make_hf_model(variant, directory, **overrides)
    cfg, weights = load_model(path, make_mesh(1, 1))
    return cfg, weights, hf_model


def make_core(cfg, weights, mesh=None, **engine_overrides: Any) -> EngineCore:
    ecfg = EngineConfig(**{**SMALL_ENGINE, **engine_overrides})
    core = EngineCore(cfg, weights, ecfg, mesh or make_mesh(1, 1))
    core.runner.warmup()
    return core


def greedy(max_tokens: int, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def run_all(core: EngineCore, requests: list[Request], on_step=None) -> dict[str, dict[int, list[int]]]:
    """Adds the requests, steps until idle; returns request_id -> sample_index -> token ids."""
    for r in requests:
        core.add_request(r)
    out: dict[str, dict[int, list[int]]] = {}
    while core.has_work():
        for e in core.step():
            if e.token_id is not None:
                out.setdefault(e.request_id, {}).setdefault(e.sample_index, []).append(e.token_id)
        if on_step is not None:
            on_step()
    return out


def run_events(core: EngineCore, request: Request) -> list[Any]:
    """Runs one request to completion; its token events in order (logprobs included)."""
    core.add_request(request)
    events = []
    while core.has_work():
        events.extend(e for e in core.step() if e.token_id is not None)
    return events


def record_proposals(core: EngineCore) -> list[tuple[str, int, list[int]]]:
    """Wraps the runner's propose: (seq_id, start_pos, drafts) of every proposal made from now on."""
    seen, propose = [], core.runner.propose

    def wrapped(plan, prev_plan):
        out = propose(plan, prev_plan)
        seen.extend((c.seq_id, c.start_pos, list(d)) for c, d in zip([c for c in plan.chunks if c.draft_token_ids], out))
        return out

    core.runner.propose = wrapped
    return seen
