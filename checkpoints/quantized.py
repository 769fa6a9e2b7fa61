"""Pre-quantized Hugging Face checkpoints: a Linear's packed tensors -> our quantized leaf.

Every format is unpacked on the host into the same three arrays in the input-features-first
layout the weights use: values [I, O] (the storage type), scale [I / tile_i, O / tile_o] and, for
asymmetric formats, zero points of the scale's shape. `assemble` then reshapes them into the
declared `QArray` (heads as their own axes), so the device receives packed values only.

Formats (what the writers of each format put in a checkpoint, per their published layouts):
- fp8 (`quant_method: fp8`, DeepSeek / Qwen3-FP8): `weight` float8_e4m3fn [O, I] and
  `weight_scale_inv` [O / 128, I / 128]; value = weight * weight_scale_inv (block-wise).
- AWQ GEMM: `qweight` int32 [I, O / 8], 8 nibbles per word in the order 0, 2, 4, 6, 1, 3, 5, 7;
  `qzeros` int32 [I / g, O / 8] packed the same way; `scales` [I / g, O]; value = (q - z) * s.
- GPTQ: `qweight` int32 [I * bits / 32, O] packed along the inputs, lowest bits first; `qzeros`
  int32 [I / g, O * bits / 32] packed along the outputs; `scales` [I / g, O]; `g_idx` [I].
  Version 1 checkpoints (`checkpoint_format: gptq`) store zero - 1; version 2 the zero itself.
- compressed-tensors: `pack-quantized` `weight_packed` int32 [O, I * bits / 32] (signed values
  offset by 2^(bits-1), lowest bits first), `weight_scale` [O, I / g] or [O, 1], `weight_shape`,
  and for asymmetric weights `weight_zero_point` int32 [O * bits / 32, I / g] packed along the
  outputs the same way; value = (q - zero) * scale. `int-quantized` / `float-quantized` `weight`
  int8 (4- or 8-bit values) / float8 [O, I] with `weight_scale` [O, 1] (channel), [1] (tensor) or
  [O / bo, I / bi] (block).
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import ml_dtypes
import numpy as np

from jaxserve.quant.scheme import WeightQuant

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds column AWQ_ORDER[i] of its 8


def unpack_int32(packed: np.ndarray, bits: int, axis: int, order: tuple[int, ...] | None = None) -> np.ndarray:
    """int32 words holding 32 / bits unsigned values each (lowest bits first) -> uint8 values,
    the packed axis grown by 32 / bits. `order[i]`: which of a word's values sits in field i."""
    per = 32 // bits
    words = np.moveaxis(np.asarray(packed).view(np.uint32), axis, -1)
    fields = np.stack([(words >> (bits * i)) & ((1 << bits) - 1) for i in range(per)], axis=-1)
    if order is not None:
        out = np.empty_like(fields)
        out[..., list(order)] = fields
        fields = out
    values = fields.reshape(*words.shape[:-1], words.shape[-1] * per).astype(np.uint8)
    return np.moveaxis(values, -1, axis)


def _tiles(n: int, tiles: int, what: str) -> None:
    if tiles <= 0 or n % tiles:
        raise ValueError(f"{what}: {n} features do not split into {tiles} scale groups")


