"""The 4-bit tiles' layout (`_kernels_nibble_tiles.py` multiplies over it): a weight's bytes
repacked into tiles (`repack`; a model's weights in one call, `repack_listed`, their own bytes handed
back to their file once made), and a prompt's panels dequantized from the tiles (`tile_lanes_panel`),
so that a weight whose tiles are made is never read in its own layout again.

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
from runnx.ops._kernels_nibble_tiles import CHUNK_BYTES, TILE
from runnx.runtime.atomics import compare_and_swap, load, nap, pause, store

_kernel = numba.njit(cache=True, nogil=True, error_model="numpy")


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
