"""4-bit products of a few rows over weights repacked in tiles of 16 columns; a prompt's panels of
the same weights dequantized from those tiles (`tile_lanes_panel`), so that once the tiles are made
the weights' own bytes go back to their file (`repack_listed`'s HAND_BACK).

A one-row product over 4-bit weights is bound by instructions, not memory: every weight is
unpacked (mask or shift), widened and converted before its multiply-add. Laid out as onnxruntime
stores them (a column's bytes in a row), the sum runs along a column and each 16 bytes need their
own scale: LLVM's vectoriser then spends about 23 instructions on 32 weights. Repacked so that
one 16-byte load holds the same byte of 16 columns (`TILE`), one 512-bit vector carries 16 columns
at once: per byte a load, a mask, a shift, two conversions and two multiply-adds for 32 weights,
with each column's 32 weights of a chunk summed before its scale multiplies them once (2.7x the
weights per second of the column loop on one AVX-512 core).

LLVM's vectoriser does not find this shape from a loop (it vectorises the innermost loop, and
keeps the 16 column sums in memory), so `_tile_dot` writes it as LLVM vector instructions
directly: portable IR (LLVM splits the 16-lane vectors for narrower machines), fixed order, no
reassociation. A column's sum does not depend on how many tiles or rows come with it, nor on the
thread that computes it.

A prompt's rows share the unpacking: `_tiles_dot` takes GROUPED_ROWS rows over one unpacking of a
tile's bytes (as many as the registers hold), and from UNPACKED_ROWS rows `tile_rows_unpacked`
unpacks each chunk of a tile once into 2 KiB of floats that every row's multiply-adds then read from
L1. Both keep each row's chains and their order: a row's bits are its one-row product's.

Layout (`repack`): for weights of `chunks` chunks of 32 values (16 bytes, a block of 32, or a part
of a larger block), tiles[t, c, j, i] is byte j of chunk c of column 16 t + i (low nibble value
2 j, high nibble 2 j + 1); scales[t, c, i] the scale of that chunk's block and zeros[t, c, i] its
zero point, as the model gives it: uint8 for 4-bit zero points, float32 for zero points of the
scales' type; weights without zero points (the default, 8) share one row of 16 (`zeros` of shape
(1, 1, 16)). The kernel multiplies a zero point by its scale as it reads them: one multiply, the
value a product made ahead would have, and a decode step streams 20 bytes a chunk and column (16 of
weights, 4 of scale; 21 with byte zero points) instead of 24. Columns past N (the last tile's
padding) are zeros.
"""
from __future__ import annotations

import mmap
import sys

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from runnx.ops import _jit_cache  # noqa: F401  (numba caches this module's kernels under RUNNX_CACHE)
from runnx.ops._kernels_contrib import ZERO_PACKED, ZERO_TYPED, block_zero_points
from runnx.ops._vector_width import compiles_for
from runnx.runtime.atomics import compare_and_swap, load, nap, pause, store

TILE = 16  # columns a tile: one 512-bit vector of float32 sums
CHUNK_BYTES = 16  # bytes of a column a chunk: 32 4-bit values with one scale
# how far ahead (bytes of tiles) each chunk asks for the weights and scales it will need: a model's
# weights stream from memory, and the hardware prefetcher alone left a decode step's products 1.3x
# slower. One row (a decode step) asks 16 KB ahead: 2 KB (8 chunks of a tile) still stalled on
# memory at each unit's start. Several rows read each tile once a row, from cache after the first:
# there 16 KB ahead slowed a first 32-token prompt by a third (its tiles still being made beside
# it, `registry`'s prepack), so they ask 2 KB ahead
_ROW_AHEAD, _ROWS_AHEAD = 16384, 2048

_kernel = numba.njit(cache=True, nogil=True, error_model="numpy")


