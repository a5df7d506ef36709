"""Exact 8-bit products of a few rows through the CPU's 8-bit dot-product instruction (AVX-512
VNNI's `vpdpbusd`: 64 multiply-adds of unsigned by signed bytes, four into each of 16 int32 sums).

A decoding MatMulInteger multiplies one row of 8-bit activations by an 8-bit weight. Widening
each byte to 32 bits before its multiply (`_kernels_integer.integer_rows`, any CPU) runs at a few
billion multiply-adds a second; `vpdpbusd` multiplies and sums four bytes at a time without
widening. Integer sums are exact in any order (int32 additions wrap alike in any order), so the
results are bitwise those of the widening kernel, which the tests check.

The weight (K, N) is repacked once (`repack`) in tiles of 16 columns: tiles[t, g, i] holds the 4
bytes k = 4 g .. 4 g + 3 of column 16 t + i, made signed (an unsigned weight has 128 taken from
each byte: its sign bit flipped), K padded to a multiple of 4 and N to one of 16 with zeros. A
row's bytes are made unsigned alike (a signed row gets 128 added), and the zero points take the
offsets: (a - za)(b - zb) = (a' - za')(b' - zb') with za' = za + 128 for a signed row and
zb' = zb - 128 for an unsigned weight; the zero points then come out of the sum as in
`integer_rows`. The product runs as the decode pool's job (`runtime/jobs.post_vnni`: the rows
made unsigned, the tiles' sums, then the zero points), with workers or alone. Only CPUs with
AVX-512 VNNI take this path (`AVAILABLE`); LLVM has no portable form of the instruction, so
elsewhere the kernel compiles the same sums in generic IR (the pool's unit kernel compiles every
kind of unit on any CPU: the instruction itself would abort LLVM there).
"""
from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from runnx.ops import _jit_cache  # noqa: F401  (numba caches this module's kernels under RUNNX_CACHE)
from runnx.ops._vector_width import compiles_for

TILE = 16  # columns a tile: one 512-bit vector of int32 sums


AVAILABLE = compiles_for("avx512f", "avx512bw", "avx512vnni")

_kernel = numba.njit(cache=True, nogil=True, error_model="numpy")


def _dot(builder, sums, row, weights):
    """sums + `vpdpbusd`(row, weights) in each of the 16 int32 lanes: the instruction where numba
    compiles for AVX-512 VNNI (`AVAILABLE`), else the same sums in generic IR (each lane's four
    unsigned bytes of row times its four signed bytes of weights, widened to int32 and added to the
    lane's sum): the pool's unit kernel compiles every kind of unit on any CPU, though only a CPU
    with the instruction posts this kind."""
    if AVAILABLE:
        instruction = cgutils.get_or_insert_function(builder.module, ir.FunctionType(sums.type, [sums.type] * 3),
                                                     "llvm.x86.avx512.vpdpbusd.512")
        return builder.call(instruction, [sums, row, weights])
    count = TILE * 4
    wide = ir.VectorType(ir.IntType(32), count)
    unsigned = builder.zext(builder.bitcast(row, ir.VectorType(ir.IntType(8), count)), wide)
    signed = builder.sext(builder.bitcast(weights, ir.VectorType(ir.IntType(8), count)), wide)
    products = builder.mul(unsigned, signed)
    for byte in range(4):
        picked = ir.Constant(ir.VectorType(ir.IntType(32), TILE), [4 * lane + byte for lane in range(TILE)])
        sums = builder.add(sums, builder.shuffle_vector(products, products, picked))
    return sums


