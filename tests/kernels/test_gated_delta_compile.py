"""The Gated DeltaNet reference (kernels_pallas/gated_delta_reference.py: jnp, no Pallas) compiles
for a v6e and an H100 at Qwen3-Next's linear-attention shapes in bf16 (16 key heads, 32 value heads,
head dims 128): a prefill of 2048 tokens in the chunked form and a ragged step of 64 decode rows
beside a 448-token prefill. Compiled from shapes alone, on devices this machine does not have."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from kernels_pallas import gated_delta_reference as gd
from jaxserve.planning.targets import parse_target

HK, HV, D = 16, 32, 128


def _args(t: int):
    bf = jnp.bfloat16
    return (jax.ShapeDtypeStruct((t, HK, D), bf), jax.ShapeDtypeStruct((t, HK, D), bf),
            jax.ShapeDtypeStruct((t, HV, D), bf), jax.ShapeDtypeStruct((t, HV), jnp.float32),
            jax.ShapeDtypeStruct((t, HV), jnp.float32))



@pytest.mark.parametrize("target", ["v6e", "h100"])
def test_gated_delta_reference_compiles_for_a_v6e_and_an_h100_in_bf16(target):
    if target == "v6e":
        device = parse_target("tpu-v6e:1x1").devices()[0]
    else:
        from jaxserve.planning.gpu_target import gpu_devices
        device = gpu_devices("h100", "1x1x1")[0]
    sharding = jax.sharding.SingleDeviceSharding(device)
    place = lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding)  # noqa: E731
    state = place(jax.ShapeDtypeStruct((HV, D, D), jnp.float32))
    prefill = jax.jit(gd.gated_delta_chunked).lower(*map(place, _args(2048)), state).compile()
    assert prefill.as_text()
    s = 65
    states = place(jax.ShapeDtypeStruct((s, HV, D, D), jnp.float32))
    lens = place(jax.ShapeDtypeStruct((s,), jnp.int32))
    ragged = jax.jit(gd.ragged_gated_delta).lower(*map(place, _args(512)), states, lens, lens).compile()
    assert ragged.as_text()
