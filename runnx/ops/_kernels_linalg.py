"""numba kernel of the linear-algebra family: the one-row matrix product of decoding.

A decode step multiplies one row by each weight matrix. For matrices of at most a few hundred
columns, OpenBLAS's one-row kernel spends a good part of its time outside the memory stream
(measured in scripts/bench_gemv.py); a plain loop that streams the matrix row by row, the
output row held in L1, keeps up with memory instead.
"""
from __future__ import annotations

import numba
import numpy as np


@numba.njit(cache=True, nogil=True, error_model="numpy")
def row_times_matrix(row, matrix):
    """row @ matrix for a vector row (K,) and a C-contiguous matrix (K, N): each output sums its
    K products in order of k (IEEE arithmetic, no reassociation: the result does not depend on
    the machine's vector width)."""
    depth, width = matrix.shape
    out = np.zeros(width, matrix.dtype)
    for k in range(depth):
        factor = row[k]
        weights = matrix[k]
        for n in range(width):
            out[n] += factor * weights[n]
    return out
