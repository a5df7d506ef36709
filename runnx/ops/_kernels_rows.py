"""Row kernels in numba for the fused LayerNorm-block ops (`runnx/ops/fused_layer_norm_blocks.py`): a
row softmax for long attention (scores computed by BLAS a block of rows at a time) and the erf GELU, over cache-resident
rows. They are not numba parallel loops: between BLAS calls, numba's spinning threads and
OpenBLAS's took the cores from each other (the encoder ran 5-20x slower). Their blocks of rows are
shared with the decode pool's workers instead, which sleep right after (`runtime.pool.softmax_rows`,
`gelu_rows`).

float32 exp is 2^n * 2^f, with 2^f (|f| <= 1/2) a degree-6 polynomial (error below 2e-7) and 2^n
put into the exponent bits; the float32 rounding of the scaled argument dominates (a few 1e-6
relative, 20 below the peak), as in numpy's float32 softmax. Unlike libm's expf (numba calls it
per element without SVML) it vectorises.
The GELU's arithmetic may be reordered (`_REORDER_SIGNED`: float rounding only; NaN, inf and
the sign of zero keep their meaning, gelu(-0.0) is -0.0); the softmax's sum is not (see
softmax_rows_float32).
"""
from __future__ import annotations

import math

import numba
import numpy as np

from runnx.ops import _jit_cache  # noqa: F401  (numba caches this module's kernels under RUNNX_CACHE)
from runnx.ops._kernels_elementwise import erf_float32
from runnx.ops._kernels_fused import float32_from_bits
from runnx.ops._kernels_nn import pairwise_total
from runnx.ops._vector_width import full_width

_REORDER = {"reassoc", "contract", "nsz", "arcp"}
_REORDER_SIGNED = {"reassoc", "contract", "arcp"}
_LOG2E = np.float32(1.4426950408889634)
# Taylor coefficients of 2^f = exp(f ln 2): the degree-7 term is below 2e-7 for |f| <= 1/2
_E0, _E1, _E2, _E3, _E4, _E5, _E6 = (np.float32(math.log(2) ** k / math.factorial(k)) for k in range(7))
_LOWEST = np.float32(-127.0)  # 2^-127 and below flush to 0 (exponent bits 0)
_HALF = np.float32(0.5)
# float32 bits b as int32 keys b ^ ((b >> 31) & 0x7FFFFFFF) are in the floats' order, NaNs beyond
# the keys of +inf (sign clear) and -inf (sign set)
_MAGNITUDE, _SIGN_SHIFT = np.int32(0x7FFFFFFF), np.int32(31)
_BIAS, _MANTISSA_BITS = np.int32(127), np.int32(23)  # float32's exponent bias and the bits below it
_PLUS_INF_KEY, _MINUS_INF_KEY = np.int32(0x7F800000), np.int32(-0x7F800001)


@numba.njit(cache=True, error_model="numpy")
def _row_peak(bits):
    """The largest float32 of a row given as int32 bits; NaN when it holds a NaN, as numpy's maximum.
    Integer max and min reductions vectorise where NaN-aware float ones do not, and the row is read
    while in L1, not in a pass of its own. Every step is cast to int32: numba widens int32
    arithmetic to int64, which halves the lanes."""
    full_width()
    high, low = np.int32(-0x80000000), np.int32(0x7FFFFFFF)
    for j in range(bits.shape[0]):
        b = bits[j]
        key = np.int32(b ^ ((b >> _SIGN_SHIFT) & _MAGNITUDE))
        high = np.int32(max(high, key))
        low = np.int32(min(low, key))
    if high > _PLUS_INF_KEY or low < _MINUS_INF_KEY:
        return np.float32(np.nan)
    return float32_from_bits(np.int32(high if high >= 0 else high ^ _MAGNITUDE))


