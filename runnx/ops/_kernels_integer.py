"""numba kernels of the quantized products: an exact integer product of a few rows (decoding's
MatMulInteger) and a per-tensor dequantization, each one pass over its 8-bit matrix.

numpy has no BLAS for integers: its int32 matmul is a plain loop, and widening an 8-bit weight to
int32 (or float64) on every call streams four (eight) times its bytes. Here a row's product reads
the 8-bit matrix once, four of its rows per pass (one read-modify-write of the int32 accumulators a
pass, in L1), in 32-bit integer lanes. The zero points come out of the loop:
sum_k (a_k - za)(b_kn - zb_n) = sum_k a_k b_kn - za colsum_n - zb_n rowsum + K za zb_n, every term
in int32 arithmetic, which wraps as the spec's int32 accumulation does (exact below 2^31).
"""
from __future__ import annotations

import numba
import numpy as np

from runnx.ops import _jit_cache  # noqa: F401  (numba caches this module's kernels under RUNNX_CACHE)

_kernel = numba.njit(cache=True, nogil=True, error_model="numpy")


@_kernel
def column_sums(b, out):
    """out[n] = sum_k b[k, n] (int32) of an 8-bit matrix (K, N)."""
    out[:] = 0
    for k in range(b.shape[0]):
        line = b[k]
        for n in range(b.shape[1]):
            out[n] = np.int32(out[n] + np.int32(line[n]))


@_kernel
def integer_rows(a, b, a_zero, b_zero, b_sums, out):
    """out (M, N) int32 = (a - a_zero[:, None]) @ (b - b_zero[None, :]) for 8-bit a (M, K) and b
    (K, N), a_zero (M,) and b_zero (N,) int32, b_sums (N,) b's column sums."""
    rows, depth = a.shape
    columns = b.shape[1]
    acc = np.empty(columns, np.int32)
    for m in range(rows):
        acc[:] = 0
        row_sum = np.int32(0)
        k = 0
        while k + 4 <= depth:
            a0, a1, a2, a3 = np.int32(a[m, k]), np.int32(a[m, k + 1]), np.int32(a[m, k + 2]), np.int32(a[m, k + 3])
            row_sum = np.int32(row_sum + np.int32(np.int32(a0 + a1) + np.int32(a2 + a3)))
            b0, b1, b2, b3 = b[k], b[k + 1], b[k + 2], b[k + 3]
            for n in range(columns):
                pair = np.int32(np.int32(a0 * np.int32(b0[n])) + np.int32(a1 * np.int32(b1[n])))
                other = np.int32(np.int32(a2 * np.int32(b2[n])) + np.int32(a3 * np.int32(b3[n])))
                acc[n] = np.int32(acc[n] + np.int32(pair + other))
            k += 4
        while k < depth:
            ak = np.int32(a[m, k])
            row_sum = np.int32(row_sum + ak)
            line = b[k]
            for n in range(columns):
                acc[n] = np.int32(acc[n] + np.int32(ak * np.int32(line[n])))
            k += 1
        za = a_zero[m]
        shift = np.int32(depth * za)
        for n in range(columns):
            zb = b_zero[n]
            out[m, n] = np.int32(np.int32(acc[n] - np.int32(za * b_sums[n]))
                                 - np.int32(np.int32(zb * row_sum) - np.int32(shift * zb)))


@_kernel
def dequantize_into(x, zero, scale, out):
    """out = (float32(x) - float32(zero)) * scale, element by element over flat arrays: numpy's
    arithmetic for a per-tensor DequantizeLinear, in one pass without temporaries."""
    for i in range(x.shape[0]):
        out[i] = (np.float32(x[i]) - zero) * scale


@_kernel
def dynamic_quantize_into(x, out):
    """DynamicQuantizeLinear of a flat float32 x into uint8 out with numpy's float32 arithmetic (the
    range widened to hold 0, scale (high - low) / 255, zero point and values rounded half to even):
    (scale, zero point), or (nan, 0) when x holds a NaN or an infinity (out untouched)."""
    low, high = np.float32(0.0), np.float32(0.0)
    for i in range(x.shape[0]):
        value = x[i]
        if not np.isfinite(value):
            return np.float32(np.nan), np.float32(0.0)
        low = min(low, value)
        high = max(high, value)
    scale = np.float32(np.float32(high - low) / np.float32(255.0))
    if scale == 0:
        out[:] = 0
        return scale, np.float32(0.0)
    zero = min(max(np.rint(np.float32(-low / scale)), np.float32(0.0)), np.float32(255.0))
    for i in range(x.shape[0]):
        value = np.float32(np.rint(np.float32(x[i] / scale)) + zero)
        out[i] = np.uint8(min(max(value, np.float32(0.0)), np.float32(255.0)))
    return scale, zero
