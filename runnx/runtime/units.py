"""What one unit of each decode-pool job kind computes, read from its job (`board.py`: the mailbox
and the arrays it holds; `slots.py` says where each is). A unit gives the same result whichever thread computes it:
- products: first one row chunk of one product into its partial rows (`rows_times_matrix`'s
  chunks, `ops/_kernels_linalg.py`; float32 entries, or 8-bit ones read through a zero point and
  scale), then (the second phase) one block of an output's columns, its partial rows added in
  chunk order;
- attention: first one (batch entry, KV head, span of the cache), `attention_span` of
  `ops/_kernels_fused.py`, then (the second phase) one (batch entry, KV head)'s spans combined;
- 4-bit products: `NBITS_TILES` tiles of 16 output columns (`tile_rows`, `ops/_kernels_nibble_tiles.py`),
  each column computed whole by one unit;
- 8-bit products: `VNNI_TILES` tiles of 16 output columns (`tile_sums_into`, `ops/_kernels_vnni.py`);
- rows: `ROW_BLOCK` rows of a row kernel (softmax or GELU, `ops/_kernels_rows.py`);
- a prompt's float32 products of one input: `GEMM_UNIT` columns of one of them (`product_columns`,
  `ops/_kernels_gemm.py`, whose elements are summed alike for any split of the columns), its scratch
  its own;
- a prompt's attention: one block of query positions of one (batch entry, KV head) against the keys
  it sees (`attend_block`, `ops/_kernels_attention_blocks.py`), its scratch its own.
"""
from __future__ import annotations

import numba
import numpy as np

from runnx.ops import _jit_cache  # noqa: F401  (numba caches this module's kernels under RUNNX_CACHE)
from runnx.ops._kernels_attention_blocks import attend_block, block_limit
from runnx.ops._kernels_fused import attention_combine, attention_span
from runnx.ops._kernels_gemm import (KC, MC, MR, NR, STREAMED_COLUMNS, STREAMED_SPAN, product_columns, streamed_rows,
                                     streams)
from runnx.ops._kernels_linalg import chunk_bounds, columns_into, rows_into, rows_into_bytes
from runnx.ops._kernels_nibble_tiles import CHUNK_BYTES, TILE, tile_rows
from runnx.ops._kernels_rows import gelu_rows_float32, softmax_rows_float32
from runnx.ops._kernels_vnni import tile_sums_into
from runnx.ops._array_types import shaped, typed_contiguous
from runnx.runtime.atomics import float64_from_bits, load
from runnx.runtime.board import bytes_at, floats_at, grid_at, words_of
from runnx.runtime.slots import (ATTENDED, ATTENTION, BIAS, BLOCKS, BLOCK_BIAS, BLOCK_ENDS, BLOCK_FILL, BLOCK_HAS_BIAS,
                                 BLOCK_KEY, BLOCK_OUT, BLOCK_PER, BLOCK_POSITIONS, BLOCK_QUERY, BLOCK_VALUE, CHUNKS,
                                 COLUMNS, DEPTH, ENTRIES, ENTRY_SCALE, ENTRY_ZERO, FILL, FIRST_MATRIX, FIRST_PHASE,
                                 FLOATS, FLOATS_PER_MATRIX, GEMM, GEMM_A, GEMM_COLUMNS_GIVEN, GEMM_COUNT, GEMM_DEPTH,
                                 GEMM_FIRST_UNIT, GEMM_PARTS, GEMM_PER_PART, GEMM_ROWS, GEMM_UNIT, GEMM_WIDTH, GROUPS,
                                 HAS_BIAS, HEIGHT, KEY, MATRICES, MATRIX, NBITS, NBITS_BYTE_ZEROS, NBITS_CHUNKS,
                                 NBITS_FLOAT_ZEROS, NBITS_LANES, NBITS_OUT, NBITS_ROWS, NBITS_SCALES, NBITS_SUMS,
                                 NBITS_TILES, NBITS_TILES_AT, NBITS_TILE_COUNT, NBITS_WIDTH, NBITS_ZERO_BYTES,
                                 NBITS_ZERO_ROWS, OUT, PARTIALS, PARTIAL_SUMS, PER_MATRIX, PRODUCTS, QUERY, ROW,
                                 ROWS_BIAS, ROWS_IN, ROWS_OUT, ROW_ARGUMENTS, ROW_BLOCK, ROW_COLUMNS, ROW_COUNT,
                                 ROW_KERNEL, SCALE, SOFTMAX_ROWS, SPAN_STATS, SUM_BLOCK, UNSIGNED, VALUE, VNNI,
                                 VNNI_GROUPS, VNNI_RAW, VNNI_ROWS, VNNI_TILES, VNNI_TILES_AT, VNNI_TILE_COUNT,
                                 VNNI_WORDS, WIDTH)