def _emit_tiles(builder, tiles_a, scales_a, zeros_a, zero_bytes: bool, tile, ahead, rows: list) -> None:
    """The code of `_tile_dot` for each of `rows`, (low, high, sums, out) pointers of one row, over one
    unpacking of the tile's bytes: each row's sums are the same chains, in the same order, as its
    own `_tile_dot`'s."""
    f32, i32, i64 = ir.FloatType(), ir.IntType(32), ir.IntType(64)
    floats, words, octets = ir.VectorType(f32, TILE), ir.VectorType(i32, TILE), ir.VectorType(ir.IntType(8), TILE)
    fmuladd = cgutils.get_or_insert_function(builder.module, ir.FunctionType(floats, [floats] * 3),
                                             "llvm.fmuladd.v16f32")
    nothing = ir.Constant(floats, [0.0] * TILE)
    fifteen, four = ir.Constant(words, [15] * TILE), ir.Constant(words, [4] * TILE)
    undefined, first_lane = ir.Constant(floats, ir.Undefined), ir.Constant(words, [0] * TILE)

    def broadcast(pointer, index):
        value = builder.insert_element(undefined, builder.load(builder.gep(pointer, [index])), ir.Constant(i32, 0))
        return builder.shuffle_vector(value, undefined, first_lane)

    def vector(pointer, index, kind):
        return builder.load(builder.bitcast(builder.gep(pointer, [index]), kind.as_pointer()), align=1)

    prefetch_function = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(ir.VoidType(), [ir.IntType(8).as_pointer(), i32, i32, i32]),
        "llvm.prefetch.p0i8")

    def prefetch(pointer, index):  # a read, kept in every cache level, of data (not code)
        address = builder.bitcast(builder.gep(pointer, [index]), ir.IntType(8).as_pointer())
        builder.call(prefetch_function, [address, ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])

    chunks = builder.extract_value(tiles_a.shape, 1)
    zero_rows = builder.mul(builder.extract_value(zeros_a.shape, 0), builder.extract_value(zeros_a.shape, 1))
    shared_zeros = builder.icmp_unsigned("==", zero_rows, ir.Constant(i64, 1))  # (one tile of one chunk: alike)
    totals = [cgutils.alloca_once_value(builder, nothing) for _ in rows]
    first_chunk = builder.mul(tile, chunks)
    with cgutils.for_range(builder, chunks) as loop:
        chunk = loop.index
        bytes_at = builder.mul(builder.add(first_chunk, chunk), ir.Constant(i64, CHUNK_BYTES * TILE))
        values_at = builder.mul(chunk, ir.Constant(i64, CHUNK_BYTES))
        columns_at = builder.mul(builder.add(first_chunk, chunk), ir.Constant(i64, TILE))
        for line in range(0, CHUNK_BYTES * TILE, 64):  # (past the last tile: prefetches never fault)
            prefetch(tiles_a.data, builder.add(bytes_at, builder.add(ahead, ir.Constant(i64, line))))
        zeros_at = builder.select(shared_zeros, ir.Constant(i64, 0), columns_at)
        numbers_ahead = builder.ashr(ahead, ir.Constant(i64, 2))
        prefetch(scales_a.data, builder.add(columns_at, numbers_ahead))
        prefetch(zeros_a.data, builder.add(zeros_at, numbers_ahead))
        sums = [[nothing] * 4 for _ in rows]  # two chains of low and high nibbles a row: the adds overlap
        for j in range(CHUNK_BYTES):
            packed = builder.zext(vector(tiles_a.data, builder.add(bytes_at, ir.Constant(i64, TILE * j)),
                                         octets), words)
            lows = builder.uitofp(builder.and_(packed, fifteen), floats)
            highs = builder.uitofp(builder.lshr(packed, four), floats)
            position = builder.add(values_at, ir.Constant(i64, j))
            chain = 2 * (j & 1)
            for (low, high, _, _), row_sums in zip(rows, sums):
                row_sums[chain] = builder.call(fmuladd, [lows, broadcast(low, position), row_sums[chain]])
                row_sums[chain + 1] = builder.call(fmuladd, [highs, broadcast(high, position), row_sums[chain + 1]])
        scale = vector(scales_a.data, columns_at, floats)
        if zero_bytes:
            zero = builder.uitofp(builder.zext(vector(zeros_a.data, zeros_at, octets), words), floats)
        else:
            zero = vector(zeros_a.data, zeros_at, floats)
        for (_, _, row_chunk_sums, _), row_sums, total in zip(rows, sums, totals):
            chunk_sum = builder.fadd(builder.fadd(row_sums[0], row_sums[1]), builder.fadd(row_sums[2], row_sums[3]))
            zero_share = builder.fmul(builder.fmul(zero, scale), broadcast(row_chunk_sums, chunk))
            scaled = builder.call(fmuladd, [chunk_sum, scale, builder.load(total)])
            builder.store(builder.fsub(scaled, zero_share), total)
    for (_, _, _, out), total in zip(rows, totals):
        builder.store(builder.load(total), builder.bitcast(out, floats.as_pointer()), align=4)


@intrinsic
def _tile_dot(typingctx, tiles, low, high, sums, scales, zeros, tile, ahead, out):
    """out[:16] = one row times tile `tile`: in chunk order, each chunk c adds to the 16 columns'
    sums (sum over its 16 bytes j of low nibble * low[16 c + j] + high nibble * high[16 c + j])
    times the chunk's scale, less its zero point times its scale times the row's sum over the chunk
    (`sums[c]`). low, high: the row's values at even and odd positions; zeros: uint8 or float32,
    one row of 16 per chunk or (shape (1, 1, 16)) one for all; ahead: how many bytes of tiles ahead
    to prefetch; out: 16 contiguous float32."""
    signature = types.void(tiles, low, high, sums, scales, zeros, tile, ahead, out)
    zero_bytes = zeros.dtype == types.uint8

    def codegen(context, builder, sig, args):
        arrays = [context.make_array(kind)(context, builder, value)
                  for kind, value in zip(sig.args[:6] + sig.args[8:], args[:6] + args[8:])]
        tiles_a, low_a, high_a, sums_a, scales_a, zeros_a, out_a = arrays
        _emit_tiles(builder, tiles_a, scales_a, zeros_a, zero_bytes, args[6], args[7],
                    [(low_a.data, high_a.data, sums_a.data, out_a.data)])
        return context.get_dummy_value()

    return signature, codegen


# rows `_tiles_dot` takes over one unpacking of a tile, as many as the registers hold: each row's four
# chains of 16 sums and its total take 5 of AVX-512's 32 registers (4 rows: 20), 10 of AVX2's 16
# (its 16 sums are two registers), where 4 rows spilled to memory (2 rows: a 32-row prompt's
# products 1.2-1.3x faster on a Zen 3 core than 4)
GROUPED_ROWS = 4 if compiles_for("avx512f") else 2