@intrinsic
def _tile_sums(typingctx, tiles, words, tile, out):
    """out[:16] (int32) = one row's unsigned bytes (as int32 words of 4, `words`) times tile
    `tile`'s signed bytes, summed over all of K: four chains of `vpdpbusd`, added at the end."""
    signature = types.void(tiles, words, tile, out)

    def codegen(context, builder, sig, args):
        tiles_a, words_a, out_a = (context.make_array(sig.args[i])(context, builder, args[i]) for i in (0, 1, 3))
        i32, i64 = ir.IntType(32), ir.IntType(64)
        lanes = ir.VectorType(i32, TILE)
        groups = builder.extract_value(tiles_a.shape, 1)
        chains = [cgutils.alloca_once_value(builder, ir.Constant(lanes, [0] * TILE)) for _ in range(4)]
        first_group = builder.mul(args[2], groups)
        undefined, first_lane = ir.Constant(lanes, ir.Undefined), ir.Constant(lanes, [0] * TILE)
        with cgutils.for_range_slice(builder, ir.Constant(i64, 0), groups, ir.Constant(i64, 4)) as (start, _):
            for chain in range(4):
                group = builder.add(start, ir.Constant(i64, chain))
                with builder.if_then(builder.icmp_signed("<", group, groups)):
                    word = builder.load(builder.gep(words_a.data, [group]))
                    row = builder.shuffle_vector(builder.insert_element(undefined, word, ir.Constant(i32, 0)),
                                                 undefined, first_lane)
                    at = builder.mul(builder.add(first_group, group), ir.Constant(i64, 4 * TILE))
                    weights = builder.load(builder.bitcast(builder.gep(tiles_a.data, [at]), lanes.as_pointer()),
                                           align=1)
                    builder.store(_dot(builder, builder.load(chains[chain]), row, weights), chains[chain])
        total = builder.add(builder.add(builder.load(chains[0]), builder.load(chains[1])),
                            builder.add(builder.load(chains[2]), builder.load(chains[3])))
        builder.store(total, builder.bitcast(out_a.data, lanes.as_pointer()), align=4)
        return context.get_dummy_value()

    return signature, codegen


@_kernel
def repack(b, flip, tiles, column_sums):
    """b (K, N) 8-bit into zero-filled tiles (N / 16, K / 4, 16, 4) of signed bytes (the sign bit
    flipped when `flip`: an unsigned weight), and column_sums (N,) int32 of those signed values.
    Whole tiles four rows of b at a time, written as one interleaved store a column (3x the bytes a
    second of a byte-by-byte loop: a model's weights are repacked on its first decode step)."""
    depth, columns = b.shape
    offset = np.uint8(128 if flip else 0)
    whole_tiles, whole_groups = columns // TILE, depth // 4
    for t in range(whole_tiles):
        first = t * TILE
        for g in range(whole_groups):
            r0, r1 = b[4 * g, first:first + TILE], b[4 * g + 1, first:first + TILE]
            r2, r3 = b[4 * g + 2, first:first + TILE], b[4 * g + 3, first:first + TILE]
            out = tiles[t, g]
            for i in range(TILE):
                out[i, 0] = np.uint8(r0[i]) ^ offset
                out[i, 1] = np.uint8(r1[i]) ^ offset
                out[i, 2] = np.uint8(r2[i]) ^ offset
                out[i, 3] = np.uint8(r3[i]) ^ offset
    for k in range(depth):  # the edges: a last part of a tile or of a group of four rows
        for n in range(whole_tiles * TILE if k < whole_groups * 4 else 0, columns):
            tiles[n // TILE, k >> 2, n % TILE, k & 3] = np.uint8(b[k, n]) ^ offset
    column_sums[:] = 0
    for k in range(depth):
        for n in range(columns):
            column_sums[n] += np.int32(np.int8(np.uint8(b[k, n]) ^ offset))


@_kernel
def unsigned_rows(a, flip, groups):
    """(words (M, groups) int32: each row's bytes made unsigned (128 added when `flip`: signed
    rows), zero-padded to 4 groups, four to a word; row_sums (M,) int32 of those bytes)."""
    rows, depth = a.shape
    offset = np.uint8(128 if flip else 0)
    padded = np.zeros((rows, groups * 4), np.uint8)
    row_sums = np.zeros(rows, np.int32)
    for m in range(rows):
        for k in range(depth):
            padded[m, k] = np.uint8(a[m, k]) ^ offset
            row_sums[m] += np.int32(padded[m, k])
    return padded.view(np.int32), row_sums


@_kernel
def tile_sums_into(tiles, words, raw, first, stop):
    """raw[m, 16 t: 16 t + 16] = row m's words times tile t, for the tiles first .. stop."""
    for t in range(first, stop):
        for m in range(words.shape[0]):
            _tile_sums(tiles, words[m], t, raw[m, t * TILE:(t + 1) * TILE])


@_kernel
def with_zero_points(raw, depth, row_sums, column_sums, a_zero, b_zero, out):
    """out (M, N) = raw sums less the zero points' share (module docstring), in int32 arithmetic."""
    for m in range(out.shape[0]):
        za = a_zero[m]
        shift = np.int32(depth * za)
        for n in range(out.shape[1]):
            zb = b_zero[n]
            out[m, n] = np.int32(np.int32(raw[m, n] - np.int32(za * column_sums[n]))
                                 - np.int32(np.int32(zb * row_sums[m]) - np.int32(shift * zb)))