_jit = numba.njit(cache=True, nogil=True, error_model="numpy")


@_jit
def _product_chunk(job, index):
    """Unit `index` of a products job: one row chunk of one product into its partial rows."""
    box = words_of(job)
    height, depth, chunks = load(box, HEIGHT), load(box, DEPTH), load(box, CHUNKS)
    m = index // chunks
    slots, held = MATRICES + PER_MATRIX * m, FIRST_MATRIX + FLOATS_PER_MATRIX * m
    width = load(box, slots + WIDTH)
    rows = shaped(floats_at(job, ROW), (height, depth), np.float32)
    entries = load(box, slots + ENTRIES)
    if entries == COLUMNS:  # a range of columns of one matrix given by them, into the output whole
        first, stop = chunk_bounds(width, chunks, index % chunks)
        columns_into(rows, shaped(floats_at(job, held + MATRIX), (width, depth), np.float32),
                     shaped(floats_at(job, held + OUT), (height, width), np.float32), first, stop)
        return
    partials = shaped(floats_at(job, held + PARTIALS), (chunks, height, width), np.float32)
    chunk = index % chunks
    start, stop = chunk_bounds(depth, chunks, chunk)
    if entries == FLOATS:
        rows_into(rows, shaped(floats_at(job, held + MATRIX), (depth, width), np.float32), partials[chunk], start, stop)
        return
    zero = np.float32(float64_from_bits(load(box, slots + ENTRY_ZERO)))
    scale = np.float32(float64_from_bits(load(box, slots + ENTRY_SCALE)))
    if entries == UNSIGNED:
        rows_into_bytes(rows, shaped(bytes_at(job, m), (depth, width), np.uint8), zero, scale, partials[chunk], start,
                        stop)
    else:
        rows_into_bytes(rows, shaped(bytes_at(job, m), (depth, width), np.int8), zero, scale, partials[chunk], start,
                        stop)


@_jit
def _sum_block(job, index):
    """Unit `index` of a sums job: one block of columns of one product, its partial rows added in
    chunk order (`add_partials_into`'s order, so the same result as on one thread), each block of a
    chunk's partial rows (all rows of the product in turn) a contiguous vector."""
    box = words_of(job)
    height, chunks = load(box, HEIGHT), load(box, CHUNKS)
    slots, held = MATRICES, FIRST_MATRIX
    width = height * load(box, slots + WIDTH)
    blocks = (width + SUM_BLOCK - 1) // SUM_BLOCK
    while index >= blocks:  # the units run through the products' blocks in turn
        index -= blocks
        slots += PER_MATRIX
        held += FLOATS_PER_MATRIX
        width = height * load(box, slots + WIDTH)
        blocks = (width + SUM_BLOCK - 1) // SUM_BLOCK
    start = index * SUM_BLOCK
    size = min(SUM_BLOCK, width - start)
    partials = floats_at(job, held + PARTIALS)  # chunk c's columns from c * width on
    out = floats_at(job, held + OUT)[start:start + size]
    out[:] = partials[start:start + size]
    for chunk in range(1, chunks):
        part = partials[chunk * width + start:chunk * width + start + size]
        for n in range(size):
            out[n] += part[n]


