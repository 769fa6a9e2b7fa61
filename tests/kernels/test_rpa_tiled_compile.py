"""The tiled jnp attention (CPU production path; the TPU/GPU fallback when KV heads do not split
over the model axis) compiled, not run, for a TPU v6e and an H100 at real serving shapes in
bfloat16 (and with int8 pages): a 2,048-token step of up to 256 sequences over 4,096-token
contexts, Qwen3-8B and Llama-3-70B-per-device head layouts. Interpret-free: these are compiles."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxserve.planning.targets import parse_target
from kernels_pallas.ragged_paged_attention_tiled import ragged_paged_attention_tiled

# (q heads, kv heads, head_dim, page_size)
SHAPES = {"qwen3-8b": (32, 8, 128, 16), "llama3-70b-tp8": (8, 1, 128, 128)}
TOKENS, MAX_SEQS, CONTEXT, NUM_PAGES = 2048, 256, 4096, 4096


def _compiled_text(device, shape: str, page_dtype) -> str:
    hq, kvh, d, ps = SHAPES[shape]
    rep = NamedSharding(Mesh(np.array([device]), ("x",)), PartitionSpec())

    def spec(s, dt):
        return jax.ShapeDtypeStruct(s, dt, sharding=rep)

    pages = (NUM_PAGES, ps, kvh, d)
    args = [spec((TOKENS, hq, d), jnp.bfloat16), spec(pages, page_dtype), spec(pages, page_dtype),
            spec((MAX_SEQS,), jnp.int32), spec((MAX_SEQS + 1,), jnp.int32),
            spec((MAX_SEQS, CONTEXT // ps), jnp.int32), spec((1,), jnp.int32)]
    kw = {}
    if page_dtype == jnp.int8:
        kw = dict(k_scales=spec((NUM_PAGES, kvh, ps), jnp.float32), v_scales=spec((NUM_PAGES, kvh, ps), jnp.float32))
    fn = jax.jit(lambda *a, **k: ragged_paged_attention_tiled(*a, sm_scale=d ** -0.5, **k))
    compiled = fn.lower(*args, **kw).compile()
    assert compiled.memory_analysis() is not None
    return compiled.as_text()


def _check(text: str) -> None:
    assert "sort" in text  # decode rows ordered by context
    # decode blocks + their KV loops, and three prefill tile heights each with its KV loop
    assert text.count(" while(") >= 8, text.count(" while(")


# two of the four combinations in the suite (each compile takes ~10 s here); all four for the H100
@pytest.mark.parametrize("shape,page_dtype", [("qwen3-8b", jnp.bfloat16), ("llama3-70b-tp8", jnp.int8)],
                         ids=["qwen3-8b-bf16", "llama3-70b-tp8-int8"])
def test_tiled_attention_compiles_for_tpu_v6e(shape, page_dtype):
    _check(_compiled_text(parse_target("tpu-v6e:1x1").devices()[0], shape, page_dtype))


@pytest.mark.gpu_compile
@pytest.mark.parametrize("page_dtype", [jnp.bfloat16, jnp.int8], ids=["bf16", "int8"])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_tiled_attention_compiles_for_h100(shape, page_dtype):
    from jaxserve.planning.gpu_target import gpu_devices

    _check(_compiled_text(gpu_devices("h100", "1x1x1")[0], shape, page_dtype))