@intrinsic
def _tiles_dot(typingctx, tiles, lanes, sums, scales, zeros, tile, ahead, out, row):
    """`_tile_dot` of rows row .. row + GROUPED_ROWS - 1 (lanes (M, 2, L), sums (M, C) and out (M, N),
    C-contiguous; the tile's 16 columns all in out), each tile byte unpacked once for all of them:
    every row's sums are its own `_tile_dot`'s, in the same order."""
    signature = types.void(tiles, lanes, sums, scales, zeros, tile, ahead, out, row)
    zero_bytes = zeros.dtype == types.uint8

    def codegen(context, builder, sig, args):
        tiles_a, lanes_a, sums_a, scales_a, zeros_a = (context.make_array(kind)(context, builder, value)
                                                       for kind, value in zip(sig.args[:5], args[:5]))
        out_a = context.make_array(sig.args[7])(context, builder, args[7])
        lane_width = builder.extract_value(lanes_a.shape, 2)
        chunks, columns = builder.extract_value(sums_a.shape, 1), builder.extract_value(out_a.shape, 1)
        column = builder.mul(args[5], ir.Constant(ir.IntType(64), TILE))
        rows = []
        for r in range(GROUPED_ROWS):
            m = builder.add(args[8], ir.Constant(ir.IntType(64), r))
            low = builder.gep(lanes_a.data, [builder.mul(m, builder.add(lane_width, lane_width))])
            rows.append((low, builder.gep(low, [lane_width]), builder.gep(sums_a.data, [builder.mul(m, chunks)]),
                         builder.gep(out_a.data, [builder.add(builder.mul(m, columns), column)])))
        _emit_tiles(builder, tiles_a, scales_a, zeros_a, zero_bytes, args[5], args[6], rows)
        return context.get_dummy_value()

    return signature, codegen


# a chunk of a tile unpacked once for many rows (`_unpack_chunk`): for each byte j its 16 low nibbles
# as floats at 32 j, its 16 high ones at 32 j + 16, then the chunk's 16 scales and their products
# with the zero points
_UNPACKED = 2 * CHUNK_BYTES * TILE + 2 * TILE


