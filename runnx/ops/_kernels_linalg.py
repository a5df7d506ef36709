"""numba kernels of the linear-algebra family: the one-row matrix product of decoding (and the
few-row product of a short prompt, the same loop serving every row from one pass over the matrix).

A decode step multiplies one row by each weight matrix. OpenBLAS's one-row kernel spends a good part
of its time outside the memory stream (measured in scripts/bench_gemv.py); a plain loop that streams
the matrix four rows per pass, the output row held in L1, keeps up with memory instead (four rows: a
quarter of the output's loads and stores). The four rows are a quarter of the rows apart, not
adjacent: four long sequential streams, where adjacent rows of a 576-wide matrix make four 2 KiB
streams that end and restart every pass (less bandwidth for the matrices of a decoder layer). The
rows are cut into `ROW_CHUNKS` chunks whose partial sums are added in chunk order: the chunks are
what `runtime/pool.py` shares between threads, and since they depend on the matrix's shape only, the
pool's result is bitwise this loop's. Each column is summed as a chain of fused multiply-adds
(`contract`: one rounding a row, as onnxruntime's MLAS kernels sum; never reassociated, so no
dependence on the vector width): the same result for every thread count, on every CPU with FMA, in
half the arithmetic instructions of a multiply and an add. A matrix of 8-bit integers with one
scale and zero point (a DequantizeLinear'd weight, `linalg_integer.DequantizedMatMul`) takes the same loop
in `rows_into_bytes`, each entry dequantized as it is read with DequantizeLinear's arithmetic:
bitwise the product with the dequantized float matrix, from a quarter of its bytes.
"""
from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from runnx.ops import _jit_cache  # noqa: F401  (numba caches this module's kernels under RUNNX_CACHE)

ROW_CHUNKS = 8

_kernel = numba.njit(cache=True, nogil=True, error_model="numpy", fastmath={"contract"})


@_kernel
def chunk_bounds(depth, chunks, index):
    """The rows [start, stop) of chunk `index` of `chunks` over `depth` rows."""
    return depth * index // chunks, depth * (index + 1) // chunks


@_kernel
def rows_into(rows, matrix, partial, start, stop):
    """partial = rows[:, start:stop] @ matrix[start:stop] for rows (M, K) and partial (M, N): the
    matrix rows in four quarters read side by side (rows k, k + q, k + 2q, k + 3q per pass, then
    the rest one by one), each pass serving every row of `rows`, each column summed in that fixed
    order. Four long sequential streams keep more memory reads in flight than four adjacent rows,
    whose streams end every few KiB (narrow decoding matrices gain most; scripts/bench_gemv.py
    measures it). A few rows (a short prompt's) cost about one row's memory traffic, where
    OpenBLAS packs the whole matrix for them; a row's sums do not depend
    on the rows beside it, so every row comes out bitwise as it would alone."""
    partial[:] = 0
    quarter = (stop - start) // 4
    for k in range(start, start + quarter):
        w0, w1, w2, w3 = matrix[k], matrix[k + quarter], matrix[k + 2 * quarter], matrix[k + 3 * quarter]
        for m in range(rows.shape[0]):
            row, sums = rows[m], partial[m]
            f0, f1, f2, f3 = row[k], row[k + quarter], row[k + 2 * quarter], row[k + 3 * quarter]
            for n in range(sums.size):
                total = sums[n]
                total += f0 * w0[n]
                total += f1 * w1[n]
                total += f2 * w2[n]
                total += f3 * w3[n]
                sums[n] = total
    for k in range(start + 4 * quarter, stop):
        weights = matrix[k]
        for m in range(rows.shape[0]):
            factor, sums = rows[m, k], partial[m]
            for n in range(sums.size):
                sums[n] += factor * weights[n]


