"""Products of 8-bit values: MatMulInteger (exact int32 sums: one pass over the bytes for a few
rows, AVX-512 VNNI tiles for a constant weight, float64 BLAS for more) and DequantizedMatMul (a
float product by an 8-bit weight kept in its bytes, `runnx/interp/fusion/dequantized_products.py`).
"""
from __future__ import annotations

import numpy as np

from runnx.ops import _kernels_vnni as vnni, _native
from runnx.ops._fused_common import DOMAIN as FUSED_DOMAIN
from runnx.ops._kernels_integer import column_sums, integer_rows
from runnx.ops._kernels_linalg import rows_times_bytes
from runnx.ops._remembered import Remembered
from runnx.ops.linalg import _FLOAT32, _POOLED_ELEMENTS, MatMul, _rows
from runnx.ops.quantization import dequantize
from runnx.ops.registry import register
from runnx.runtime import pool as decode_pool
from runnx.runtime.jobs import few


def _dequantized_matrix(_, b, scale, zero_point):
    matrix = dequantize(b, scale, zero_point)
    matrix.flags.writeable = False
    return matrix


# a weight's floats, made by its first product of many rows and kept while it lives (a weight's
# folded DequantizeLinear would have kept them from the start)
_remembered_dequantized = Remembered(_dequantized_matrix)
_BYTES = (np.dtype(np.uint8), np.dtype(np.int8))


