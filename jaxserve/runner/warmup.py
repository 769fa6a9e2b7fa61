"""The model runner's warm-up: every declared program compiled and run once before serving, or
(background) the smallest bucket's programs now and the others on a thread while steps run on the
buckets already compiled (background_compile.py, shape_compile.py).

Warm-up runs each program on a step that writes nothing (every slot padding), so it compiles for
the argument shardings steps will give it; its compiles are counted as warm-up's, and after it
`ModelRunner.compilations_after_warmup` counts any compile on the serving thread (none expected).
"""

from __future__ import annotations

import functools
import logging
import time
from typing import TYPE_CHECKING, Callable

import jax
import numpy as np

from jaxserve.core.buckets import serving_programs
from jaxserve.runner.background_compile import BucketCompiler, first_programs
from jaxserve.runner.host_tier import warm_page_moves
from jaxserve.runner.programs import dummy_arrays, dummy_sampling, table_width
from jaxserve.runner.shape_compile import ShapeCompiler

if TYPE_CHECKING:
    from jaxserve.runner.model_runner import ModelRunner

logger = logging.getLogger("jaxserve.runner.warmup")


def warm_up(runner: "ModelRunner", progress: Callable[[int, int, str], None] | None, background: bool) -> float:
    """Compiles and runs the declared programs (programs.serving_programs); returns seconds.
    progress(done, total, name) after each program compiled before serving."""
    start = time.perf_counter()
    programs = serving_programs(runner.engine_cfg, runner.model_cfg)
    if background and (why := _no_background_warmup(runner)):
        logger.info("warm-up compiles every program before serving: %s", why)
        background = False
    now = first_programs(programs) if background else programs
    runner.programs_declared = len(programs)
    cfg = runner.engine_cfg
    dummy = functools.partial(dummy_arrays, max_pages=table_width(cfg, runner.model_cfg),
                              pad_slot=runner.num_pages * cfg.page_size, lora=cfg.enable_lora,
                              state_slots=runner.num_state_slots)
    # Steps feed the sample program's padded ids to the next forward: prime that buffer with a real
    # one, so the forwards below compile for the sharding steps will give them.
    first = now[0]
    logits, runner.kv = runner._forward(dummy(first))
    _, runner._prev_ids = runner._sample(logits, dummy_sampling(first.logits, 0))
    logits_by_rows = {}  # real forward outputs, so the sampler sees the shardings steps will give it
    for done, p in enumerate(now, 1):
        if p.kind == "forward":
            logits_by_rows[p.logits], runner.kv = runner._forward(dummy(p))
            if runner.head is not None:
                runner.head.warm_fill(p, runner._aux, runner._prev_ids)
        elif p.kind == "sample":
            jax.block_until_ready(runner._sample(logits_by_rows[p.rows], dummy_sampling(p.rows, p.history)))
        else:
            runner._copy_pages(np.zeros((1, 2), np.int32))  # page 0 onto itself: no change (a state slot too)
            jax.block_until_ready(runner.kv.k[0])
        if progress:
            progress(done, len(now), p.name)
    if runner.draft is not None:
        logger.info("draft model: %d programs warmed up", runner.draft.warmup(runner._prev_ids))
    if runner.head is not None:
        logger.info("EAGLE-3 head: a fill per forward program, %d proposal programs warmed up",
                    runner.head.warm_propose())
    if runner.lora is not None:
        runner.lora.warmup()
    if runner.host_tier is not None or cfg.kv_role is not None:  # host tier, PD exports/imports
        runner.kv = warm_page_moves(runner.kv, runner._put)
    if runner._proposer_tier is not None:
        runner.proposer.kv = warm_page_moves(runner.proposer.kv, runner._put)
    runner.warmed_up = True
    seconds = time.perf_counter() - start
    logger.info("warm-up compiled %d programs in %.1fs (%d loaded without tracing, %d compiled)%s", len(now),
                seconds, runner.programs.loaded, runner.programs.compiled,
                f"; {len(programs) - len(now)} more compile in the background" if background else "")
    runner.programs.preload()  # the stored programs still unread (a background warm-up read only its own)
    if background:
        shapes = ShapeCompiler(runner.programs, runner.weights,
                               runner._forward_args(dummy(first)), logits,
                               dict(vocab_size=runner.model_cfg.vocab_size, width=runner._rows_width), dummy)
        runner.background = BucketCompiler(programs, now, shapes.compile, runner.set_ready_buckets).start()
    return seconds


def _no_background_warmup(runner: "ModelRunner") -> str | None:
    """Why every program must compile before serving here (None: a background warm-up works)."""
    if runner.proposer is not None:
        return "a draft model or EAGLE-3 head compiles with every target bucket"
    if jax.process_count() > 1:
        return "several hosts run every program together"
    return None
