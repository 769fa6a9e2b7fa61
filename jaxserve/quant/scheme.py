"""How a model's weights are quantized: one frozen, hashable description shared by every path.

A `WeightQuant` lives on `ModelConfig.quantization` (a jit-static argument), so `weights.abstract`
declares quantized leaves from it and everything derived from the declaration (shardings, random
init, the HF loader's checks, orbax restore, the planner's bytes) follows without a second switch.

Online schemes (`--quantization`) are weight-only: activations stay in the compute dtype and the
weights are dequantized inside the jitted step (XLA fuses the convert and scale into the matmul's
operand where it can).
"""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np

# Storage dtype names -> numpy/ml_dtypes dtypes (jax arrays accept the same objects).
QTYPES = {
    "int8": np.dtype(np.int8),
    "int4": np.dtype(ml_dtypes.int4),
    "uint4": np.dtype(ml_dtypes.uint4),
    "uint8": np.dtype(np.uint8),
    "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn),
    "float8_e5m2": np.dtype(ml_dtypes.float8_e5m2),
}


@dataclasses.dataclass(frozen=True)
class WeightQuant:
    """method: the name users and logs see ("int8", "int4", "fp8", or a checkpoint format: "fp8-block",
    "awq", "gptq", "compressed-tensors"). qtype: a key of QTYPES. group_size: elements of the
    contraction axis that share one scale (None: one scale per output channel). block: for
    block-wise formats, the (contraction, output) block that shares a scale. per_tensor: one scale
    per projection. zero_point: asymmetric (value = (q - zero) * scale; zero points are stored in
    the scale's dtype, which also holds GPTQ v1's off-by-one 16). lm_head: the untied output
    projection is quantized too. checkpoint_format: how a pre-quantized checkpoint packs its
    tensors (checkpoints/quantized.py); None for online schemes. act_order: GPTQ's desc_act, the
    rows sorted by group at load and the activations gathered to match (quant/act_order.py)."""

    method: str
    qtype: str
    group_size: int | None = None
    block: tuple[int, int] | None = None
    per_tensor: bool = False
    zero_point: bool = False
    lm_head: bool = False
    checkpoint_format: str | None = None
    act_order: bool = False  # input rows stored in group order with a permutation (GPTQ desc_act)

    def __post_init__(self) -> None:
        if self.qtype not in QTYPES:
            raise ValueError(f"unsupported quantized storage type {self.qtype!r}; known: {', '.join(QTYPES)}")

    @property
    def dtype(self) -> np.dtype:
        return QTYPES[self.qtype]

    @property
    def bits(self) -> int:
        return qtype_bits(self.dtype)

    def describe(self) -> str:
        how = (f"groups of {self.group_size}" if self.group_size else
               f"{self.block[0]}x{self.block[1]} blocks" if self.block else
               "one scale per tensor" if self.per_tensor else "per output channel")
        extras = (", zero points" if self.zero_point else "") + (", activation order" if self.act_order else "")
        return f"{self.method} ({self.qtype} weights, {how}{extras})"


ONLINE = {
    "int8": WeightQuant("int8", "int8"),
    "int4": WeightQuant("int4", "int4", group_size=128),
    "fp8": WeightQuant("fp8", "float8_e4m3fn"),
}


def online_scheme(name: str) -> WeightQuant:
    """`--quantization NAME` -> its scheme; an unknown name is an error that lists the known ones."""
    try:
        return ONLINE[name]
    except KeyError:
        raise ValueError(f"unknown --quantization {name!r}; choose one of {', '.join(ONLINE)}") from None


def qtype_bits(dtype: np.dtype) -> int:
    """Bits per element of a storage dtype (int4 is 4 even where numpy stores it in a byte)."""
    dtype = np.dtype(dtype)
    for info in (ml_dtypes.iinfo, ml_dtypes.finfo):
        try:
            return int(info(dtype).bits)
        except ValueError:
            pass
    return dtype.itemsize * 8