@_jit
def _attention_span(job, index):
    """Unit `index` of an attention job: the query rows of one (batch entry, KV head) against one
    span of the cache."""
    box = words_of(job)
    groups = load(box, GROUPS)
    query, key, value = grid_at(job, QUERY), grid_at(job, KEY), grid_at(job, VALUE)
    partials, stats = grid_at(job, PARTIAL_SUMS), grid_at(job, SPAN_STATS)
    scale = float64_from_bits(load(box, SCALE))
    unit, span = index // partials.shape[1], index % partials.shape[1]
    if load(box, HAS_BIAS):
        attention_span(query, key, value, grid_at(job, BIAS), scale, partials, stats, unit // groups, unit % groups,
                       span)
    else:
        attention_span(query, key, value, None, scale, partials, stats, unit // groups, unit % groups, span)


@_jit
def _attention_combined(job, unit):
    """Unit `unit` of an attention job's second phase: one (batch entry, KV head)'s spans combined
    into its rows of the output (`attention_combine`)."""
    box = words_of(job)
    groups = load(box, GROUPS)
    attention_combine(grid_at(job, VALUE), grid_at(job, PARTIAL_SUMS), grid_at(job, SPAN_STATS),
                      float64_from_bits(load(box, FILL)), grid_at(job, ATTENDED), unit // groups, unit % groups)


@_jit
def _row_block(job, index):
    """Unit `index` of a rows job: its block of rows."""
    box = words_of(job)
    rows, columns = load(box, ROW_COUNT), load(box, ROW_COLUMNS)
    start = index * ROW_BLOCK
    count = min(rows - start, ROW_BLOCK)
    out = shaped(floats_at(job, ROWS_OUT)[start * columns:], (count, columns), np.float32)
    if load(box, ROW_KERNEL) == SOFTMAX_ROWS:
        softmax_rows_float32(out, float64_from_bits(load(box, ROW_ARGUMENTS)))
        return
    x = shaped(floats_at(job, ROWS_IN)[start * columns:], (count, columns), np.float32)
    divisor = np.float32(float64_from_bits(load(box, ROW_ARGUMENTS)))
    one = np.float32(float64_from_bits(load(box, ROW_ARGUMENTS + 1)))
    half = np.float32(float64_from_bits(load(box, ROW_ARGUMENTS + 2)))
    gelu_rows_float32(x, floats_at(job, ROWS_BIAS), divisor, one, half, out)


@_jit
def _nbits_block(job, index):
    """Unit `index` of a 4-bit products job: its tiles of output columns."""
    box = words_of(job)
    rows, columns = load(box, NBITS_ROWS), load(box, NBITS_WIDTH)
    count, chunks = load(box, NBITS_TILE_COUNT), load(box, NBITS_CHUNKS)
    lanes = shaped(floats_at(job, NBITS_LANES), (rows, 2, chunks * CHUNK_BYTES), np.float32)
    sums = shaped(floats_at(job, NBITS_SUMS), (rows, chunks), np.float32)
    tiles = shaped(bytes_at(job, NBITS_TILES_AT), (count, chunks, CHUNK_BYTES, TILE), np.uint8)
    scales = shaped(floats_at(job, NBITS_SCALES), (count, chunks, TILE), np.float32)
    out = shaped(floats_at(job, NBITS_OUT), (rows, columns), np.float32)
    first = index * NBITS_TILES
    stop = min(first + NBITS_TILES, count)
    zero_shape = (count, chunks, TILE) if load(box, NBITS_ZERO_ROWS) > 1 else (1, 1, TILE)
    if load(box, NBITS_ZERO_BYTES) == 1:
        tile_rows(lanes, sums, tiles, scales, shaped(bytes_at(job, NBITS_BYTE_ZEROS), zero_shape, np.uint8), out, first,
                  stop)
    else:
        tile_rows(lanes, sums, tiles, scales, shaped(floats_at(job, NBITS_FLOAT_ZEROS), zero_shape, np.float32), out,
                  first, stop)


@_jit
def _vnni_block(job, index):
    """Unit `index` of an 8-bit products job: its tiles of output columns, as raw int32 sums."""
    box = words_of(job)
    rows, count, groups = load(box, VNNI_ROWS), load(box, VNNI_TILE_COUNT), load(box, VNNI_GROUPS)
    words = shaped(bytes_at(job, VNNI_WORDS), (rows, groups), np.int32)
    tiles = shaped(bytes_at(job, VNNI_TILES_AT), (count, groups, TILE, 4), np.uint8)
    raw = shaped(bytes_at(job, VNNI_RAW), (rows, count * TILE), np.int32)
    first = index * VNNI_TILES
    tile_sums_into(tiles, words, raw, first, min(first + VNNI_TILES, count))


@_jit
def _gemm_block(job, index):
    """Unit `index` of a prompt's products of one a: its `GEMM_UNIT` columns of the product whose units
    hold it, packing into scratch of its own."""
    box = words_of(job)
    rows, depth = load(box, GEMM_ROWS), load(box, GEMM_DEPTH)
    given, unit = load(box, GEMM_COLUMNS_GIVEN) != 0, load(box, GEMM_UNIT)
    part, slot = 0, GEMM_PARTS
    for _ in range(load(box, GEMM_COUNT) - 1):  # the last product whose first unit is at most index
        if load(box, slot + GEMM_PER_PART + GEMM_FIRST_UNIT) > index:
            break
        part += 1
        slot += GEMM_PER_PART
    columns = load(box, slot + GEMM_WIDTH)
    a = shaped(floats_at(job, GEMM_A), (rows, depth), np.float32)
    b = shaped(floats_at(job, GEMM_A + 1 + part), (columns, depth) if given else (depth, columns), np.float32)
    out = grid_at(job, part)[0, 0]
    first = (index - load(box, slot + GEMM_FIRST_UNIT)) * unit
    stop = min(first + unit, columns)
    packed_rows = (min(rows, MC) + MR - 1) // MR * MR
    packed_columns = (stop - first + NR - 1) // NR * NR if given else 0
    streamed = streams(rows, stop - first, given)  # (else no sums: `product_columns` takes `gemm_columns`)
    span = min(STREAMED_COLUMNS, -(-(stop - first) // STREAMED_SPAN) * STREAMED_SPAN) if streamed else 0
    product_columns(a, b, out, first, stop, np.empty(packed_rows * KC, np.float32), np.empty(KC * NR, np.float32),
                    np.empty((MR, NR), np.float32), given, np.empty(KC * packed_columns, np.float32),
                    np.empty((streamed_rows(rows) if streamed else 0, span), np.float32))


@_jit
def _head_rows(grid, b, g, count):
    """The first `count` rows of KV head g of batch entry b of a held grid, as a C-contiguous (count,
    width) array (the posting function checked that its rows are)."""
    return typed_contiguous(grid[b, g, :count])


@_jit
def _attention_block(job, index):
    """Unit `index` of a prompt's attention job: one block of query positions of one (batch entry, KV
    head), the last blocks first."""
    box = words_of(job)
    query, ends, out = grid_at(job, BLOCK_QUERY), grid_at(job, BLOCK_ENDS)[0], grid_at(job, BLOCK_OUT)
    _, groups, panel_rows, _ = grid_at(job, BLOCK_KEY).shape
    stored = grid_at(job, BLOCK_VALUE).shape[2]
    batch, length, per = query.shape[0], query.shape[2], load(box, BLOCK_PER)
    positions = load(box, BLOCK_POSITIONS)
    blocks = (length + positions - 1) // positions
    first = (blocks - 1 - index // (batch * groups)) * positions
    stop = min(first + positions, length)
    b, g = index % (batch * groups) // groups, index % groups
    size = block_limit(ends, per, g, b, first, stop, stored)
    key_panels = _head_rows(grid_at(job, BLOCK_KEY), b, g, panel_rows)
    values = _head_rows(grid_at(job, BLOCK_VALUE), b, g, size)
    bias = grid_at(job, BLOCK_BIAS) if load(box, BLOCK_HAS_BIAS) else np.empty((1, 1, 1, 0), np.float32)
    attend_block(query, key_panels, values, bias, ends, np.float32(float64_from_bits(load(box, BLOCK_FILL))), out, b, g,
                 per, first, stop)


@_jit
def compute_unit(job, kind, index):
    """Unit `index` of the posted job, of kind `kind`."""
    if kind == PRODUCTS:
        phase = load(words_of(job), FIRST_PHASE)
        if index < phase:
            _product_chunk(job, index)
        else:
            _sum_block(job, index - phase)
    elif kind == ATTENTION:
        phase = load(words_of(job), FIRST_PHASE)
        if index < phase:
            _attention_span(job, index)
        else:
            _attention_combined(job, index - phase)
    elif kind == NBITS:
        _nbits_block(job, index)
    elif kind == VNNI:
        _vnni_block(job, index)
    elif kind == GEMM:
        _gemm_block(job, index)
    elif kind == BLOCKS:
        _attention_block(job, index)
    else:
        _row_block(job, index)
