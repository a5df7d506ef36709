"""numba kernels of the fused Whisper ops (`runnx/ops/fused_whisper.py`): a row softmax for long
attention (scores computed by BLAS a block of rows at a time) and the erf GELU, each in one pass
over cache-resident rows. They run on one thread: between BLAS calls, numba's parallel regions
and OpenBLAS's waiting threads take the cores from each other (the encoder ran 5-20x slower).

float32 exp is 2^n * 2^f, with 2^f (|f| <= 1/2) a degree-6 polynomial and 2^n put into the
exponent bits: within ~1e-7 relative of the exact value, as numpy's own vectorised expf, but
vectorisable by LLVM (libm's expf is not, and without SVML numba calls it per element).
Sums are vectorised in any order (`_REORDER`: float rounding only); NaN and inf keep their
meaning.
"""
from __future__ import annotations

import math

import numba
import numpy as np

from runnx.ops._kernels_elementwise import erf_float32_into

_REORDER = {"reassoc", "contract", "nsz", "arcp"}
_LOG2E = np.float32(1.4426950408889634)
# Taylor coefficients of 2^f = exp(f ln 2): the degree-7 term is below 2e-7 for |f| <= 1/2
_E0, _E1, _E2, _E3, _E4, _E5, _E6 = (np.float32(math.log(2) ** k / math.factorial(k)) for k in range(7))
_LOWEST = np.float32(-127.0)  # 2^-127 and below flush to 0 (exponent bits 0)


@numba.njit(cache=True, fastmath=_REORDER, error_model="numpy")
def _softmax_row_float32(row, powers, fill):
    """Softmax of one float32 row in place; `powers` (int32, the row's length) is scratch space.
    A row whose softmax is NaN (a NaN or +inf score, or every score -inf) becomes `fill`."""
    largest, unordered = -np.inf, False
    for j in range(row.shape[0]):
        s = row[j]
        unordered |= s != s
        if s > largest:
            largest = s
    if unordered or largest == np.inf or largest == -np.inf:
        row[:] = fill
        return
    peak = np.float32(largest)
    for j in range(row.shape[0]):
        t = max((row[j] - peak) * _LOG2E, _LOWEST)
        n = np.floor(t + np.float32(0.5))
        f = t - n
        row[j] = (((((_E6 * f + _E5) * f + _E4) * f + _E3) * f + _E2) * f + _E1) * f + _E0
        powers[j] = (np.int32(n) + 127) << 23
    scales = powers.view(np.float32)
    total = np.float32(0)
    for j in range(row.shape[0]):
        e = row[j] * scales[j]
        row[j] = e
        total += e
    for j in range(row.shape[0]):
        row[j] = row[j] / total


@numba.njit(cache=True, fastmath=_REORDER, error_model="numpy")
def softmax_rows_float32(scores, fill):
    """Softmax along the last axis of C-contiguous float32 scores (rows, columns), in place."""
    powers = np.empty(scores.shape[1], np.int32)
    for r in range(scores.shape[0]):
        _softmax_row_float32(scores[r], powers, fill)


@numba.njit(cache=True, fastmath=_REORDER, error_model="numpy")
def gelu_rows_float32(x, bias, divisor, one, half, out):
    """out = ((v * (erf(v / divisor) + one)) * half, v = x + bias, for every row of x (rows, columns);
    an empty bias adds nothing."""
    scratch = np.empty(x.shape[1], np.float32)
    for r in range(x.shape[0]):
        row, result = x[r], out[r]
        if bias.shape[0]:
            for c in range(row.shape[0]):
                result[c] = row[c] + bias[c]
        else:
            result[:] = row
        for c in range(row.shape[0]):
            scratch[c] = result[c] / divisor
        erf_float32_into(scratch, scratch)
        for c in range(row.shape[0]):
            result[c] = (result[c] * (scratch[c] + one)) * half
