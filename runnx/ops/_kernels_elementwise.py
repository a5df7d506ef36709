"""numba kernels for elementwise math numpy has no ufunc for (erf)."""
from __future__ import annotations

import math

import numba


@numba.njit(cache=True)
def erf_into(flat_in, flat_out):
    """flat_out[i] = erf(flat_in[i]) for 1-D float32/float64 arrays (same length)."""
    for i in range(flat_in.shape[0]):
        flat_out[i] = math.erf(flat_in[i])
