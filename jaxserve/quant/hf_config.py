"""`config.json`'s `quantization_config` -> a `WeightQuant`, for the pre-quantized formats we load.

Read from the JSON directly (the `compressed-tensors` package needs torch). Anything we cannot
load faithfully is an error that names the field and its value; nothing falls back silently.
"""

from __future__ import annotations

from typing import Any

from jaxserve.quant.scheme import WeightQuant

# Modules a format may leave unquantized without changing what we declare.
_HARMLESS_EXCEPTIONS = {"lm_head", "re:.*lm_head", "model.embed_tokens", "embed_tokens"}


def _fail(what: str) -> ValueError:
    return ValueError(f"config.json quantization_config: {what}")


def _check_exceptions(qc: dict[str, Any], key: str) -> None:
    """Only lm_head (and the embedding) may be left out: the projections are declared uniformly.
    Whether lm_head is quantized is read from the checkpoint's tensor names at load."""
    other = [m for m in (qc.get(key) or []) if m not in _HARMLESS_EXCEPTIONS]
    if other:
        raise _fail(f"'{key}' lists {other}: per-module exceptions other than lm_head are not supported")


def _fp8(qc: dict[str, Any]) -> WeightQuant:
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise _fail(f"fp8 'fmt' {fmt!r} is not supported (only e4m3)")
    block = qc.get("weight_block_size")
    if block is None:
        raise _fail("fp8 without 'weight_block_size' (per-tensor scales) is not supported; block-wise "
                    "checkpoints (weight_block_size [128, 128]) are")
    if len(block) != 2:
        raise _fail(f"fp8 'weight_block_size' {block!r} must be [rows, columns]")
    out_block, in_block = (int(b) for b in block)  # torch Linear [out, in]
    # modules_to_not_convert usually lists lm_head; the embedding is never a Linear.
    _check_exceptions(qc, "modules_to_not_convert")
    return WeightQuant("fp8-block", "float8_e4m3fn", block=(in_block, out_block), checkpoint_format="fp8")


def _awq(qc: dict[str, Any]) -> WeightQuant:
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise _fail(f"AWQ 'version' {version!r} is not supported (only gemm)")
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise _fail(f"AWQ 'bits' {bits!r} is not supported (only 4)")
    group = qc.get("group_size", qc.get("q_group_size"))
    if not isinstance(group, int) or group <= 0:
        raise _fail(f"AWQ 'group_size' {group!r} is not supported (a positive group size, e.g. 128)")
    if not qc.get("zero_point", True):
        raise _fail("AWQ with 'zero_point': false is not supported")
    _check_exceptions(qc, "modules_to_not_convert")
    return WeightQuant("awq", "uint4", group_size=group, zero_point=True, checkpoint_format="awq")


def _gptq(qc: dict[str, Any]) -> WeightQuant:
    bits = qc.get("bits")
    if bits not in (4, 8):
        raise _fail(f"GPTQ 'bits' {bits!r} is not supported (4 or 8)")
    group = qc.get("group_size", 128)
    if not isinstance(group, int) or (group <= 0 and group != -1):
        raise _fail(f"GPTQ 'group_size' {group!r} is not supported (a positive size, or -1 for one group)")
    fmt = str(qc.get("checkpoint_format", "gptq")).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise _fail(f"GPTQ 'checkpoint_format' {fmt!r} is not supported (gptq or gptq_v2)")
    return WeightQuant("gptq", "uint4" if bits == 4 else "uint8", group_size=None if group == -1 else group,
                       zero_point=True, checkpoint_format=fmt, act_order=bool(qc.get("desc_act")))


def _compressed_tensors(qc: dict[str, Any]) -> WeightQuant:
    fmt = qc.get("format")
    groups = qc.get("config_groups") or {}
    if len(groups) != 1:
        raise _fail(f"compressed-tensors with {len(groups)} config_groups is not supported (exactly one)")
    group = next(iter(groups.values()))
    targets = group.get("targets") or []
    if targets != ["Linear"]:
        raise _fail(f"compressed-tensors 'targets' {targets!r} is not supported (['Linear'])")
    w = group.get("weights") or {}
    bits, kind, strategy = w.get("num_bits"), w.get("type", "int"), w.get("strategy")
    if w.get("actorder"):
        raise _fail(f"compressed-tensors 'actorder' {w['actorder']!r} is not supported yet")
    if w.get("dynamic"):
        raise _fail("compressed-tensors dynamic weight quantization is not a stored format")
    asymmetric = not w.get("symmetric", True)
    if asymmetric and fmt != "pack-quantized":
        raise _fail(f"compressed-tensors asymmetric weights are supported in pack-quantized only, not {fmt!r}")
    _check_exceptions(qc, "ignore")
    if strategy not in ("channel", "group", "tensor", "block"):
        raise _fail(f"compressed-tensors weight 'strategy' {strategy!r} is not supported (channel, group, tensor, "
                    "block)")
    if strategy == "group" and not isinstance(w.get("group_size"), int):
        raise _fail(f"compressed-tensors 'group_size' {w.get('group_size')!r} is not a positive integer")
    block = w.get("block_structure") if strategy == "block" else None
    if strategy == "block" and (not isinstance(block, list) or len(block) != 2):
        raise _fail(f"compressed-tensors 'block_structure' {block!r} is not [output rows, input columns]")
    # block_structure is [output, input]; WeightQuant.block is (contraction, output)
    per = dict(group_size=w.get("group_size") if strategy == "group" else None, per_tensor=strategy == "tensor",
               block=(int(block[1]), int(block[0])) if block else None, zero_point=asymmetric)
    if fmt == "pack-quantized" and kind == "int" and bits in (4, 8) and not block:
        return WeightQuant("compressed-tensors", "int4" if bits == 4 else "int8", checkpoint_format=fmt, **per)
    if fmt in ("int-quantized", "naive-quantized") and kind == "int" and bits in (4, 8):
        # 4-bit values stored one per int8 (what compressed-tensors writes when activations are quantized too)
        return WeightQuant("compressed-tensors", "int4" if bits == 4 else "int8", checkpoint_format="int-quantized",
                           **per)
    if fmt in ("float-quantized", "naive-quantized") and kind == "float" and bits == 8:
        return WeightQuant("compressed-tensors", "float8_e4m3fn", checkpoint_format="float-quantized", **per)
    raise _fail(f"compressed-tensors format {fmt!r} with {kind} {bits}-bit {strategy} weights is not supported "
                "(pack-quantized int4/int8, int-quantized int4/int8, float-quantized fp8)")


_METHODS = {"fp8": _fp8, "awq": _awq, "gptq": _gptq, "compressed-tensors": _compressed_tensors}


def scheme_from_hf(qc: dict[str, Any]) -> WeightQuant:
    if not isinstance(qc, dict):
        raise _fail(f"must be an object, got {type(qc).__name__}")
    method = qc.get("quant_method")
    if method not in _METHODS:
        raise _fail(f"'quant_method' {method!r} is not supported; supported: {', '.join(_METHODS)}")
    return _METHODS[method](qc)
