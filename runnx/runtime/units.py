"""What one unit of each decode-pool job kind computes, read from the mailbox (`slots.py` says
where each field is). A unit gives the same result whichever thread computes it:
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
from runnx.runtime.addresses import byte_pointer, float32_pointer
from runnx.runtime.atomics import float64_from_bits, load
from runnx.runtime.slots import (ATTENDED, ATTENTION, BIAS, BLOCKS, BLOCK_BIAS, BLOCK_ENDS, BLOCK_FILL, BLOCK_HAS_BIAS,
                                 BLOCK_KEY, BLOCK_OUT, BLOCK_PER, BLOCK_POSITIONS, BLOCK_QUERY, BLOCK_VALUE, CHUNKS,
                                 COLUMNS, DEPTH, ENTRIES, ENTRY_SCALE, ENTRY_ZERO, FILL, FIRST_PHASE, FLOATS, GEMM,
                                 GEMM_A, GEMM_B, GEMM_COLUMNS_GIVEN, GEMM_COUNT, GEMM_DEPTH, GEMM_FIRST_UNIT, GEMM_OUT,
                                 GEMM_PARTS, GEMM_PER_PART, GEMM_ROWS, GEMM_UNIT, GEMM_WIDTH, GROUPS, HAS_BIAS, HEIGHT,
                                 KEY, MATRICES, MATRIX, NBITS, NBITS_CHUNKS, NBITS_LANES, NBITS_OUT, NBITS_ROWS,
                                 NBITS_SCALES, NBITS_SUMS, NBITS_TILES, NBITS_TILES_AT, NBITS_TILE_COUNT, NBITS_WIDTH,
                                 NBITS_ZEROS, NBITS_ZERO_BYTES, NBITS_ZERO_ROWS, OUT, PARTIALS, PARTIAL_SUMS,
                                 PER_MATRIX, PRODUCTS, QUERY, ROW, ROWS_IN, ROWS_OUT, ROW_ARGUMENTS, ROW_BLOCK,
                                 ROW_COLUMNS, ROW_COUNT, ROW_KERNEL, SCALE, SOFTMAX_ROWS, SPAN_STATS, SUM_BLOCK,
                                 UNSIGNED, VALUE, VNNI, VNNI_GROUPS, VNNI_RAW, VNNI_ROWS, VNNI_TILES, VNNI_TILES_AT,
                                 VNNI_TILE_COUNT, VNNI_WORDS, WIDTH, posted_array)

_jit = numba.njit(cache=True, nogil=True, error_model="numpy")


@_jit
def _product_chunk(box, index):
    """Unit `index` of a products job: one row chunk of one product into its partial rows."""
    height, depth, chunks = load(box, HEIGHT), load(box, DEPTH), load(box, CHUNKS)
    slots = MATRICES + PER_MATRIX * (index // chunks)
    width = load(box, slots + WIDTH)
    rows = numba.carray(float32_pointer(load(box, ROW)), (height, depth))
    entries = load(box, slots + ENTRIES)
    if entries == COLUMNS:  # a range of columns of one matrix given by them, into the output whole
        columns = numba.carray(float32_pointer(load(box, slots + MATRIX)), (width, depth))
        first, stop = chunk_bounds(width, chunks, index % chunks)
        columns_into(rows, columns, numba.carray(float32_pointer(load(box, slots + OUT)), (height, width)), first,
                     stop)
        return
    partials = numba.carray(float32_pointer(load(box, slots + PARTIALS)), (chunks, height, width))
    chunk = index % chunks
    start, stop = chunk_bounds(depth, chunks, chunk)
    if entries == FLOATS:
        matrix = numba.carray(float32_pointer(load(box, slots + MATRIX)), (depth, width))
        rows_into(rows, matrix, partials[chunk], start, stop)
        return
    zero = np.float32(float64_from_bits(load(box, slots + ENTRY_ZERO)))
    scale = np.float32(float64_from_bits(load(box, slots + ENTRY_SCALE)))
    matrix = numba.carray(byte_pointer(load(box, slots + MATRIX)), (depth, width))
    if entries == UNSIGNED:
        rows_into_bytes(rows, matrix, zero, scale, partials[chunk], start, stop)
    else:
        rows_into_bytes(rows, matrix.view(np.int8), zero, scale, partials[chunk], start, stop)


@_jit
def _sum_block(box, index):
    """Unit `index` of a sums job: one block of columns of one product, its partial rows added in
    chunk order (`add_partials_into`'s order, so the same result as on one thread), each block of a
    chunk's partial rows (all rows of the product in turn) a contiguous vector."""
    height, chunks = load(box, HEIGHT), load(box, CHUNKS)
    slots = MATRICES
    width = height * load(box, slots + WIDTH)
    blocks = (width + SUM_BLOCK - 1) // SUM_BLOCK
    while index >= blocks:  # the units run through the products' blocks in turn
        index -= blocks
        slots += PER_MATRIX
        width = height * load(box, slots + WIDTH)
        blocks = (width + SUM_BLOCK - 1) // SUM_BLOCK
    start = index * SUM_BLOCK
    size = min(SUM_BLOCK, width - start)
    partials = load(box, slots + PARTIALS) + 4 * start  # chunk c's columns at 4 * c * width bytes on
    out = numba.carray(float32_pointer(load(box, slots + OUT) + 4 * start), (size,))
    out[:] = numba.carray(float32_pointer(partials), (size,))
    for chunk in range(1, chunks):
        part = numba.carray(float32_pointer(partials + 4 * chunk * width), (size,))
        for n in range(size):
            out[n] += part[n]


@_jit
def _attention_span(box, index):
    """Unit `index` of an attention job: the query rows of one (batch entry, KV head) against one
    span of the cache."""
    groups = load(box, GROUPS)
    query, key, value = posted_array(box, QUERY), posted_array(box, KEY), posted_array(box, VALUE)
    partials, stats = posted_array(box, PARTIAL_SUMS), posted_array(box, SPAN_STATS)
    scale = float64_from_bits(load(box, SCALE))
    unit, span = index // partials.shape[1], index % partials.shape[1]
    if load(box, HAS_BIAS):
        attention_span(query, key, value, posted_array(box, BIAS), scale, partials, stats, unit // groups,
                       unit % groups, span)
    else:
        attention_span(query, key, value, None, scale, partials, stats, unit // groups, unit % groups, span)


@_jit
def _attention_combined(box, unit):
    """Unit `unit` of an attention job's second phase: one (batch entry, KV head)'s spans combined
    into its rows of the output (`attention_combine`)."""
    groups = load(box, GROUPS)
    attention_combine(posted_array(box, VALUE), posted_array(box, PARTIAL_SUMS), posted_array(box, SPAN_STATS),
                      float64_from_bits(load(box, FILL)), posted_array(box, ATTENDED), unit // groups, unit % groups)


@_jit
def _row_block(box, index):
    """Unit `index` of a rows job: its block of rows."""
    rows, columns = load(box, ROW_COUNT), load(box, ROW_COLUMNS)
    start = index * ROW_BLOCK
    count = min(rows - start, ROW_BLOCK)
    out = numba.carray(float32_pointer(load(box, ROWS_OUT) + 4 * start * columns), (count, columns))
    if load(box, ROW_KERNEL) == SOFTMAX_ROWS:
        softmax_rows_float32(out, float64_from_bits(load(box, ROW_ARGUMENTS)))
        return
    x = numba.carray(float32_pointer(load(box, ROWS_IN) + 4 * start * columns), (count, columns))
    bias = numba.carray(float32_pointer(load(box, ROW_ARGUMENTS)), (load(box, ROW_ARGUMENTS + 1),))
    divisor = np.float32(float64_from_bits(load(box, ROW_ARGUMENTS + 2)))
    one = np.float32(float64_from_bits(load(box, ROW_ARGUMENTS + 3)))
    half = np.float32(float64_from_bits(load(box, ROW_ARGUMENTS + 4)))
    gelu_rows_float32(x, bias, divisor, one, half, out)


@_jit
def _nbits_block(box, index):
    """Unit `index` of a 4-bit products job: its tiles of output columns."""
    rows, columns = load(box, NBITS_ROWS), load(box, NBITS_WIDTH)
    count, chunks = load(box, NBITS_TILE_COUNT), load(box, NBITS_CHUNKS)
    lanes = numba.carray(float32_pointer(load(box, NBITS_LANES)), (rows, 2, chunks * CHUNK_BYTES))
    sums = numba.carray(float32_pointer(load(box, NBITS_SUMS)), (rows, chunks))
    tiles = numba.carray(float32_pointer(load(box, NBITS_TILES_AT)),
                         (count, chunks, CHUNK_BYTES, TILE >> 2)).view(np.uint8)
    scales = numba.carray(float32_pointer(load(box, NBITS_SCALES)), (count, chunks, TILE))
    out = numba.carray(float32_pointer(load(box, NBITS_OUT)), (rows, columns))
    first = index * NBITS_TILES
    stop = min(first + NBITS_TILES, count)
    zero_shape = (count, chunks, TILE) if load(box, NBITS_ZERO_ROWS) > 1 else (1, 1, TILE)
    if load(box, NBITS_ZERO_BYTES) == 1:
        zeros = numba.carray(byte_pointer(load(box, NBITS_ZEROS)), zero_shape)
        tile_rows(lanes, sums, tiles, scales, zeros, out, first, stop)
    else:
        zeros = numba.carray(float32_pointer(load(box, NBITS_ZEROS)), zero_shape)
        tile_rows(lanes, sums, tiles, scales, zeros, out, first, stop)


@_jit
def _vnni_block(box, index):
    """Unit `index` of an 8-bit products job: its tiles of output columns, as raw int32 sums."""
    rows, count, groups = load(box, VNNI_ROWS), load(box, VNNI_TILE_COUNT), load(box, VNNI_GROUPS)
    words = numba.carray(float32_pointer(load(box, VNNI_WORDS)), (rows, groups)).view(np.int32)
    tiles = numba.carray(float32_pointer(load(box, VNNI_TILES_AT)), (count, groups, TILE, 1)).view(np.uint8)
    raw = numba.carray(float32_pointer(load(box, VNNI_RAW)), (rows, count * TILE)).view(np.int32)
    first = index * VNNI_TILES
    tile_sums_into(tiles, words, raw, first, min(first + VNNI_TILES, count))


@_jit
def _gemm_block(box, index):
    """Unit `index` of a prompt's products of one a: its `GEMM_UNIT` columns of the product whose units
    hold it, packing into scratch of its own."""
    rows, depth = load(box, GEMM_ROWS), load(box, GEMM_DEPTH)
    given, unit = load(box, GEMM_COLUMNS_GIVEN) != 0, load(box, GEMM_UNIT)
    slot = GEMM_PARTS
    for _ in range(load(box, GEMM_COUNT) - 1):  # the last product whose first unit is at most index
        if load(box, slot + GEMM_PER_PART + GEMM_FIRST_UNIT) > index:
            break
        slot += GEMM_PER_PART
    columns = load(box, slot + GEMM_WIDTH)
    a = numba.carray(float32_pointer(load(box, GEMM_A)), (rows, depth))
    b = numba.carray(float32_pointer(load(box, slot + GEMM_B)), (columns, depth) if given else (depth, columns))
    out = posted_array(box, slot + GEMM_OUT)[0, 0]
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
def _head_rows(box, slot, b, g, count):
    """The first `count` rows of KV head g of batch entry b of the array posted at `slot` (`post_array`:
    its address, shape, then byte strides), as a C-contiguous (count, width) array (the posting
    function checked that its rows are)."""
    address = load(box, slot) + b * load(box, slot + 5) + g * load(box, slot + 6)
    return numba.carray(float32_pointer(address), (count, load(box, slot + 4)))


@_jit
def _attention_block(box, index):
    """Unit `index` of a prompt's attention job: one block of query positions of one (batch entry, KV
    head), the last blocks first."""
    query, ends, out = posted_array(box, BLOCK_QUERY), posted_array(box, BLOCK_ENDS)[0], posted_array(box, BLOCK_OUT)
    _, groups, panel_rows, _ = posted_array(box, BLOCK_KEY).shape
    stored = posted_array(box, BLOCK_VALUE).shape[2]
    batch, length, per = query.shape[0], query.shape[2], load(box, BLOCK_PER)
    positions = load(box, BLOCK_POSITIONS)
    blocks = (length + positions - 1) // positions
    first = (blocks - 1 - index // (batch * groups)) * positions
    stop = min(first + positions, length)
    b, g = index % (batch * groups) // groups, index % groups
    size = block_limit(ends, per, g, b, first, stop, stored)
    key_panels, values = _head_rows(box, BLOCK_KEY, b, g, panel_rows), _head_rows(box, BLOCK_VALUE, b, g, size)
    bias = posted_array(box, BLOCK_BIAS) if load(box, BLOCK_HAS_BIAS) else np.empty((1, 1, 1, 0), np.float32)
    attend_block(query, key_panels, values, bias, ends, np.float32(float64_from_bits(load(box, BLOCK_FILL))), out, b, g,
                 per, first, stop)


@_jit
def compute_unit(box, kind, index):
    """Unit `index` of the posted job, of kind `kind`."""
    if kind == PRODUCTS:
        phase = load(box, FIRST_PHASE)
        if index < phase:
            _product_chunk(box, index)
        else:
            _sum_block(box, index - phase)
    elif kind == ATTENTION:
        phase = load(box, FIRST_PHASE)
        if index < phase:
            _attention_span(box, index)
        else:
            _attention_combined(box, index - phase)
    elif kind == NBITS:
        _nbits_block(box, index)
    elif kind == VNNI:
        _vnni_block(box, index)
    elif kind == GEMM:
        _gemm_block(box, index)
    elif kind == BLOCKS:
        _attention_block(box, index)
    else:
        _row_block(box, index)
