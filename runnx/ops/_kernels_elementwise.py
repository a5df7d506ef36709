"""numba kernels for elementwise math numpy has no ufunc for (erf)."""
from __future__ import annotations

import math

import numba
import numpy as np

from runnx.ops import _jit_cache  # noqa: F401  (numba caches this module's kernels under RUNNX_CACHE)

# erf(x) ~= x * P(x^2) / Q(x^2) on [-4, 4] (outside, erf is +-1 in float32): the rational minimax
# fit Eigen and XLA use for float32, within 6 ulp of the exact value; unlike libm's erff it
# vectorises, which makes it several times faster (numpy's error model: Python's would check the
# division for zero per element, which stops the vectorising; q has no zero on [-4, 4]).
_ERF_P = (-2.72614225801306e-10, 2.77068142495902e-08, -2.10102402082508e-06, -5.69250639462346e-05,
          -7.34990630326855e-04, -2.95459980854025e-03, -1.60960333262415e-02)
_ERF_Q = (-1.45660718464996e-05, -2.13374055278905e-04, -1.68282697438203e-03, -7.37332916720468e-03,
          -1.42647390514189e-02)
P0, P1, P2, P3, P4, P5, P6 = (np.float32(c) for c in _ERF_P)
Q0, Q1, Q2, Q3, Q4 = (np.float32(c) for c in _ERF_Q)
FOUR = np.float32(4.0)
ONE = np.float32(1.0)
SATURATED = np.float32(3.919206)  # the least float32 whose erf rounds to 1: erf is +-1 from here on
# reordering and reciprocals only: fast-math's no-NaN/no-inf/no-signed-zero flags would let the
# compiler drop the NaN test below and give erf(-0.0) = +0.0
_REORDER = {"reassoc", "contract", "arcp"}


@numba.njit(cache=True, fastmath=_REORDER, error_model="numpy")
def erf_float32(x):
    """erf(x) of a float32 by the rational approximation above (inlined into loops, it vectorises),
    as libm's: NaN stays NaN, +-inf and all from SATURATED on give exactly +-1, -0.0 stays -0.0."""
    clamped = min(max(x, -FOUR), FOUR)
    x2 = clamped * clamped
    p = ((((((P0 * x2 + P1) * x2 + P2) * x2 + P3) * x2 + P4) * x2 + P5) * x2 + P6) * clamped
    q = (((Q0 * x2 + Q1) * x2 + Q2) * x2 + Q3) * x2 + Q4
    result = p / q
    if abs(x) >= SATURATED:  # the fit's value there is 1 ulp below 1, which v * (erf + 1) would show
        result = math.copysign(ONE, x)
    return x if x != x else result


@numba.njit(cache=True, fastmath=_REORDER, error_model="numpy")
def erf_float32_into(flat_in, flat_out):
    """flat_out[i] = erf(flat_in[i]) for 1-D float32 arrays."""
    for i in range(flat_in.shape[0]):
        flat_out[i] = erf_float32(flat_in[i])


@numba.njit(cache=True)
def erf_float64_into(flat_in, flat_out):
    """flat_out[i] = erf(flat_in[i]) for 1-D float64 arrays (libm, correctly rounded in practice)."""
    for i in range(flat_in.shape[0]):
        flat_out[i] = math.erf(flat_in[i])