@intrinsic
def _unpack_chunk(typingctx, tiles, scales, zeros, tile, chunk, ahead, unpacked):
    """unpacked (`_UNPACKED` float32) = chunk `chunk` of tile `tile` as `_emit_tiles` converts it
    (the same instructions, so the same values), and each column's scale times its zero point."""
    signature = types.void(tiles, scales, zeros, tile, chunk, ahead, unpacked)
    zero_bytes = zeros.dtype == types.uint8

    def codegen(context, builder, sig, args):
        tiles_a, scales_a, zeros_a = (context.make_array(kind)(context, builder, value)
                                      for kind, value in zip(sig.args[:3], args[:3]))
        target = context.make_array(sig.args[6])(context, builder, args[6]).data
        tile, chunk, ahead = args[3], args[4], args[5]
        i32, i64 = ir.IntType(32), ir.IntType(64)
        floats, words = ir.VectorType(ir.FloatType(), TILE), ir.VectorType(i32, TILE)
        octets = ir.VectorType(ir.IntType(8), TILE)
        fifteen, four = ir.Constant(words, [15] * TILE), ir.Constant(words, [4] * TILE)

        def vector(pointer, index, kind):
            return builder.load(builder.bitcast(builder.gep(pointer, [index]), kind.as_pointer()), align=1)

        def put(value, at):
            builder.store(value, builder.bitcast(builder.gep(target, [ir.Constant(i64, at)]), floats.as_pointer()),
                          align=4)

        prefetch_function = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [ir.IntType(8).as_pointer(), i32, i32, i32]),
            "llvm.prefetch.p0i8")
        chunks = builder.extract_value(tiles_a.shape, 1)
        zero_rows = builder.mul(builder.extract_value(zeros_a.shape, 0), builder.extract_value(zeros_a.shape, 1))
        shared_zeros = builder.icmp_unsigned("==", zero_rows, ir.Constant(i64, 1))
        at = builder.add(builder.mul(tile, chunks), chunk)
        bytes_at = builder.mul(at, ir.Constant(i64, CHUNK_BYTES * TILE))
        columns_at = builder.mul(at, ir.Constant(i64, TILE))
        for line in range(0, CHUNK_BYTES * TILE, 64):  # (past the last tile: prefetches never fault)
            address = builder.gep(tiles_a.data, [builder.add(bytes_at, builder.add(ahead, ir.Constant(i64, line)))])
            builder.call(prefetch_function, [builder.bitcast(address, ir.IntType(8).as_pointer()),
                                             ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        for j in range(CHUNK_BYTES):
            packed = builder.zext(vector(tiles_a.data, builder.add(bytes_at, ir.Constant(i64, TILE * j)), octets),
                                  words)
            put(builder.uitofp(builder.and_(packed, fifteen), floats), 2 * TILE * j)
            put(builder.uitofp(builder.lshr(packed, four), floats), 2 * TILE * j + TILE)
        zeros_at = builder.select(shared_zeros, ir.Constant(i64, 0), columns_at)
        scale = vector(scales_a.data, columns_at, floats)
        if zero_bytes:
            zero = builder.uitofp(builder.zext(vector(zeros_a.data, zeros_at, octets), words), floats)
        else:
            zero = vector(zeros_a.data, zeros_at, floats)
        put(scale, 2 * CHUNK_BYTES * TILE)
        put(builder.fmul(zero, scale), 2 * CHUNK_BYTES * TILE + TILE)
        return context.get_dummy_value()

    return signature, codegen


@intrinsic
def _unpacked_dot(typingctx, unpacked, lanes, sums, chunk, out, column, row):
    """Row `row`'s share of `_tile_dot` from one chunk read as `_unpack_chunk`'s floats: out[row,
    column:column + 16] (the row's running total, taken as zero at chunk 0) gets the chunk's sums by
    the same chains and operations, in the same order, as `_emit_tiles`: the same bits. Each
    weight is an operand read from L1 by its multiply-add."""
    signature = types.void(unpacked, lanes, sums, chunk, out, column, row)

    def codegen(context, builder, sig, args):
        unpacked_a, lanes_a, sums_a = (context.make_array(kind)(context, builder, value)
                                       for kind, value in zip(sig.args[:3], args[:3]))
        out_a = context.make_array(sig.args[4])(context, builder, args[4])
        chunk, column, row = args[3], args[5], args[6]
        f32, i32, i64 = ir.FloatType(), ir.IntType(32), ir.IntType(64)
        floats = ir.VectorType(f32, TILE)
        fmuladd = cgutils.get_or_insert_function(builder.module, ir.FunctionType(floats, [floats] * 3),
                                                 "llvm.fmuladd.v16f32")
        nothing = ir.Constant(floats, [0.0] * TILE)
        undefined, first_lane = ir.Constant(floats, ir.Undefined), ir.Constant(ir.VectorType(i32, TILE), [0] * TILE)

        def broadcast(pointer, index):
            value = builder.insert_element(undefined, builder.load(builder.gep(pointer, [index])), ir.Constant(i32, 0))
            return builder.shuffle_vector(value, undefined, first_lane)

        def stored(at):
            pointer = builder.gep(unpacked_a.data, [ir.Constant(i64, at)])
            return builder.load(builder.bitcast(pointer, floats.as_pointer()), align=4)

        lane_width = builder.extract_value(lanes_a.shape, 2)
        chunks, columns = builder.extract_value(sums_a.shape, 1), builder.extract_value(out_a.shape, 1)
        low = builder.gep(lanes_a.data, [builder.mul(row, builder.add(lane_width, lane_width))])
        high = builder.gep(low, [lane_width])
        values_at = builder.mul(chunk, ir.Constant(i64, CHUNK_BYTES))
        sums = [nothing] * 4  # the chains of `_emit_tiles`
        for j in range(CHUNK_BYTES):
            position = builder.add(values_at, ir.Constant(i64, j))
            chain = 2 * (j & 1)
            sums[chain] = builder.call(fmuladd, [stored(2 * TILE * j), broadcast(low, position), sums[chain]])
            sums[chain + 1] = builder.call(fmuladd, [stored(2 * TILE * j + TILE), broadcast(high, position),
                                                     sums[chain + 1]])
        scale, zero_scale = stored(2 * CHUNK_BYTES * TILE), stored(2 * CHUNK_BYTES * TILE + TILE)
        total_at = builder.gep(out_a.data, [builder.add(builder.mul(row, columns), column)])
        total_at = builder.bitcast(total_at, floats.as_pointer())
        first = builder.icmp_unsigned("==", chunk, ir.Constant(i64, 0))
        total = builder.select(first, nothing, builder.load(total_at, align=4))
        chunk_sum = builder.fadd(builder.fadd(sums[0], sums[1]), builder.fadd(sums[2], sums[3]))
        zero_share = builder.fmul(zero_scale, broadcast(sums_a.data, builder.add(builder.mul(row, chunks), chunk)))
        scaled = builder.call(fmuladd, [chunk_sum, scale, total])
        builder.store(builder.fsub(scaled, zero_share), total_at, align=4)
        return context.get_dummy_value()

    return signature, codegen


@_kernel
def tile_rows_unpacked(lanes, sums, tiles, scales, zeros, out, first, stop):
    """`tile_rows` of whole tiles first .. stop, each chunk of a tile unpacked once into floats
    (`_unpack_chunk`, 2 KiB) that every row then reads from L1 (`_unpacked_dot`): a row's work on a
    chunk is 32 multiply-adds with a weight operand each, where over registers (`_tiles_dot`) AVX2's
    16 hold two rows' chains and every two rows unpack it again. The rows' running totals of a tile
    stay in a scratch of this call's, copied to out once the tile is done: updated after every chunk
    in out itself, they shared cache lines with the next unit's tiles on the other thread (a
    1536-deep weight's two-thread units 1.1x slower)."""
    rows, chunks = out.shape[0], tiles.shape[1]
    unpacked, totals = np.empty(_UNPACKED, np.float32), np.empty((rows, TILE), np.float32)
    for t in range(first, stop):
        for c in range(chunks):
            _unpack_chunk(tiles, scales, zeros, t, c, _ROWS_AHEAD, unpacked)
            for m in range(rows):
                _unpacked_dot(unpacked, lanes, sums, c, totals, 0, m)
        for m in range(rows):  # (element by element: numba's 2-d slice assignment took 5 s to compile)
            for i in range(TILE):
                out[m, t * TILE + i] = totals[m, i]


@_kernel
def tile_rows_grouped(lanes, sums, tiles, scales, zeros, out, first, stop):
    """`tile_rows` of whole tiles first .. stop, GROUPED_ROWS rows over each unpacking of a tile's
    bytes (`_tiles_dot`), the rest one by one."""
    rows = out.shape[0]
    ahead = _ROW_AHEAD if rows == 1 else _ROWS_AHEAD
    grouped = rows // GROUPED_ROWS * GROUPED_ROWS
    for t in range(first, stop):
        for m in range(0, grouped, GROUPED_ROWS):
            _tiles_dot(tiles, lanes, sums, scales, zeros, t, ahead, out, m)
        start = t * TILE
        for m in range(grouped, rows):
            _tile_dot(tiles, lanes[m, 0], lanes[m, 1], sums[m], scales, zeros, t, ahead, out[m, start:start + TILE])


# rows from which `tile_rows` unpacks each chunk of a tile once into floats that every row reads
# from L1 (`tile_rows_unpacked`) rather than unpacking it again each GROUPED_ROWS rows; 0: never.
# With AVX2's 16 registers two rows share an unpacking: a Zen 3 core, 8 to 32 rows' products took
# 0.73-0.93x the time unpacked, 4 rows 1.05x. AVX-512's four rows an unpacking were not measured
# against it
UNPACKED_ROWS = 0 if compiles_for("avx512f") else 8


@_kernel
def tile_rows(lanes, sums, tiles, scales, zeros, out, first, stop):
    """out (M, N) columns of tiles first .. stop = the rows (as `lanes` (M, 2, 16 chunks): even and
    odd positions, zero past K; `sums` (M, chunks)) times the repacked weights (module docstring),
    GROUPED_ROWS rows at a time over one unpacking of a tile's bytes, or from UNPACKED_ROWS rows each
    chunk unpacked once for all: the same bits as row by row. All arrays C-contiguous float32 but the
    uint8 tiles (and zeros, uint8 or float32)."""
    rows, columns = out.shape
    ahead = _ROW_AHEAD if rows == 1 else _ROWS_AHEAD
    whole = max(first, min(stop, columns // TILE))  # (tiles first .. whole have 16 columns)
    if UNPACKED_ROWS and rows >= UNPACKED_ROWS:
        tile_rows_unpacked(lanes, sums, tiles, scales, zeros, out, first, whole)
    else:
        tile_rows_grouped(lanes, sums, tiles, scales, zeros, out, first, whole)
    for t in range(whole, stop):  # the last tile's padding columns go to scratch (allocated here only: a unit each job)
        start = t * TILE
        count = min(TILE, columns - start)
        for m in range(rows):
            scratch = np.empty(TILE, np.float32)
            _tile_dot(tiles, lanes[m, 0], lanes[m, 1], sums[m], scales, zeros, t, ahead, scratch)
            out[m, start:columns] = scratch[:count]


@intrinsic
def _transpose_block(typingctx, source, source_at, source_step, target, target_at, target_step):
    """target[target_at + target_step j + i] = source[source_at + source_step i + j] for i, j < 16
    (flat uint8 arrays): a 16 x 16 block of bytes transposed in vector registers, four rounds of
    interleaving row i with row i + 8 (which LLVM lowers to byte unpacks), where a strided copy moves
    one byte at a time (a 4-bit weight's bytes into its tiles: 4x faster than numpy's transposing
    copy)."""
    signature = types.void(source, source_at, source_step, target, target_at, target_step)

    def codegen(context, builder, sig, args):
        source_a = context.make_array(sig.args[0])(context, builder, args[0])
        target_a = context.make_array(sig.args[3])(context, builder, args[3])
        octets = ir.VectorType(ir.IntType(8), TILE)
        rows = []
        for i in range(TILE):
            at = builder.add(args[1], builder.mul(args[2], ir.Constant(ir.IntType(64), i)))
            pointer = builder.bitcast(builder.gep(source_a.data, [at]), octets.as_pointer())
            rows.append(builder.load(pointer, align=1))
        low = ir.Constant(ir.VectorType(ir.IntType(32), TILE), [k // 2 + TILE * (k % 2) for k in range(TILE)])
        high = ir.Constant(ir.VectorType(ir.IntType(32), TILE), [TILE // 2 + k // 2 + TILE * (k % 2)
                                                                  for k in range(TILE)])
        for _ in range(4):  # (16 = 2 ** 4: after four rounds row j holds column j)
            half = TILE // 2
            rows = [builder.shuffle_vector(rows[i // 2], rows[i // 2 + half], high if i % 2 else low)
                    for i in range(TILE)]
        for j, row in enumerate(rows):
            at = builder.add(args[4], builder.mul(args[5], ir.Constant(ir.IntType(64), j)))
            builder.store(row, builder.bitcast(builder.gep(target_a.data, [at]), octets.as_pointer()), align=1)
        return context.get_dummy_value()
    return signature, codegen


@_kernel
def transpose_tiles(weights, tiles):
    """tiles[t, c, j, i] = weights[16 t + i, c, j] for every whole tile t of tiles (T, chunks, 16, 16)
    (a weight's bytes (N, chunks, 16), N >= 16 T): both flat, C-contiguous uint8."""
    source, target = weights.reshape(-1), tiles.reshape(-1)
    if source.size < tiles.shape[0] * TILE * tiles.shape[1] * CHUNK_BYTES:
        raise ValueError("weights hold fewer columns than the tiles")
    _transpose_whole(source, target, tiles.shape[0], tiles.shape[1])


@_kernel
def _transpose_whole(source, target, count, chunks):
    """`transpose_tiles` of flat arrays: the first `count` whole tiles of `chunks` chunks."""
    step = chunks * CHUNK_BYTES
    for t in range(count):
        for c in range(chunks):
            _transpose_block(source, (t * TILE * chunks + c) * CHUNK_BYTES, step, target,
                             (t * chunks + c) * CHUNK_BYTES * TILE, TILE)


@_kernel
def repack(weights, block_scales, packed_zeros, typed_zeros, zero_mode, tiles, scales, byte_zeros, float_zeros):
    """weights (N, blocks, blob) uint8, C-contiguous, with a scale per block (block_scales: flat, N x
    blocks) into the tile layout (module docstring): tiles (T, chunks, 16, 16), scales (T, chunks, 16)
    and the zero points, by zero_mode: ZERO_PACKED's 4-bit ones (packed_zeros: two a byte, each
    column's bytes starting afresh) into byte_zeros (T, chunks, 16) uint8, ZERO_TYPED's (typed_zeros:
    flat, N x blocks) into float_zeros (T, chunks, 16), ZERO_DEFAULT's none (they share one row the
    caller fills). Every element of tiles, scales and the zeros written is set, the last tile's
    padding columns zero, so all may come from np.empty. One native call with no numpy between its
    parts: a prepacking thread makes a model's tiles holding the GIL for nothing but their buffers."""
    columns, blocks, blob = weights.shape
    count, chunks = tiles.shape[0], tiles.shape[1]
    if count * TILE < columns or chunks * CHUNK_BYTES != blocks * blob or blob % CHUNK_BYTES:
        raise ValueError("tiles of another shape than the weights'")
    per = blob // CHUNK_BYTES  # chunks a block: its scale and zero point repeat for each
    block_bytes = np.empty((columns, blocks) if zero_mode == ZERO_PACKED else (0, blocks), np.uint8)
    block_zero_points(packed_zeros, typed_zeros, zero_mode, 4, 0, blocks, block_bytes)
    source, target = weights.reshape(-1), tiles.reshape(-1)
    whole = columns // TILE
    _transpose_whole(source, target, whole, chunks)
    step = chunks * CHUNK_BYTES
    for t in range(whole, count):  # the last tile, its columns past N zero
        for c in range(chunks):
            for j in range(CHUNK_BYTES):
                for i in range(TILE):
                    n = t * TILE + i
                    tiles[t, c, j, i] = source[n * step + c * CHUNK_BYTES + j] if n < columns else 0
    for t in range(count):
        for c in range(chunks):
            block = c // per
            for i in range(TILE):
                n = t * TILE + i
                scales[t, c, i] = block_scales[n * blocks + block] if n < columns else 0
                if zero_mode == ZERO_PACKED:
                    byte_zeros[t, c, i] = block_bytes[n, block] if n < columns else 0
                elif zero_mode == ZERO_TYPED:
                    float_zeros[t, c, i] = typed_zeros[n * blocks + block] if n < columns else 0


# the columns of a `repack_listed` table: where each input lies (which source, at which byte) and its
# sizes, where each output lies in the arena, and which inputs go back to their file once the item is
# made (`HAND_BACK`: bits W_BACK, S_BACK, Z_BACK)
(W_SOURCE, W_AT, COLUMNS, BLOCKS, BLOB, S_SOURCE, S_AT, ZERO_MODE, Z_SOURCE, Z_AT, Z_COUNT,
 TILE_COUNT, CHUNKS, TILES_AT, SCALES_AT, ZEROS_AT, HAND_BACK, LISTED) = range(18)
W_BACK, S_BACK, Z_BACK = 1, 2, 4
# madvise's advice that hands a map's pages back (a file's: read again from it if anything reads them)
_DONTNEED = getattr(mmap, "MADV_DONTNEED", None) if sys.platform.startswith("linux") else None
_PAGE = mmap.PAGESIZE
# an item's state in `repack_listed`: FREE, the maker's number (1-255) while it makes it, then that
# number with MADE or REFUSED (repack raised) added: who made each item stays readable
FREE, MADE, REFUSED = 0, 256, 512
# polls (each a `pause`) a thread waiting for another's item spins before it sleeps between polls
# (`nap`): three threads on two cores (a run, its pool's worker, the prepacking thread), a run
# spinning kept the thread making its item off the cores for several milliseconds at a time
_SPINS = 256


@_kernel
def repack_listed(sources, table, arena, states, first, count, maker):
    """`repack` for each item k of first..first+count of `table` (a row an item, `LISTED` columns)
    that no other thread has claimed (states[k] FREE -> `maker` by compare-and-swap, then maker +
    MADE, or + REFUSED when repack raises), then waits until every one of them is made or
    refused; whether all were made. Its inputs are byte ranges of `sources` (read-only uint8
    buffers: a model's mapped data file or weight arena, and what had to be staged beside it), its
    outputs byte ranges of `arena`: a whole model's weights take one call, no array a weight, no
    GIL between them. A prepacking thread and a run reaching the same weights share their items,
    none made twice, and each returns with all of them made: the run waits only for the items the
    other thread is making. Once an item is made, the inputs its row marks (`HAND_BACK`) give their
    pages back to the file they are mapped from, one weight after another: a model's weights and
    their tiles are never all in memory at once."""
    for k in range(first, first + count):
        if compare_and_swap(states, k, FREE, maker):
            state = MADE
            try:
                _repack_row(sources, table[k], arena)
            except Exception:  # (a run making these tiles alone raises it, with its checks)
                state = REFUSED
            if state == MADE:
                _hand_back_row(sources, table[k])
            store(states, k, maker + state)
    made = True
    for k in range(first, first + count):
        polls = 0
        while load(states, k) < MADE:  # an item takes 0.1-1 ms: spin a little, then sleep between polls
            polls += 1
            if polls < _SPINS:
                pause()
            else:
                nap()
        made &= load(states, k) & MADE != 0
    return made


@numba.njit(cache=True, nogil=True, error_model="numpy", inline="always")
def _bytes(buffer, at, length):
    return buffer[at:at + length]


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _repack_row(sources, row, arena):
    """`repack` of one row of a `repack_listed` table, its arrays viewed from their byte ranges."""
    columns, blocks, blob = row[COLUMNS], row[BLOCKS], row[BLOB]
    count, chunks, mode = row[TILE_COUNT], row[CHUNKS], row[ZERO_MODE]
    weights = _bytes(sources[row[W_SOURCE]], row[W_AT], columns * blocks * blob).reshape((columns, blocks, blob))
    block_scales = _bytes(sources[row[S_SOURCE]], row[S_AT], 4 * columns * blocks).view(np.float32)
    zeros = sources[row[Z_SOURCE]]
    packed = _bytes(zeros, row[Z_AT], row[Z_COUNT] if mode == ZERO_PACKED else 0)
    typed = _bytes(zeros, row[Z_AT], 4 * row[Z_COUNT] if mode == ZERO_TYPED else 0).view(np.float32)
    size = count * chunks * TILE
    tiles = _bytes(arena, row[TILES_AT], size * CHUNK_BYTES).reshape((count, chunks, CHUNK_BYTES, TILE))
    scales = _bytes(arena, row[SCALES_AT], 4 * size).view(np.float32).reshape((count, chunks, TILE))
    rows = count if mode == ZERO_PACKED else 0
    byte_zeros = _bytes(arena, row[ZEROS_AT], rows * chunks * TILE).reshape((rows, chunks, TILE))
    rows = count if mode == ZERO_TYPED else 0
    float_zeros = _bytes(arena, row[ZEROS_AT], 4 * rows * chunks * TILE).view(np.float32).reshape((rows, chunks, TILE))
    repack(weights, block_scales, packed, typed, mode, tiles, scales, byte_zeros, float_zeros)


def tile_lanes_panel(tiles, scales, zeros, first, out):
    """out (P, K) float32 = the columns first .. first + P of a 4-bit weight's tiles (`repack`'s
    layout, read as they are kept) dequantized in lanes order: the values
    `_kernels_contrib.nibble_lanes_panel` gives from the weight's own blocks, bitwise ((q - zero) *
    scale in float32 for integer zero points, in float64 rounded once for float ones), so that a
    prompt's product over such panels is the product over the original layout's. A weight whose
    tiles are kept is then never read in its own layout again (`nibble_tiles.py`)."""
    if zeros.dtype == np.float32:
        _tile_lanes_wide(tiles, scales, zeros, first, out)
    else:
        _tile_lanes_narrow(tiles, scales, zeros, first, out)


@_kernel
def _tile_columns(flat, chunks, t, used, columns):
    """columns[i, :used * 16] = the bytes of column 16 t + i in the weight's own layout (its `used`
    first chunks), each chunk of the tile transposed back (`_transpose_block`)."""
    step = columns.shape[1]
    target = columns.reshape(-1)
    for c in range(used):
        _transpose_block(flat, (t * chunks + c) * CHUNK_BYTES * TILE, TILE, target, c * CHUNK_BYTES, step)


@_kernel
def _tile_lanes_narrow(tiles, scales, zeros, first, out):
    """`tile_lanes_panel` for uint8 zero points (a model's own, or the default's shared row): a
    tile's columns back in their own layout (`_tile_columns`), then each column's blocks into its
    low and high lanes, as `nibble_lanes_panel` unpacks them."""
    pairs, odd = out.shape[1] >> 1, out.shape[1] & 1
    lows, chunks, stop = pairs + odd, tiles.shape[1], first + out.shape[0]
    used = min(chunks, (lows + CHUNK_BYTES - 1) // CHUNK_BYTES)
    flat, columns = tiles.reshape(-1), np.empty((TILE, used * CHUNK_BYTES), np.uint8)
    whole = pairs // CHUNK_BYTES  # chunks whose every byte holds two values
    span = columns.shape[1] // used  # (CHUNK_BYTES)
    for t in range(first // TILE, (stop + TILE - 1) // TILE):
        _tile_columns(flat, chunks, t, used, columns)
        zt = t if zeros.shape[0] > 1 else 0
        for i in range(max(first - t * TILE, 0), min(stop - t * TILE, TILE)):
            row, column = out[t * TILE + i - first], columns[i]
            low, high = row[:lows], row[lows:]
            for c in range(whole):
                z = np.float32(zeros[zt, c if zeros.shape[1] > 1 else 0, i])
                s = scales[t, c, i]
                start = c * span
                for j in range(start, start + span):  # (a trip count LLVM vectorises, not unrolls)
                    byte = np.int32(column[j])
                    low[j] = (np.float32(byte & np.int32(15)) - z) * s
                    high[j] = (np.float32(byte >> np.int32(4)) - z) * s
            if whole < used:  # the last values (an odd K: one low more)
                z = np.float32(zeros[zt, whole if zeros.shape[1] > 1 else 0, i])
                s = scales[t, whole, i]
                for j in range(whole * CHUNK_BYTES, lows):
                    byte = np.int32(column[j])
                    low[j] = (np.float32(byte & np.int32(15)) - z) * s
                    if j < pairs:
                        high[j] = (np.float32(byte >> np.int32(4)) - z) * s


@_kernel
def _tile_lanes_wide(tiles, scales, zeros, first, out):
    """`tile_lanes_panel` for float32 zero points: `_lanes_panel_wide`'s arithmetic."""
    pairs, odd = out.shape[1] >> 1, out.shape[1] & 1
    lows, chunks, stop = pairs + odd, tiles.shape[1], first + out.shape[0]
    used = min(chunks, (lows + CHUNK_BYTES - 1) // CHUNK_BYTES)
    flat, columns = tiles.reshape(-1), np.empty((TILE, used * CHUNK_BYTES), np.uint8)
    for t in range(first // TILE, (stop + TILE - 1) // TILE):
        _tile_columns(flat, chunks, t, used, columns)
        for i in range(max(first - t * TILE, 0), min(stop - t * TILE, TILE)):
            row, column = out[t * TILE + i - first], columns[i]
            for j in range(lows):
                c = j // CHUNK_BYTES
                z, s = np.float64(zeros[t, c, i]), np.float64(scales[t, c, i])
                byte = np.int32(column[j])
                row[j] = (np.float64(byte & np.int32(15)) - z) * s
                if j < pairs:
                    row[lows + j] = (np.float64(byte >> np.int32(4)) - z) * s


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _hand_back_row(sources, row):
    """The pages of the inputs of a made item that its row marks (`HAND_BACK`) handed back."""
    back, mode = row[HAND_BACK], row[ZERO_MODE]
    if back & W_BACK:
        _hand_back(sources[row[W_SOURCE]], row[W_AT], row[COLUMNS] * row[BLOCKS] * row[BLOB])
    if back & S_BACK:
        _hand_back(sources[row[S_SOURCE]], row[S_AT], 4 * row[COLUMNS] * row[BLOCKS])
    if back & Z_BACK:
        _hand_back(sources[row[Z_SOURCE]], row[Z_AT], row[Z_COUNT] * (4 if mode == ZERO_TYPED else 1))


@intrinsic
def _hand_back(typingctx, buffer, at, length):
    """madvise(MADV_DONTNEED) over the whole pages inside bytes at .. at + length of `buffer` (uint8,
    read-only), which the caller knows to be a file's map (`_tile_listing.listed`: its pages are read
    from the file again should anything read them); nothing for a range outside the buffer, nor
    where there is no such advice. The pointer is the buffer's own, moved by a byte count."""
    signature = types.void(buffer, at, length)

    def codegen(context, builder, sig, args):
        if _DONTNEED is None:
            return context.get_dummy_value()
        i32, i64, i8_pointer = ir.IntType(32), ir.IntType(64), ir.IntType(8).as_pointer()
        array = context.make_array(sig.args[0])(context, builder, args[0])
        at, length = args[1], args[2]
        size = builder.extract_value(array.shape, 0)
        inside = builder.and_(builder.icmp_signed(">=", at, ir.Constant(i64, 0)),
                              builder.icmp_signed("<=", builder.add(at, length), size))
        base = builder.ptrtoint(array.data, i64)
        mask = ir.Constant(i64, ~(_PAGE - 1))
        first = builder.sub(builder.and_(builder.add(builder.add(base, at), ir.Constant(i64, _PAGE - 1)), mask), base)
        stop = builder.sub(builder.and_(builder.add(builder.add(base, at), length), mask), base)
        with builder.if_then(builder.and_(inside, builder.icmp_signed(">", stop, first))):
            madvise = cgutils.get_or_insert_function(builder.module, ir.FunctionType(i32, [i8_pointer, i64, i32]),
                                                     "madvise")
            pointer = builder.bitcast(builder.gep(array.data, [first]), i8_pointer)
            builder.call(madvise, [pointer, builder.sub(stop, first), ir.Constant(i32, _DONTNEED)])
        return context.get_dummy_value()
    return signature, codegen
