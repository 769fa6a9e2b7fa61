"""Packing step inputs into one buffer round-trips every leaf exactly, inside and outside jit."""

from __future__ import annotations

from typing import NamedTuple

import jax
import numpy as np
import pytest

from jaxserve.runner.packing import pack, unpack


class Tree(NamedTuple):
    ids: np.ndarray
    temps: np.ndarray
    seeds: np.ndarray
    flags: np.ndarray
    empty: np.ndarray


def test_round_trip_is_bit_exact_under_jit():
    rng = np.random.default_rng(0)
    tree = Tree(rng.integers(-5, 5, (3, 4)).astype(np.int32), np.array([0.0, -0.0, np.inf, 1e-30], np.float32),
                np.array([[0, 2**32 - 1]], np.uint32), np.array([True, False, True]), np.zeros((2, 0), np.int32))
    buf, spec = pack(tree)
    assert buf.dtype == np.int32 and buf.size == 12 + 4 + 2 + 3
    out = jax.jit(unpack, static_argnums=1)(buf, spec)
    for a, b in zip(tree, out):
        b = np.asarray(b)
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a.view(np.uint8) if a.dtype != np.bool_ else a,
                                      b.view(np.uint8) if b.dtype != np.bool_ else b)
    assert hash(spec) == hash(pack(tree)[1])  # a usable static argument


def test_rejects_other_dtypes():
    with pytest.raises(ValueError, match="cannot pack dtype int64"):
        pack([np.zeros(2, np.int64)])


def test_leaves_sharing_their_rows_pack_as_columns_of_a_2d_buffer():
    rng = np.random.default_rng(1)
    tree = Tree(rng.integers(0, 9, (4, 3)).astype(np.int32), rng.standard_normal(4).astype(np.float32),
                np.arange(8, dtype=np.uint32).reshape(4, 2), np.array([True, False, False, True]),
                np.zeros((4, 0), np.int32))
    buf, spec = pack(tree)
    assert buf.shape == (4, 3 + 1 + 2 + 1 + 0)
    np.testing.assert_array_equal(buf[:, :3], tree.ids)            # row i of every leaf sits in row i
    out = jax.jit(unpack, static_argnums=1)(buf, spec)
    for a, b in zip(tree, out):
        assert np.asarray(b).dtype == a.dtype
        np.testing.assert_array_equal(np.asarray(b).view(np.uint8), a.view(np.uint8))
