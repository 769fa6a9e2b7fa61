"""Compiling a serving program from shapes alone, while steps run: what a background warm-up does
for the buckets it left out (runner/background_compile.py).

The device state a step donates or replaces (the KV pool, the last step's ids, the LoRA slots) is
described once, on the serving thread, by ShapeDtypeStructs carrying the shardings the real arrays
have, so a program compiled here is the one a step's call finds in the program table: same key,
same signature on disk, and nothing on the device is touched from this thread.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.core.buckets import Program
from jaxserve.runner.packing import pack
from jaxserve.runner.program_store import ProgramTable
from jaxserve.runner.programs import DONATED, FORWARD_STATICS, dummy_sampling, forward_step, sample_step
from jaxserve.runner.sampler import bitmask_words


def abstract(tree: Any) -> Any:
    """Every array of `tree` as a ShapeDtypeStruct with its sharding (None leaves stay None)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


class ShapeCompiler:
    """compile(program) puts `program` in `table` without running it.

    weights: the served weights; forward_kwargs: a real forward call's keyword arguments
    (ModelRunner._forward_args of a warm-up step: the pool, the packed inputs, the statics...);
    logits: a real forward's logits (their sharding is every forward's); sample_statics: vocab_size
    and width as the sampler takes them; dummy: a bucket's dummy StepArrays (programs.dummy_arrays
    as the runner fills it)."""

    def __init__(self, table: ProgramTable, weights: Any, forward_kwargs: dict[str, Any], logits: jax.Array,
                 sample_statics: dict[str, Any], dummy: Callable[[Program], Any]) -> None:
        self._table = table
        kwargs = dict(forward_kwargs)
        self._statics = {k: kwargs.pop(k) for k in FORWARD_STATICS if k != "spec"}
        kwargs.pop("spec")
        self._host = kwargs.pop("packed").sharding  # how a step's host inputs are placed
        self._weights = abstract(weights)
        self._state = abstract(kwargs)             # kv, prev_ids, lora
        self._logits = logits.sharding
        self._vocab = logits.shape[1]
        self._sample_statics = sample_statics
        self._dummy = dummy

    def _host_array(self, array: np.ndarray) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(array.shape, array.dtype, sharding=self._host)

    def compile(self, program: Program) -> None:
        if program.kind == "forward":
            packed, spec = pack(self._dummy(program))
            self._table.compile_ahead(("forward", spec), forward_step, {"spec": spec, **self._statics}, DONATED,
                                      self._weights, packed=self._host_array(packed), **self._state)
        elif program.kind == "sample":
            packed, spec = pack(dummy_sampling(program.rows, program.history))
            words = bitmask_words(self._sample_statics["vocab_size"])
            logits = jax.ShapeDtypeStruct((program.rows, self._vocab), jnp.float32, sharding=self._logits)
            mask = self._host_array(np.zeros((program.rows, words), np.int32))
            self._table.compile_ahead(("sample", spec), sample_step, {"spec": spec, **self._sample_statics}, (),
                                      logits, self._host_array(packed), mask, self._state["prev_ids"])
        else:
            raise ValueError(f"{program.name} is compiled at start-up, not in the background")
