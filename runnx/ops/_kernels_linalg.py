"""numba kernels of the linear-algebra family: the one-row matrix product of decoding.

A decode step multiplies one row by each weight matrix. OpenBLAS's one-row kernel spends a good
part of its time outside the memory stream (measured in scripts/bench_gemv.py); a plain loop that
streams the matrix four rows per pass, the output row held in L1, keeps up with memory instead
(four rows: a quarter of the output's loads and stores, and four streams in flight; on a Zen 5
1.4-1.8x one row per pass, see docs/benchmarks.md). The rows
are cut into `ROW_CHUNKS` chunks whose partial sums are added in chunk order: the chunks are what
`_decode_pool.py` shares between threads, and since they depend on the matrix's shape only, the
pool's result is bitwise this loop's (and the same on every machine: no reassociation, so no
dependence on the vector width).
"""
from __future__ import annotations

import numba
import numpy as np

ROW_CHUNKS = 8

_kernel = numba.njit(cache=True, nogil=True, error_model="numpy")


@_kernel
def chunk_bounds(depth, chunks, index):
    """The rows [start, stop) of chunk `index` of `chunks` over `depth` rows."""
    return depth * index // chunks, depth * (index + 1) // chunks


@_kernel
def rows_into(row, matrix, partial, start, stop):
    """partial = row[start:stop] @ matrix[start:stop], each column summed in order of k."""
    partial[:] = 0
    whole = start + (stop - start) // 4 * 4
    for k in range(start, whole, 4):  # four rows per pass, then the rest one by one
        f0, f1, f2, f3 = row[k], row[k + 1], row[k + 2], row[k + 3]
        w0, w1, w2, w3 = matrix[k], matrix[k + 1], matrix[k + 2], matrix[k + 3]
        for n in range(partial.size):
            total = partial[n]
            total += f0 * w0[n]
            total += f1 * w1[n]
            total += f2 * w2[n]
            total += f3 * w3[n]
            partial[n] = total
    for k in range(whole, stop):
        factor = row[k]
        weights = matrix[k]
        for n in range(partial.size):
            partial[n] += factor * weights[n]


@_kernel
def add_partials_into(partials, out):
    """out = partials[0] + partials[1] + ... in that order."""
    out[:] = partials[0]
    for index in range(1, partials.shape[0]):
        chunk = partials[index]
        for n in range(out.size):
            out[n] += chunk[n]


@_kernel
def chunk_count(depth):
    """Row chunks of a product of `depth` rows (fewer rows than ROW_CHUNKS: one chunk each)."""
    return max(1, min(ROW_CHUNKS, depth))


@_kernel
def row_times_matrix(row, matrix):
    """row @ matrix for a vector row (K,) and a C-contiguous matrix (K, N), on this thread."""
    depth, width = matrix.shape
    chunks = chunk_count(depth)
    partials = np.empty((chunks, width), matrix.dtype)
    for index in range(chunks):
        start, stop = chunk_bounds(depth, chunks, index)
        rows_into(row, matrix, partials[index], start, stop)
    out = np.empty(width, matrix.dtype)
    add_partials_into(partials, out)
    return out