@_kernel
def rows_into_bytes(rows, matrix, zero, scale, partial, start, stop):
    """`rows_into` over the float32 matrix (float32(matrix) - zero) * scale of an 8-bit matrix,
    each entry dequantized as it is read (`_kernels_integer.dequantize_into`'s arithmetic): the same
    loop, each column summed in the same order, so bitwise `rows_into` over the dequantized matrix
    (a test holds them to it)."""
    partial[:] = 0
    quarter = (stop - start) // 4
    for k in range(start, start + quarter):
        w0, w1, w2, w3 = matrix[k], matrix[k + quarter], matrix[k + 2 * quarter], matrix[k + 3 * quarter]
        for m in range(rows.shape[0]):
            row, sums = rows[m], partial[m]
            f0, f1, f2, f3 = row[k], row[k + quarter], row[k + 2 * quarter], row[k + 3 * quarter]
            for n in range(sums.size):
                total = sums[n]
                total += f0 * ((np.float32(w0[n]) - zero) * scale)
                total += f1 * ((np.float32(w1[n]) - zero) * scale)
                total += f2 * ((np.float32(w2[n]) - zero) * scale)
                total += f3 * ((np.float32(w3[n]) - zero) * scale)
                sums[n] = total
    for k in range(start + 4 * quarter, stop):
        weights = matrix[k]
        for m in range(rows.shape[0]):
            factor, sums = rows[m, k], partial[m]
            for n in range(sums.size):
                sums[n] += factor * ((np.float32(weights[n]) - zero) * scale)


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
def rows_times_matrix(rows, matrix):
    """rows @ matrix for C-contiguous rows (M, K) and matrix (K, N), on this thread."""
    depth, width = matrix.shape
    chunks = chunk_count(depth)
    partials = np.empty((chunks, rows.shape[0], width), matrix.dtype)
    for index in range(chunks):
        start, stop = chunk_bounds(depth, chunks, index)
        rows_into(rows, matrix, partials[index], start, stop)
    out = np.empty((rows.shape[0], width), matrix.dtype)
    add_partials_into(partials.reshape((chunks, out.size)), out.reshape(out.size))
    return out


@_kernel
def rows_times_bytes(rows, matrix, zero, scale):
    """rows @ ((float32(matrix) - zero) * scale) for C-contiguous float32 rows (M, K) and an 8-bit
    matrix (K, N), as `rows_times_matrix` sums it, on this thread."""
    depth, width = matrix.shape
    chunks = chunk_count(depth)
    partials = np.empty((chunks, rows.shape[0], width), rows.dtype)
    for index in range(chunks):
        start, stop = chunk_bounds(depth, chunks, index)
        rows_into_bytes(rows, matrix, zero, scale, partials[index], start, stop)
    out = np.empty((rows.shape[0], width), rows.dtype)
    add_partials_into(partials.reshape((chunks, out.size)), out.reshape(out.size))
    return out


@_kernel
def row_times_matrix(row, matrix):
    """row @ matrix for a C-contiguous vector row (K,) and matrix (K, N), on this thread."""
    return rows_times_matrix(row.reshape((1, row.size)), matrix)[0]


LANES = 16  # `columns_into`'s running sums a column: one 512-bit vector of float32


def _emit_lane_dots(builder, row_a, columns_a, firsts: list) -> list:
    """The code of `_lane_dots`: each column's LANES chains and halves, the columns' chains side by side."""
    f32, i32, i64 = ir.FloatType(), ir.IntType(32), ir.IntType(64)
    vector = ir.VectorType(f32, LANES)
    fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vector, [vector] * 3), "llvm.fma.v16f32")
    scalar_fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f32, [f32] * 3), "llvm.fma.f32")
    depth = builder.extract_value(row_a.shape, 0)
    whole = builder.mul(builder.sdiv(depth, ir.Constant(i64, LANES)), ir.Constant(i64, LANES))
    totals = [cgutils.alloca_once_value(builder, ir.Constant(vector, [0.0] * LANES)) for _ in firsts]
    with cgutils.for_range_slice(builder, ir.Constant(i64, 0), whole, ir.Constant(i64, LANES)) as (k, _):
        x = builder.load(builder.bitcast(builder.gep(row_a.data, [k]), vector.as_pointer()), align=4)
        for first, total in zip(firsts, totals):
            at = builder.gep(columns_a.data, [builder.add(first, k)])
            y = builder.load(builder.bitcast(at, vector.as_pointer()), align=4)
            builder.store(builder.call(fma, [x, y, builder.load(total)]), total)
    with cgutils.for_range_slice(builder, whole, depth, ir.Constant(i64, 1)) as (k, _):
        lane = builder.trunc(builder.sub(k, whole), i32)
        x = builder.load(builder.gep(row_a.data, [k]))
        for first, total in zip(firsts, totals):
            sums = builder.load(total)
            y = builder.load(builder.gep(columns_a.data, [builder.add(first, k)]))
            term = builder.call(scalar_fma, [x, y, builder.extract_element(sums, lane)])
            builder.store(builder.insert_element(sums, term, lane), total)
    results = []
    for total in totals:
        sums, width = builder.load(total), LANES
        while width > 1:
            width //= 2
            low = builder.shuffle_vector(sums, sums, ir.Constant(ir.VectorType(i32, width), list(range(width))))
            high = builder.shuffle_vector(sums, sums, ir.Constant(ir.VectorType(i32, width),
                                                                  list(range(width, 2 * width))))
            sums = builder.fadd(low, high)
        results.append(builder.extract_element(sums, ir.Constant(i32, 0)))
    return results