def _fp8(parts: dict[str, np.ndarray], q: WeightQuant, name: str) -> tuple[Any, Any, Any]:
    w, s = parts["weight"], parts["weight_scale_inv"]
    o, i = w.shape
    bi, bo = q.block
    if (o % bo and o > bo) or (i % bi and i > bi):  # an axis shorter than a block is one (partial) block
        raise ValueError(f"{name}: fp8 weight [{o}, {i}] is not a whole number of {bo}x{bi} blocks")
    if s.shape != (-(-o // bo), -(-i // bi)):
        raise ValueError(f"{name}.weight_scale_inv has shape {s.shape}, expected {(-(-o // bo), -(-i // bi))}")
    return w.T, s.T, None


def _zero_point_parts(values: np.ndarray, zeros: np.ndarray, parts: dict[str, np.ndarray], fmt: str,
                      name: str) -> tuple[Any, Any, Any]:
    """AWQ / GPTQ: unpacked values [I, O] and zeros [I / g, O] checked against `scales` [I / g, O]."""
    scales = parts["scales"]
    if zeros.shape != scales.shape or values.shape[1] != scales.shape[1]:
        raise ValueError(f"{name}: {fmt} qweight {parts['qweight'].shape}, qzeros {parts['qzeros'].shape} and "
                         f"scales {scales.shape} do not agree")
    _tiles(values.shape[0], scales.shape[0], name)
    return values, scales, zeros


def _awq(parts: dict[str, np.ndarray], q: WeightQuant, name: str) -> tuple[Any, Any, Any]:
    values = unpack_int32(parts["qweight"], 4, axis=1, order=AWQ_ORDER)           # [I, O]
    zeros = unpack_int32(parts["qzeros"], 4, axis=1, order=AWQ_ORDER)             # [I / g, O]
    return _zero_point_parts(values.astype(ml_dtypes.uint4), zeros, parts, "AWQ", name)


def _gptq(parts: dict[str, np.ndarray], q: WeightQuant, name: str) -> tuple[Any, Any, Any]:
    bits = q.bits
    values = unpack_int32(parts["qweight"], bits, axis=0)                          # [I, O]
    zeros = unpack_int32(parts["qzeros"], bits, axis=1).astype(np.float32)        # [I / g, O]
    if q.checkpoint_format == "gptq":  # v1 stores zero - 1
        zeros = zeros + 1
    return _zero_point_parts(values.astype(q.dtype), zeros[:, : parts["scales"].shape[1]], parts, "GPTQ", name)


def _ct_signed(unsigned: np.ndarray, bits: int) -> np.ndarray:
    """compressed-tensors packs signed values offset by 2^(bits-1)."""
    return unsigned.astype(np.int16) - (1 << (bits - 1))


def _ct_scale(scale: np.ndarray, q: WeightQuant, o: int, i: int, name: str) -> np.ndarray:
    """weight_scale [O, I / g], [O, 1], [1] or, block-wise, [O / bo, I / bi] -> [I / tile, O / tile]."""
    scale = np.asarray(scale)
    if q.per_tensor:
        return scale.reshape(1, 1)
    if q.block:
        bi, bo = q.block
        if o % bo or i % bi or scale.shape != (o // bo, i // bi):
            raise ValueError(f"{name}.weight_scale has shape {scale.shape}; a [{o}, {i}] weight in {bo}x{bi} "
                             f"blocks needs {(-(-o // bo), -(-i // bi))}")
        return scale.T
    scale = scale.reshape(o, -1)
    _tiles(i, scale.shape[1], name)
    return scale.T


def _ct_packed(parts: dict[str, np.ndarray], q: WeightQuant, name: str) -> tuple[Any, Any, Any]:
    bits = q.bits
    o, i = (int(x) for x in np.asarray(parts["weight_shape"]).reshape(-1))
    values = _ct_signed(unpack_int32(parts["weight_packed"], bits, axis=1)[:, :i], bits).astype(q.dtype)  # [O, I]
    scale = _ct_scale(parts["weight_scale"], q, o, i, name)
    zero = None
    if q.zero_point:  # asymmetric: zero points [O, I / g] packed along the outputs
        zero = _ct_signed(unpack_int32(parts["weight_zero_point"], bits, axis=0)[:o], bits).T
        if zero.shape != scale.shape:
            raise ValueError(f"{name}.weight_zero_point unpacks to {zero.shape[::-1]}, expected {scale.shape[::-1]}")
    return values.T, scale, zero


def _ct_plain(parts: dict[str, np.ndarray], q: WeightQuant, name: str) -> tuple[Any, Any, Any]:
    w = parts["weight"]
    o, i = w.shape
    return w.astype(q.dtype).T, _ct_scale(parts["weight_scale"], q, o, i, name), None


# checkpoint_format -> (tensor parts that make one Linear, parts read and ignored, unpacker)
Unpack = Callable[[dict[str, np.ndarray], WeightQuant, str], tuple[Any, Any, Any]]
FORMATS: dict[str, tuple[tuple[str, ...], tuple[str, ...], Unpack]] = {
    "fp8": (("weight", "weight_scale_inv"), ("input_scale", "activation_scale"), _fp8),
    "awq": (("qweight", "qzeros", "scales"), (), _awq),
    "gptq": (("qweight", "qzeros", "scales"), ("g_idx",), _gptq),
    "gptq_v2": (("qweight", "qzeros", "scales"), ("g_idx",), _gptq),
    "pack-quantized": (("weight_packed", "weight_scale", "weight_shape"), ("input_scale",), _ct_packed),
    "int-quantized": (("weight", "weight_scale"), ("input_scale", "input_zero_point"), _ct_plain),
    "float-quantized": (("weight", "weight_scale"), ("input_scale",), _ct_plain),
}


def quantized_marker_part(q: WeightQuant) -> str:
    """A tensor part only a quantized Linear has (scales, or the packed shape): tells whether lm_head is quantized."""
    return FORMATS[q.checkpoint_format][0][-1]


def parts_of(q: WeightQuant) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(the tensor parts that make one Linear, parts read and ignored)."""
    needed, ignored, _ = FORMATS[q.checkpoint_format]
    if q.act_order:  # g_idx then says where each input row goes
        return needed + ("g_idx",), tuple(p for p in ignored if p != "g_idx")
    if q.zero_point and q.checkpoint_format == "pack-quantized":
        return needed + ("weight_zero_point",), ignored
    return needed, ignored


def check_g_idx(g_idx: np.ndarray, in_features: int, group_size: int | None, name: str) -> None:
    """Without activation order, g_idx must be the trivial i // group_size."""
    expected = np.arange(in_features) // (group_size or in_features)
    if g_idx.shape != expected.shape or not np.array_equal(g_idx, expected):
        raise ValueError(f"{name}.g_idx is not i // group_size although desc_act is false")


def group_order(g_idx: np.ndarray, in_features: int, groups: int, name: str) -> np.ndarray:
    """The row order that makes every group contiguous (stable within a group); each group must have
    in_features / groups rows."""
    g_idx = np.asarray(g_idx).reshape(-1)
    if g_idx.shape != (in_features,):
        raise ValueError(f"{name}.g_idx has shape {g_idx.shape}, expected ({in_features},)")
    perm = np.argsort(g_idx, kind="stable")
    if not np.array_equal(g_idx[perm], np.arange(in_features) // (in_features // groups)):
        raise ValueError(f"{name}.g_idx does not give every one of its {groups} groups "
                         f"{in_features // groups} input rows")
    return perm.astype(np.int32)


def assemble(parts: dict[str, np.ndarray], q: WeightQuant, spec: Any, name: str, pad_out: int = 0) -> Any:
    """A Linear's tensors -> the declared leaf's host arrays (values, scale, zero point; and the
    input permutation under activation order).

    spec: the declared leaf (QArray, or InputPermuted around one, of ParamSpecs); pad_out: output
    columns to add (the padded vocabulary)."""
    values, scale, zero = FORMATS[q.checkpoint_format][2](parts, q, name)
    perm = group_order(parts["g_idx"], values.shape[0], scale.shape[0], name) if q.act_order else None
    if perm is not None:
        values = values[perm]
    qspec = spec.weight if q.act_order else spec
    if pad_out:
        tile_o = values.shape[1] // scale.shape[1]
        values = np.pad(values.astype(np.float32), ((0, 0), (0, pad_out))).astype(values.dtype)
        grow = -(-(values.shape[1]) // tile_o) - scale.shape[1]
        scale = np.pad(np.asarray(scale, np.float32), ((0, 0), (0, grow)), constant_values=1.0)
        zero = None if zero is None else np.pad(zero, ((0, 0), (0, grow)))
    if values.size != np.prod(qspec.qvalue.shape) or scale.size != np.prod(qspec.scale.shape):
        raise ValueError(f"{name}: unpacked to values {values.shape} and scales {scale.shape}, expected "
                         f"{qspec.qvalue.shape} and {qspec.scale.shape} from config.json")
    out_dtype = np.dtype(qspec.scale.dtype)
    leaf = qspec.replace(
        qvalue=np.ascontiguousarray(values).reshape(qspec.qvalue.shape),
        scale=np.asarray(scale, np.float32).reshape(qspec.scale.shape).astype(out_dtype),
        zero_point=None if zero is None else np.asarray(zero, np.float32).reshape(qspec.scale.shape).astype(out_dtype))
    return spec.replace(weight=leaf, perm=perm) if q.act_order else leaf


def dequantize_fp8_blocks(weight: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int], name: str) -> np.ndarray:
    """An fp8 Linear [O, I] and its weight_scale_inv [ceil(O / bo), ceil(I / bi)] -> float32 [O, I]; the
    last block of an axis may be partial (DeepSeek-V3's kv_a_proj_with_mqa: 576 rows in 5 blocks of 128)."""
    bi, bo = block
    o, i = weight.shape
    if scale_inv.shape != (-(-o // bo), -(-i // bi)):
        raise ValueError(f"{name}.weight_scale_inv has shape {scale_inv.shape}, expected {(-(-o // bo), -(-i // bi))} "
                         f"for a [{o}, {i}] weight in {bo}x{bi} blocks")
    full = np.repeat(np.repeat(np.asarray(scale_inv, np.float32), bo, axis=0), bi, axis=1)[:o, :i]
    return weight.astype(np.float32) * full


def widened(tensors: Iterator[tuple[str, Callable[[], np.ndarray]]], prefixes: set[str], q: WeightQuant
            ) -> Iterator[tuple[str, Callable[[], np.ndarray]]]:
    """(name, read) per tensor, the fp8-block Linears in `prefixes` given as one `<prefix>.weight` each,
    dequantized to float32 when read: modules whose leaves stay in the compute dtype because the
    checkpoint's blocks do not tile their layout (weights.abstract: DeepSeek's q_b_proj and
    kv_a_proj_with_mqa), that are split at load (kv_b_proj), or that a head holds plain (the MTP layer).
    A Linear's two tensors may come in either order, and from different files."""
    held: dict[str, dict[str, Callable[[], np.ndarray]]] = {}
    for name, read in tensors:
        prefix, _, part = name.rpartition(".")
        if prefix not in prefixes or part not in ("weight", "weight_scale_inv"):
            yield name, read
            continue
        parts = held.setdefault(prefix, {})
        parts[part] = read
        if len(parts) == 2:
            del held[prefix]
            yield f"{prefix}.weight", lambda p=parts, n=prefix: dequantize_fp8_blocks(
                p["weight"](), p["weight_scale_inv"](), q.block, n)
    for prefix, parts in held.items():
        raise ValueError(f"fp8 Linear {prefix!r} has only its {', '.join(parts)}")


def scaled_modules(names: Callable[[], Iterator[str]], q: WeightQuant | None) -> set[str]:
    """The module prefixes an fp8-block checkpoint stores with block scales, from its tensor names
    (`names`: called only for such a checkpoint, as it reads the files' headers); none for other formats."""
    if q is None or q.checkpoint_format != "fp8":
        return set()
    suffix = ".weight_scale_inv"
    return {n[: -len(suffix)] for n in names() if n.endswith(suffix)}