@register("DequantizedMatMul", since=1, domain=FUSED_DOMAIN)
def DequantizedMatMul(a, b, b_scale, b_zero_point=None):
    """MatMul(a, DequantizeLinear(b, b_scale, b_zero_point)) for a 2-D 8-bit b with one scale and
    zero point: a weight kept in its bytes (`runnx/interp/fusion/dequantized_products.py`). The
    rows MatMul streams through its rows loop (decoding, a short prompt: float32, few of them)
    stream b's bytes instead, each entry dequantized as it is read with DequantizeLinear's
    arithmetic: bitwise MatMul over the dequantized matrix, from a quarter of its bytes. Other
    products multiply the dequantized matrix, made on their first call and kept while b lives."""
    if (_native.enabled and a.dtype == _FLOAT32 and b.ndim == 2 and b.dtype in _BYTES and b.flags.c_contiguous
            and b_scale.dtype == _FLOAT32 and b_scale.size == 1
            and (b_zero_point is None or (b_zero_point.size == 1 and b_zero_point.dtype == b.dtype))
            and a.ndim and a.size and a.shape[-1] == b.shape[0] and few(a.size // b.shape[0], b.shape[1])):
        numbers = (np.float32(0 if b_zero_point is None else b_zero_point.reshape(-1)[0]),
                   np.float32(b_scale.reshape(-1)[0]))
        if (workers := decode_pool.pool()) is not None and b.size >= _POOLED_ELEMENTS:  # as MatMul's paths
            (product,) = workers.products(_rows(a), (b,), numbers)
        else:
            product = rows_times_bytes(np.ascontiguousarray(a).reshape(-1, b.shape[0]), b, *numbers)
        return product.reshape(a.shape[:-1] + b.shape[1:])
    return MatMul(a, _remembered_dequantized((), b, b_scale, b_zero_point))


class _PendingVnni:
    """A constant 8-bit weight to repack ahead (`registry`'s pending work)."""

    __slots__ = ("weight",)

    def __init__(self, weight: np.ndarray):
        self.weight = weight

    @staticmethod
    def batch(pending: list):
        def make() -> None:
            for p in pending:
                _vnni_weights((), p.weight)
        return make


def _prepack_vnni(inputs: tuple, attrs: dict) -> _PendingVnni | None:
    """A constant 8-bit weight repacked ahead for `pool.vnni_rows` (`registry`'s prepack)."""
    b = inputs[1]
    if (isinstance(b, np.ndarray) and b.ndim == 2 and b.dtype.itemsize == 1 and b.dtype.kind in "iu" and b.size
            and _native.enabled and vnni.AVAILABLE and not b.flags.writeable):
        return _PendingVnni(b)
    return None


@register("MatMulInteger", since=10, prepack=_prepack_vnni)
def MatMulInteger(a, b, a_zero_point=None, b_zero_point=None):
    """(a - a_zero_point) @ (b - b_zero_point) in int32 (the spec lets only the accumulation wrap):
    a few rows of 8-bit values through `integer_rows` (one pass over b), or for a constant b on a
    CPU with AVX-512 VNNI through `pool.vnni_rows` (b repacked once), more through float64 BLAS
    products, exact while no sum can reach 2^31, else numpy's int32 loop."""
    if b.ndim == 2 and a.ndim >= 1 and a.dtype.itemsize == 1 and b.dtype.itemsize == 1 and a.dtype.kind in "iu" \
            and b.dtype.kind in "iu" and _native.enabled:
        rows = a.reshape(-1, a.shape[-1])
        a_zero = _zero_points(a_zero_point, rows.shape[0], a.ndim == 2)
        b_zero = _zero_points(b_zero_point, b.shape[1], True)
        if a_zero is not None and b_zero is not None and rows.shape[0] <= _INTEGER_ROWS:
            out = np.empty((rows.shape[0], b.shape[1]), np.int32)
            if vnni.AVAILABLE and not b.flags.writeable:  # a constant weight, repacked once
                signed_rows, unsigned_weight = a.dtype.kind == "i", b.dtype.kind == "u"
                decode_pool.vnni_rows(rows, signed_rows, *_vnni_weights((), b),
                                      a_zero + 128 if signed_rows else a_zero, b_zero - 128 if unsigned_weight else b_zero,
                                      out)
            else:
                integer_rows(np.ascontiguousarray(rows), np.ascontiguousarray(b), a_zero, b_zero, _column_sums((), b),
                             out)
            return out.reshape(a.shape[:-1] + (b.shape[1],))
        if a_zero is not None and b_zero is not None and a.shape[-1] * 255 * 255 < 2 ** 31:
            wide = rows.astype(np.float64) - a_zero.reshape(-1, 1)
            product = wide @ (b.astype(np.float64) - b_zero)
            return product.astype(np.int32).reshape(a.shape[:-1] + (b.shape[1],))
    a32 = a.astype(np.int32)
    if a_zero_point is not None:
        zero = a_zero_point.astype(np.int32)
        if zero.ndim == 1 and zero.size > 1:
            zero = zero.reshape(-1, 1)  # one zero point per row of A
        a32 -= zero
    b32 = b.astype(np.int32)
    if b_zero_point is not None:
        b32 -= b_zero_point.astype(np.int32)  # scalar, or one per column of B
    return np.matmul(a32, b32)


_INTEGER_ROWS = 16  # rows up to which one pass over the 8-bit matrix beats widening it for BLAS


def _zero_points(zero_point, count: int, per_entry: bool):
    """A zero point (None, a scalar, or one per row / column when `per_entry`) as int32 (count,),
    or None when it has another shape."""
    if zero_point is None:
        return np.zeros(count, np.int32)
    if zero_point.size == 1:
        return np.full(count, int(zero_point.reshape(-1)[0]), np.int32)
    if per_entry and zero_point.shape == (count,):
        return zero_point.astype(np.int32)
    return None


@Remembered
def _vnni_weights(_, b):
    """(b repacked in tiles of signed bytes, their column sums), read-only: `pool.vnni_rows`' weight."""
    depth, columns = b.shape
    tiles = np.zeros(((columns + vnni.TILE - 1) // vnni.TILE, (depth + 3) // 4, vnni.TILE, 4), np.uint8)
    sums = np.empty(columns, np.int32)
    vnni.repack(b, b.dtype.kind == "u", tiles, sums)
    for array in (tiles, sums):
        array.flags.writeable = False
    return tiles, sums


@Remembered
def _column_sums(_, b):
    """b's column sums (int32, read-only): `integer_rows`' zero-point term, once per constant weight."""
    sums = np.empty(b.shape[1], np.int32)
    column_sums(np.ascontiguousarray(b), sums)
    sums.flags.writeable = False
    return sums
