"""Quantize and dequantize on the host (numpy), one tensor at a time, while a checkpoint loads.

Weights are quantized before they are placed, so a device never holds the full-precision tensor.
`quantize` also runs on the device (xp=jax.numpy) for random weights drawn there
(checkpoints/random_init.py): one rule for both.
A scale covers a tile of the values (`tile = values.shape // scale.shape` per axis); symmetric
absmax: scale = max|w| over the tile / the type's largest value (int8 127, int4 7, fp8 e4m3 448),
q = round-to-nearest-even(w / scale), clipped to the type's range.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np


def _tiled(a: np.ndarray, scale_shape: tuple[int, ...]) -> np.ndarray:
    """[..., n_i, ...] -> [..., s_i, n_i / s_i, ...]: each axis split into (tiles, within a tile)."""
    shape = []
    for n, s in zip(a.shape, scale_shape):
        shape += [s, n // s]
    return a.reshape(shape)


def _tile_axes(ndim: int) -> tuple[int, ...]:
    return tuple(range(1, 2 * ndim, 2))


def broadcast_scale(s: np.ndarray, shape: tuple[int, ...], xp: Any = np) -> np.ndarray:
    """A per-tile array expanded to the values' shape (xp: numpy, or jax.numpy inside a jit)."""
    for axis, n in enumerate(shape):
        s = xp.repeat(s, n // s.shape[axis], axis=axis)
    return s


def qmax(dtype: Any) -> float:
    dtype = np.dtype(dtype)
    if np.issubdtype(dtype, np.integer) or dtype in (np.dtype(ml_dtypes.int4), np.dtype(ml_dtypes.uint4)):
        return float(ml_dtypes.iinfo(dtype).max)
    return float(ml_dtypes.finfo(dtype).max)


def quantize(w: np.ndarray, qdtype: Any, scale_shape: tuple[int, ...], xp: Any = np) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric absmax quantization of w with one scale per tile -> (values [w.shape], scale [scale_shape]) float32.
    xp: numpy (the host), or jax.numpy inside a jit (the device)."""
    w = xp.asarray(w, np.float32)
    if any(n % s for n, s in zip(w.shape, scale_shape)) or len(scale_shape) != w.ndim:
        raise ValueError(f"scale shape {scale_shape} does not tile weight shape {w.shape}")
    top = qmax(qdtype)
    absmax = xp.abs(_tiled(w, scale_shape)).max(axis=_tile_axes(w.ndim))
    scale = xp.where(absmax > 0, absmax / top, 1.0).astype(np.float32)
    scaled = w / broadcast_scale(scale, w.shape, xp)
    qdtype = np.dtype(qdtype)
    if np.issubdtype(qdtype, np.integer) or qdtype == np.dtype(ml_dtypes.int4):
        scaled = xp.clip(xp.rint(scaled), -top, top)
    else:
        scaled = xp.clip(scaled, -top, top)
    return scaled.astype(qdtype), scale


def dequantize(values: np.ndarray, scale: np.ndarray, zero_point: np.ndarray | None = None) -> np.ndarray:
    """(values - zero_point) * scale, each per-tile array broadcast over its tile; float32."""
    v = np.asarray(values).astype(np.float32)
    if zero_point is not None:
        v = v - broadcast_scale(np.asarray(zero_point).astype(np.float32), v.shape)
    return v * broadcast_scale(np.asarray(scale, np.float32), v.shape)
