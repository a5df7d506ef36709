"""numba kernels of the linear-algebra family: the one-row matrix product of decoding.

A decode step multiplies one row by each weight matrix. OpenBLAS's one-row kernel spends a good
part of its time outside the memory stream (measured in scripts/bench_gemv.py); a plain loop that
streams the matrix four rows per pass, the output row held in L1, keeps up with memory instead
(four rows: a quarter of the output's loads and stores). The four rows are a quarter of the rows
apart, not adjacent: four long sequential streams, where adjacent rows of a 576-wide matrix make
four 2 KiB streams that end and restart every pass (1.3-2x the bandwidth on a Zen 3 for the
matrices of a decoder layer). The rows are cut into `ROW_CHUNKS` chunks whose partial sums are
added in chunk order: the chunks are what `_decode_pool.py` shares between threads, and since
they depend on the matrix's shape only, the pool's result is bitwise this loop's (and the same on
every machine: no reassociation, so no dependence on the vector width).
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
    """partial = row[start:stop] @ matrix[start:stop]: the rows in four quarters read side by side
    (rows k, k + q, k + 2q, k + 3q per pass, then the rest one by one), each column summed in
    that fixed order. Four long sequential streams keep more memory reads in flight than four
    adjacent rows, whose streams end every few KiB: on a Zen 3 1.3-2x the bandwidth for the
    384- and 576-wide matrices of decoding (scripts/bench_gemv.py), the same for wide ones."""
    partial[:] = 0
    quarter = (stop - start) // 4
    for k in range(start, start + quarter):
        f0, f1, f2, f3 = row[k], row[k + quarter], row[k + 2 * quarter], row[k + 3 * quarter]
        w0, w1, w2, w3 = matrix[k], matrix[k + quarter], matrix[k + 2 * quarter], matrix[k + 3 * quarter]
        for n in range(partial.size):
            total = partial[n]
            total += f0 * w0[n]
            total += f1 * w1[n]
            total += f2 * w2[n]
            total += f3 * w3[n]
            partial[n] = total
    for k in range(start + 4 * quarter, stop):
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
