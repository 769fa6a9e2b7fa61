"""MXFP4 expert weights as gpt-oss publishes them, kept packed and dequantized in the step.

A stacked expert projection [E, out, in] is stored as `blocks` [E, out, in / 32, 16] uint8 (two
FP4 E2M1 values per byte, the low nibble first) and `scales` [E, out, in / 32] uint8 (one E8M0
power of two per 32 values, biased by 127). The engine holds those bytes (4.25 bits per weight;
the expert width zero-padded to a multiple of 256, so tensor parallelism splits whole groups) and
turns a layer's experts into the compute dtype inside the step, input features first ([E, in, out],
the layout the grouped matmul reads).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

BLOCK = 32  # values per scale
SCALE_BIAS = 127
# random weights (--load-format dummy, tests): ParamSpec.init -> [low, high) of its bytes: any FP4
# codes, E8M0 scales near 2**-4
RANDOM_BYTES = {"bytes": (0, 256), "scale_bytes": (SCALE_BIAS - 6, SCALE_BIAS - 2)}
# Expert widths are held padded to a multiple of this (zero codes: exact), so the packed groups of
# the down projection split evenly over a tensor-parallel axis of up to 8 (gpt-oss: 2880 -> 3072)
WIDTH_MULTIPLE = BLOCK * 8


def padded_width(width: int) -> int:
    return -(-width // WIDTH_MULTIPLE) * WIDTH_MULTIPLE


@struct.dataclass
class Mxfp4:
    """One stacked expert projection, packed: blocks [E, out, in / 32, 16] uint8, scales [E, out, in / 32] uint8."""
    blocks: Any
    scales: Any


def is_mxfp4(leaf: Any) -> bool:
    return isinstance(leaf, Mxfp4)


def _fp4_as_bfloat16(codes: jax.Array) -> jax.Array:
    """FP4 E2M1 codes (uint16, 0-15: sign bit 3, exponent bits 2-1, mantissa bit 0) -> their values
    as bfloat16, built bit by bit: elementwise integer work that fuses with the matmul's operand,
    where a 16-entry table lookup is a gather of every weight (which XLA:TPU offloads to the
    SparseCore: a 17.7 GiB transient for gpt-oss-20b, and a libtpu codegen crash)."""
    magnitude = codes & 7                       # exponent e and mantissa m as one 3-bit field
    # e > 0: 2**(e-1) x (1 + m/2): bfloat16 exponent e + 126 and top mantissa bit m, i.e. bits
    # (magnitude + 252) << 6; code 1 is 0.5 (bits 252 << 6); code 0 is zero
    bits = jnp.where(magnitude >= 2, magnitude + 252, jnp.where(magnitude == 1, 252, 0)) << 6
    bits = bits | ((codes & 8) << 12)          # the sign bit, to bit 15
    return jax.lax.bitcast_convert_type(bits.astype(jnp.uint16), jnp.bfloat16)


def dequantize(w: Mxfp4, dtype: Any) -> jax.Array:
    """[E, out, in / 32, 16] packed -> [E, in, out] in `dtype`, computed in it: an FP4 value times a
    power of two is exact in bfloat16 (2 mantissa bits of 7, float32's exponent range), so no
    float32 copy of the experts is made."""
    blocks = w.blocks.astype(jnp.uint16)
    codes = jnp.stack([blocks & 0x0F, blocks >> 4], axis=-1)                           # [E, out, G, 16, 2]
    values = _fp4_as_bfloat16(codes).astype(dtype).reshape(*w.blocks.shape[:-1], -1)   # [E, out, G, 32]
    scale = jnp.ldexp(jnp.float32(1), w.scales.astype(jnp.int32) - SCALE_BIAS).astype(dtype)  # [E, out, G]
    full = (values * scale[..., None]).reshape(*w.blocks.shape[:2], -1)                # [E, out, in]
    return jnp.swapaxes(full, 1, 2)


def as_dense(w: Any, dtype: Any) -> Any:
    """An expert stack in `dtype`, whether it is packed (Mxfp4) or already dense."""
    return dequantize(w, dtype) if is_mxfp4(w) else w