@numba.njit(cache=True, fastmath=_REORDER, error_model="numpy")
def _exponentials(row, peak):
    """row = exp(row - peak) = 2^n * 2^f, element by element (no sums: the flags that vectorise it
    cannot change how a copy rounds a sum); 2^n's bits made in int32 (see `_row_peak`)."""
    full_width()
    for j in range(row.shape[0]):
        t = max((row[j] - peak) * _LOG2E, _LOWEST)
        n = np.int32(t - _HALF)  # t <= 0: truncating t - 1/2 rounds to the nearest, so |f| <= 1/2
        f = t - np.float32(n)
        power = float32_from_bits(np.int32(np.int32(n + _BIAS) << _MANTISSA_BITS))
        row[j] = ((((((_E6 * f + _E5) * f + _E4) * f + _E3) * f + _E2) * f + _E1) * f + _E0) * power


@numba.njit(cache=True, error_model="numpy")
def _row_total(row, scratch):
    """sum(row), float32 (row's length >= 1): its halves' sums into scratch (half its length, and
    one), then `pairwise_total`, no flags: the same rounding in every compiled copy."""
    full_width()
    n = row.shape[0]
    if n == 1:
        return row[0]
    half = n // 2
    for j in range(half):
        scratch[j] = row[j] + row[j + half]
    if n % 2:
        scratch[0] += row[n - 1]
    return pairwise_total(scratch, half)


@numba.njit(cache=True, nogil=True, error_model="numpy")  # nogil: threads run it between their products
def softmax_rows_float32(scores, fill):
    """Softmax along the last axis of C-contiguous float32 scores (rows, columns), in place. A row
    whose softmax is NaN (a NaN or +inf score, or every score -inf) becomes `fill`. Its sum has no
    fast-math flags (`_row_total`), so every compiled copy rounds alike (the decode pool's worker
    loop has its own): with them, a worker's copy rounded some rows 1 ulp apart from the caller's
    in some processes, and a row's softmax depended on which thread took its block."""
    full_width()
    scratch = np.empty(scores.shape[1] // 2 + 1, np.float32)
    bits = scores.view(np.int32)
    for r in range(scores.shape[0]):
        row, peak = scores[r], _row_peak(bits[r])
        if not (peak > -np.inf and peak < np.inf):
            row[:] = fill
            continue
        _exponentials(row, peak)
        inverse = np.float32(1) / _row_total(row, scratch)
        for j in range(row.shape[0]):
            row[j] = row[j] * inverse


@numba.njit(cache=True, fastmath=_REORDER_SIGNED, error_model="numpy")
def gelu_rows_float32(x, bias, divisor, one, half, out):
    """out = ((v * (erf(v / divisor) + one)) * half, v = x + bias, for every row of x (rows, columns);
    an empty bias adds nothing. One loop with the erf inlined: each row is read once, while it
    is in cache."""
    full_width()
    for r in range(x.shape[0]):
        row, result = x[r], out[r]
        if bias.shape[0]:
            for c in range(row.shape[0]):
                v = row[c] + bias[c]
                result[c] = (v * (erf_float32(v / divisor) + one)) * half
        else:
            for c in range(row.shape[0]):
                v = row[c]
                result[c] = (v * (erf_float32(v / divisor) + one)) * half


@numba.njit(cache=True, error_model="numpy")
def split_heads_into(x, bias, out):
    """out[b, h, t] = x[b, t, h * depth:(h + 1) * depth] (+ the same slice of bias) for C-contiguous x
    (batch, length, heads * depth) and out (batch, heads, length, depth); an empty bias adds
    nothing. One pass, reading x in order, where numpy's bias add and transposing copy take two
    (a decoder's cross-attention keys and values, computed once a window)."""
    batch, heads, length, depth = out.shape
    for b in range(batch):
        for t in range(length):
            row = x[b, t]
            for h in range(heads):
                source, target = row[h * depth:(h + 1) * depth], out[b, h, t]
                if bias.shape[0]:
                    offsets = bias[h * depth:(h + 1) * depth]
                    for d in range(depth):
                        target[d] = offsets[d] + source[d]
                else:  # element by element: a slice assignment of 64 floats took twice as long
                    for d in range(depth):
                        target[d] = source[d]