@intrinsic
def _lane_dot(typingctx, row, columns, n):
    """row . columns[n], float32, as LANES chains of fused multiply-adds from zero, lane l over
    k = l, l + 16, ... (the last K % 16 terms ending the first lanes' chains), then the lanes added
    in halves (8 + 8, 4 + 4, 2 + 2, 1 + 1): the same sum wherever it is computed."""
    def codegen(context, builder, sig, args):
        row_a, columns_a = context.make_array(sig.args[0])(context, builder, args[0]), \
            context.make_array(sig.args[1])(context, builder, args[1])
        depth = builder.extract_value(columns_a.shape, 1)
        (value,) = _emit_lane_dots(builder, row_a, columns_a, [builder.mul(args[2], depth)])
        return value

    return types.float32(row, columns, types.int64), codegen


@intrinsic
def _lane_dots4(typingctx, row, columns, n0, n1, n2, n3):
    """(row . columns[n0], ..., row . columns[n3]): four `_lane_dot`s, their chains side by side (each
    the same sum as `_lane_dot`'s), so four columns' reads are in flight together."""
    def codegen(context, builder, sig, args):
        row_a, columns_a = context.make_array(sig.args[0])(context, builder, args[0]), \
            context.make_array(sig.args[1])(context, builder, args[1])
        depth = builder.extract_value(columns_a.shape, 1)
        values = _emit_lane_dots(builder, row_a, columns_a, [builder.mul(n, depth) for n in args[2:]])
        return context.make_tuple(builder, sig.return_type, values)

    return types.UniTuple(types.float32, 4)(row, columns, types.int64, types.int64, types.int64, types.int64), codegen


@_kernel
def columns_into(rows, columns, out, first, stop):
    """out[:, first:stop] = rows @ columns[first:stop].T for C-contiguous float32 rows (M, K) and a
    matrix given by its columns (N, K) (a transposed operand: a tied LM head reads the embedding's
    rows), each column's row read once, in order, for every row of `rows`; each element
    `_lane_dot`'s sum, the same whatever range or thread computes it. The range's columns in four
    quarters read side by side (columns n, n + q, n + 2q, n + 3q together: `_lane_dots4`), as
    `rows_into` reads a matrix's rows: four long sequential streams. One stream alone stalls at
    every 4 KiB page, where the hardware prefetcher stops (a tied LM head's 113 MB in 4 KiB pages:
    9.7 ms at 11.7 GB/s, 8.1 ms in quarters; four adjacent columns, four streams a column long, were
    slower than one)."""
    quarter = (stop - first) // 4
    for n in range(first, first + quarter):
        for m in range(rows.shape[0]):
            o0, o1, o2, o3 = _lane_dots4(rows[m], columns, n, n + quarter, n + 2 * quarter, n + 3 * quarter)
            out[m, n], out[m, n + quarter], out[m, n + 2 * quarter], out[m, n + 3 * quarter] = o0, o1, o2, o3
    for n in range(first + 4 * quarter, stop):
        for m in range(rows.shape[0]):
            out[m, n] = _lane_dot(rows[m], columns, n)


@_kernel
def rows_times_columns(rows, columns):
    """rows @ columns.T for C-contiguous rows (M, K) and columns (N, K), on this thread (`columns_into`)."""
    out = np.empty((rows.shape[0], columns.shape[0]), np.float32)
    columns_into(rows, columns, out, 0, columns.shape[0])
    return out
