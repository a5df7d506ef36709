"""4-bit products of a few rows over weights repacked in tiles of 16 columns (their layout,
its making and the panels read back from it: `_kernels_nibble_layout.py`).

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
"""
from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from runnx.ops import _jit_cache  # noqa: F401  (numba caches this module's kernels under RUNNX_CACHE)
from runnx.ops._kernels_gemm import copy_block
from runnx.ops._vector_width import compiles_for

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
        copy_block(totals, 0, 0, out, 0, t * TILE, rows, TILE)


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
# 0.73-0.93x the time unpacked, 4 rows 1.05x. With AVX-512's four rows an unpacking, unpacked was
# slower on a Xeon core: 1.15-1.21x the time at 32 rows, 1.24-1.35x at 8 and 16, 1.44x at 4
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
