"""The decode pool's jobs, as posted by the caller (`pool.py` calls them on the pool's board or on
a thread's own): each posting function checks its arrays, writes the job's numbers into its
mailbox and its arrays into its lists (`slots.py` says where; `board.py` holds them) and opens it
(`mailbox.open_job`). A `post_*` function then runs it (`mailbox.finish`: the caller takes units
too and returns when every unit is complete), releases its arrays and finishes what is left on the
calling thread (combining spans, applying zero points); an `open_*` one returns at once, the job
holding its arrays until the caller releases it (`pool.py`).

Each posting function checks its arrays first (a `_check_*` call before anything is posted): the
units read them by the shapes the job's numbers give, so an array that does not fit them raises
ValueError here rather than being read past its end there.
"""
from __future__ import annotations

import numba
import numpy as np
from numba.extending import overload

from runnx.ops import _jit_cache  # noqa: F401  (numba caches this module's kernels under RUNNX_CACHE)
from runnx.ops._kernels_fused import attention_scratch, attention_spans
from runnx.ops._kernels_contrib import nbits_lanes
from runnx.ops._kernels_gemm import KC, NR
from runnx.ops._kernels_linalg import chunk_count
from runnx.ops._kernels_nibble_tiles import CHUNK_BYTES, TILE
from runnx.ops._kernels_vnni import unsigned_rows, with_zero_points
from runnx.runtime.atomics import bits_of_float64, store
from runnx.runtime.board import hold_bytes, hold_floats, hold_grid, hold_matrix, release_finished, words_of
from runnx.runtime.mailbox import PATIENCE, STEP_PATIENCE, begin_job, finish, open_job, run_job
from runnx.runtime.slots import (ATTENDED, ATTENTION, BIAS, BLOCKS, BLOCK_BIAS, BLOCK_ENDS, BLOCK_FILL, BLOCK_HAS_BIAS,
                                 BLOCK_KEY, BLOCK_OUT, BLOCK_PER, BLOCK_POSITIONS, BLOCK_QUERY, BLOCK_VALUE, CHUNKS,
                                 COLUMNS, DEPTH, ENTRIES, ENTRY_SCALE, ENTRY_ZERO, FILL, FIRST_MATRIX, FIRST_PHASE,
                                 FLOATS, FLOATS_PER_MATRIX, GELU_ROWS, GEMM, GEMM_A, GEMM_COLUMNS_GIVEN, GEMM_COUNT,
                                 GEMM_DEPTH, GEMM_FIRST_UNIT, GEMM_PARTS, GEMM_PER_PART, GEMM_ROWS, GEMM_UNIT,
                                 GEMM_WIDTH, GROUPS, HAS_BIAS, HEIGHT, KEY, KIND, MATRICES, MATRIX, MAX_GEMM_PARTS,
                                 MAX_MATRICES, NBITS, NBITS_BYTE_ZEROS, NBITS_CHUNKS, NBITS_FLOAT_ZEROS, NBITS_LANES,
                                 NBITS_OUT, NBITS_ROWS, NBITS_SCALES, NBITS_SUMS, NBITS_TILES, NBITS_TILES_AT,
                                 NBITS_TILE_COUNT, NBITS_WIDTH, NBITS_ZERO_BYTES, NBITS_ZERO_ROWS, OUT, PARTIALS,
                                 PARTIAL_SUMS, PER_MATRIX, PRODUCTS, QUERY, ROW, ROWS, ROWS_BIAS, ROWS_IN, ROWS_OUT,
                                 ROW_ARGUMENTS, ROW_BLOCK, ROW_COLUMNS, ROW_COUNT, ROW_KERNEL, SCALE, SIGNED,
                                 SOFTMAX_ROWS, SPAN_STATS, SUM_BLOCK, UNSIGNED, VALUE, VNNI, VNNI_GROUPS, VNNI_RAW,
                                 VNNI_ROWS, VNNI_TILES, VNNI_TILES_AT, VNNI_TILE_COUNT, VNNI_WORDS, WIDTH)

# a few rows (a short prompt's) take a products job rather than OpenBLAS, which packs the whole
# matrix for them: up to FEW_ROWS, their partial sums in one pass over the matrix (rows x columns)
# up to FEW_ROW_SUMS, a quarter of an L2 cache
FEW_ROWS = 16
FEW_ROW_SUMS = 1 << 17

_jit = numba.njit(cache=True, nogil=True, error_model="numpy")
# the `open_*` functions, inlined into the `post_*` ones that finish them: a call passing a
# job's arrays costs a reference count each way, a tenth of a small job's time
_inlined = numba.njit(cache=True, nogil=True, error_model="numpy", inline="always")


def few(rows: int, columns: int) -> bool:
    """Whether `rows` rows times a matrix of `columns` columns are one row or few enough for the
    products loop (`FEW_ROWS`, `FEW_ROW_SUMS`)."""
    return rows == 1 or (rows <= FEW_ROWS and rows * columns <= FEW_ROW_SUMS)


def _entries_of(matrix) -> int:
    """How a products job reads `matrix`'s entries: FLOATS (float32), UNSIGNED (uint8), SIGNED
    (int8), or -1 (any other type: refused)."""
    return {np.dtype(np.float32): FLOATS, np.dtype(np.uint8): UNSIGNED, np.dtype(np.int8): SIGNED}.get(matrix.dtype, -1)


@overload(_entries_of)
def _entries_of_compiled(matrix):
    entries = {numba.float32: FLOATS, numba.uint8: UNSIGNED, numba.int8: SIGNED}.get(matrix.dtype, -1)
    return lambda matrix: entries


def _hold_entries(job, m, matrix):
    """Hold a products job's matrix m: float32 entries as floats, 8-bit ones as bytes."""


@overload(_hold_entries)
def _hold_entries_compiled(job, m, matrix):
    if matrix.dtype == numba.float32:
        return lambda job, m, matrix: hold_floats(job, FIRST_MATRIX + FLOATS_PER_MATRIX * m + MATRIX, matrix)
    return lambda job, m, matrix: hold_bytes(job, m, matrix)


def _hold_zeros(job, zeros):
    """Hold a 4-bit products job's zero points: uint8 ones as bytes, float32 ones as floats."""


@overload(_hold_zeros)
def _hold_zeros_compiled(job, zeros):
    if zeros.dtype == numba.float32:
        return lambda job, zeros: hold_floats(job, NBITS_FLOAT_ZEROS, zeros)
    return lambda job, zeros: hold_bytes(job, NBITS_BYTE_ZEROS, zeros)


@_inlined
def _finished(board):
    """`mailbox.finish(board)`, then the job's arrays released: a `post_*` function's callers hold
    them still."""
    finish(board)
    release_finished(board.job)


@_jit
def _check_products(row, matrices, outs, scratch):
    """ValueError unless the arrays are what `post_products` reads and writes."""
    if len(matrices) == 0 or len(matrices) > MAX_MATRICES or len(outs) != len(matrices):
        raise ValueError("a products job takes 1 to MAX_MATRICES matrices and an output for each")
    depth = matrices[0].shape[0]
    if (depth == 0 or row.size % depth != 0 or not row.flags.c_contiguous or row.itemsize != 4
            or not scratch.flags.c_contiguous or scratch.itemsize != 4):
        raise ValueError("a products job takes C-contiguous float32 rows of the matrices' depth and scratch")
    height = row.size // depth
    room = 0
    for m in range(len(matrices)):
        matrix, out = matrices[m], outs[m]
        if (matrix.shape[0] != depth or not matrix.flags.c_contiguous or _entries_of(matrix) < 0
                or out.size != height * matrix.shape[1] or not out.flags.c_contiguous or out.itemsize != 4):
            raise ValueError("a products job takes C-contiguous float32 (or 8-bit) matrices (K, N) and outputs "
                             "of rows x N")
        room += out.size
    if scratch.size < chunk_count(depth) * room:
        raise ValueError("a products job needs scratch of chunk_count(K) times its outputs' elements")


@_inlined
def _begin_products(board, height, depth, chunks):
    """`begin_job` of a products job over `height` rows of `depth`, `chunks` units a matrix in its
    first phase; the job's sequence number (its rows and matrices posted after)."""
    sequence = begin_job(board, STEP_PATIENCE)
    box = words_of(board.job)
    store(box, KIND, PRODUCTS)
    store(box, HEIGHT, height)
    store(box, DEPTH, depth)
    store(box, CHUNKS, chunks)
    return sequence


@_inlined
def open_products(board, workers, row, matrices, outs, scratch, zero, scale):
    """row @ matrices[m] into outs[m] for each m, as one job, for C-contiguous float32 `row` of one
    row (K,) or a few (M, K) and outs[m] of M * N_m elements, the partial rows in `scratch` (room
    for chunk_count(K) times every output), opened (`mailbox.open_job`): it returns before the units
    are computed, and the job holds every array until it is released. Its first phase
    computes the partial rows, its second adds them (a job of two phases: one hand-off). Whether a
    worker was idle. 8-bit matrices are read as (float32(entry) - zero) * scale (`rows_into_bytes`);
    float32 ones ignore them (callers pass 0 and 1). No argument has a default: a call from Python
    that omits one takes numba's slow dispatch, tens of microseconds a call. Arrays that do not fit
    raise ValueError before anything is posted."""
    _check_products(row, matrices, outs, scratch)
    depth = matrices[0].shape[0]
    chunks = chunk_count(depth)
    sequence = _begin_products(board, row.size // depth, depth, chunks)
    job = board.job
    box = words_of(job)
    hold_floats(job, ROW, row)
    start, sums = 0, 0
    for m in range(len(matrices)):
        slots, held = MATRICES + PER_MATRIX * m, FIRST_MATRIX + FLOATS_PER_MATRIX * m
        _hold_entries(job, m, matrices[m])
        store(box, slots + WIDTH, matrices[m].shape[1])
        hold_floats(job, held + PARTIALS, scratch[start:start + chunks * outs[m].size])
        hold_floats(job, held + OUT, outs[m])
        store(box, slots + ENTRIES, _entries_of(matrices[m]))
        store(box, slots + ENTRY_ZERO, bits_of_float64(zero))
        store(box, slots + ENTRY_SCALE, bits_of_float64(scale))
        start += chunks * outs[m].size
        sums += (outs[m].size + SUM_BLOCK - 1) // SUM_BLOCK
    store(box, FIRST_PHASE, chunks * len(matrices))
    return open_job(board, workers, sequence, chunks * len(matrices) + sums)


COLUMN_BLOCK = 512  # columns a unit of a products job by a matrix's columns (`open_column_products`)


@_jit
def _check_column_products(row, columns, out):
    """ValueError unless the arrays are what `open_column_products` reads and writes."""
    depth, width = columns.shape[1], columns.shape[0]
    if (depth == 0 or row.size % depth != 0 or not row.flags.c_contiguous or row.itemsize != 4
            or not columns.flags.c_contiguous or columns.itemsize != 4 or out.size != row.size // depth * width
            or not out.flags.c_contiguous or out.itemsize != 4):
        raise ValueError("a products job by a matrix's columns takes C-contiguous float32 rows (M, K), columns "
                         "(N, K) and an output of M x N")


@_inlined
def open_column_products(board, workers, row, columns, out):
    """row @ columns.T into out, as one job, for C-contiguous float32 `row` of one row (K,) or a few
    (M, K), a matrix given by its columns, C-contiguous (N, K) (a tied LM head: the embedding's rows),
    and out of M * N elements: a unit a range of COLUMN_BLOCK columns, each element `columns_into`'s
    sum (the same on any thread), opened as `open_products` is (the job holds every array until it
    is released); whether a worker was idle. Arrays that do not fit raise ValueError
    before anything is posted."""
    _check_column_products(row, columns, out)
    depth, width = columns.shape[1], columns.shape[0]
    blocks = max(1, (width + COLUMN_BLOCK - 1) // COLUMN_BLOCK)
    sequence = _begin_products(board, row.size // depth, depth, blocks)
    job = board.job
    box = words_of(job)
    hold_floats(job, ROW, row)
    hold_floats(job, FIRST_MATRIX + MATRIX, columns)
    store(box, MATRICES + WIDTH, width)
    hold_floats(job, FIRST_MATRIX + OUT, out)
    store(box, MATRICES + ENTRIES, COLUMNS)
    store(box, FIRST_PHASE, blocks)
    return open_job(board, workers, sequence, blocks)


@_jit
def post_column_products(board, workers, row, columns, out):
    """`open_column_products`, finished before it returns; whether a worker was idle."""
    idle = open_column_products(board, workers, row, columns, out)
    _finished(board)
    return idle


@_jit
def post_products(board, workers, row, matrices, outs, scratch, zero, scale):
    """`open_products`, finished before it returns; whether a worker was idle."""
    idle = open_products(board, workers, row, matrices, outs, scratch, zero, scale)
    _finished(board)
    return idle


@_jit
def _check_attention(query, key, value, bias, out):
    """ValueError unless the arrays are what `post_attention` reads and writes."""
    _check_attention_shapes(query, key.shape, key.itemsize, value, bias, out)


@_jit
def _check_attention_shapes(query, key_shape, key_itemsize, value, bias, out):
    """`_check_attention` of a key of this shape and item size."""
    batch, heads, length, depth = query.shape
    groups, size = key_shape[1], key_shape[2]
    if (key_shape[0] != batch or key_shape[3] != depth or value.shape[0] != batch or value.shape[1] != groups
            or value.shape[2] != size or groups == 0 or heads % groups != 0):
        raise ValueError("an attention job takes query (B, H, Q, D), key (B, G, K, D), value (B, G, K, W), "
                         "H a multiple of G")
    if (out.shape[0] != batch or out.shape[1] != heads or out.shape[2] != length or out.shape[3] != value.shape[3]
            or query.itemsize != 4 or key_itemsize != 4 or value.itemsize != 4 or out.itemsize != 4):
        raise ValueError("an attention job takes float32 arrays and an output (B, H, Q, W)")
    if bias is not None:
        if ((bias.shape[0] != 1 and bias.shape[0] != batch) or (bias.shape[1] != 1 and bias.shape[1] != heads)
                or (bias.shape[2] != 1 and bias.shape[2] != length) or (bias.shape[3] != 1 and bias.shape[3] != size)
                or bias.itemsize != 4):
            raise ValueError("an attention job's bias is float32 and broadcasts to (B, H, Q, K)")


@_jit
def _check_attention_scratch(query, key, value, partials, stats):
    """ValueError unless partials and stats are what `open_attention` writes (`attention_scratch`'s
    shapes, C-contiguous float32)."""
    units, rows, spans = key.shape[0] * key.shape[1], query.shape[1] // key.shape[1] * query.shape[2], \
        attention_spans(key.shape[2])
    if (partials.shape[0] != units or partials.shape[1] != spans or partials.shape[2] != rows
            or partials.shape[3] != value.shape[3] or stats.shape[0] != units or stats.shape[1] != spans
            or stats.shape[2] != rows or stats.shape[3] != 2 or partials.itemsize != 4 or stats.itemsize != 4
            or not partials.flags.c_contiguous or not stats.flags.c_contiguous):
        raise ValueError("an attention job's partials and statistics are attention_scratch's, C-contiguous float32")


@_inlined
def open_attention(board, workers, query, key, value, bias, scale, fill, out, partials, stats):
    """`attention` of ops/_kernels_fused.py into out as one job, opened (`mailbox.open_job`: the job
    holds every array until it is released): its first phase a unit per (batch entry, KV
    head, span), its second the spans combined, a unit per (batch entry, KV head), in `partials` and
    `stats` (`attention_scratch`'s). Whether a worker was idle. Arrays that do not fit raise
    ValueError before anything is posted."""
    _check_attention(query, key, value, bias, out)
    _check_attention_scratch(query, key, value, partials, stats)
    sequence = begin_job(board, STEP_PATIENCE)
    job = board.job
    box = words_of(job)
    store(box, KIND, ATTENTION)
    store(box, SCALE, bits_of_float64(scale))
    store(box, FILL, bits_of_float64(fill))
    store(box, GROUPS, key.shape[1])
    hold_grid(job, QUERY, query)
    hold_grid(job, KEY, key)
    hold_grid(job, VALUE, value)
    hold_grid(job, PARTIAL_SUMS, partials)
    hold_grid(job, SPAN_STATS, stats)
    hold_grid(job, ATTENDED, out)
    if bias is None:
        store(box, HAS_BIAS, 0)
    else:
        store(box, HAS_BIAS, 1)
        hold_grid(job, BIAS, bias)
    spans = partials.shape[0] * partials.shape[1]
    store(box, FIRST_PHASE, spans)
    return open_job(board, workers, sequence, spans + partials.shape[0])


@_jit
def post_attention(board, workers, query, key, value, bias, scale, fill, out):
    """`open_attention`, its scratch allocated here, finished before it returns; whether a worker
    was idle."""
    partials, stats = attention_scratch(query, key, value)
    idle = open_attention(board, workers, query, key, value, bias, scale, fill, out, partials, stats)
    _finished(board)
    return idle


@_jit
def _check_nbits(rows, lanes, sums, tiles, scales, zeros, out):
    """ValueError unless the arrays are what `open_nbits` reads and writes."""
    count, chunks = tiles.shape[0], tiles.shape[1]
    columns = out.shape[1]
    if (lanes.shape[0] != rows.shape[0] or lanes.shape[1] != 2 or lanes.shape[2] != chunks * CHUNK_BYTES
            or sums.shape[0] != rows.shape[0] or sums.shape[1] != chunks or lanes.itemsize != 4 or sums.itemsize != 4
            or not lanes.flags.c_contiguous or not sums.flags.c_contiguous):
        raise ValueError("a 4-bit products job splits its rows (M, K) into lanes (M, 2, 16 C) and sums (M, C), "
                         "C-contiguous float32")
    shared_zeros = zeros.shape[0] == 1 and zeros.shape[1] == 1
    if (rows.shape[0] != out.shape[0] or rows.shape[1] > chunks * 2 * CHUNK_BYTES or tiles.shape[2] != CHUNK_BYTES
            or tiles.shape[3] != TILE or count != (columns + TILE - 1) // TILE
            or scales.shape[0] != count or scales.shape[1] != chunks or scales.shape[2] != TILE
            or not (shared_zeros or zeros.shape[0] == count and zeros.shape[1] == chunks) or zeros.shape[2] != TILE):
        raise ValueError("a 4-bit products job takes rows (M, K <= 32 C), tiles (N / 16, C, 16, 16) bytes, their "
                         "scales and zero points (N / 16, C, 16; zero points shared: 1, 1, 16) and out (M, N)")
    if (rows.itemsize != 4 or scales.itemsize != 4 or not (zeros.itemsize == 1 or zeros.itemsize == 4)
            or out.itemsize != 4 or tiles.itemsize != 1 or not tiles.flags.c_contiguous
            or not scales.flags.c_contiguous or not zeros.flags.c_contiguous or not out.flags.c_contiguous):
        raise ValueError("a 4-bit products job takes C-contiguous float32 arrays, uint8 tiles and uint8 or "
                         "float32 zero points")


@_inlined
def open_nbits(board, workers, rows, lanes, sums, tiles, scales, zeros, out):
    """out (M, N) = rows (M, K) times the tiles as `tile_rows` computes it, as one job of column
    tiles, opened (`mailbox.open_job`): it returns before the units are computed, the job holding
    every array until it is released. rows are first split into lanes (M, 2, 16 C) and
    sums (M, C), after the last job finished (rows may be its output). Whether a worker was
    idle. Arrays that do not fit raise ValueError before anything is posted."""
    _check_nbits(rows, lanes, sums, tiles, scales, zeros, out)
    finish(board)
    nbits_lanes(rows, 2 * CHUNK_BYTES, lanes, sums)
    height, columns = out.shape
    sequence = begin_job(board, STEP_PATIENCE)
    job = board.job
    box = words_of(job)
    store(box, KIND, NBITS)
    hold_floats(job, NBITS_LANES, lanes)
    hold_floats(job, NBITS_SUMS, sums)
    hold_bytes(job, NBITS_TILES_AT, tiles)
    hold_floats(job, NBITS_SCALES, scales)
    _hold_zeros(job, zeros)
    store(box, NBITS_ZERO_BYTES, zeros.itemsize)
    store(box, NBITS_ZERO_ROWS, zeros.shape[0] * zeros.shape[1])
    hold_floats(job, NBITS_OUT, out)
    store(box, NBITS_ROWS, height)
    store(box, NBITS_WIDTH, columns)
    store(box, NBITS_TILE_COUNT, tiles.shape[0])
    store(box, NBITS_CHUNKS, tiles.shape[1])
    return open_job(board, workers, sequence, (tiles.shape[0] + NBITS_TILES - 1) // NBITS_TILES)


@_jit
def post_nbits(board, workers, rows, tiles, scales, zeros, out):
    """`open_nbits`, finished before it returns (its lanes and sums allocated here); whether a
    worker was idle."""
    chunks = tiles.shape[1]
    lanes = np.empty((rows.shape[0], 2, chunks * CHUNK_BYTES), np.float32)
    sums = np.empty((rows.shape[0], chunks), np.float32)
    idle = open_nbits(board, workers, rows, lanes, sums, tiles, scales, zeros, out)
    _finished(board)
    return idle


@_jit
def _check_vnni(a, tiles, column_sums, a_zero, b_zero, out):
    """ValueError unless the arrays are what `post_vnni` reads and writes."""
    rows, columns = out.shape
    count, groups = tiles.shape[0], tiles.shape[1]
    if (a.shape[0] != rows or a.shape[1] > 4 * groups or tiles.shape[2] != TILE or tiles.shape[3] != 4
            or count != (columns + TILE - 1) // TILE or column_sums.shape[0] != columns or a_zero.shape[0] != rows
            or b_zero.shape[0] != columns or tiles.itemsize != 1 or not tiles.flags.c_contiguous or a.itemsize != 1):
        raise ValueError("an 8-bit products job takes rows (M, K <= 4 G) of bytes, tiles (N / 16, G, 16, 4) bytes, "
                         "column sums (N,), zero points (M,) and (N,) and out (M, N)")


@_jit
def post_vnni(board, workers, a, flip, tiles, column_sums, a_zero, b_zero, out):
    """out (M, N) = the 8-bit product of `ops/_kernels_vnni.py` (module docstring), its tile sums
    as one job of column tiles; whether a worker was idle. Arrays that do not fit raise ValueError
    before anything is posted."""
    _check_vnni(a, tiles, column_sums, a_zero, b_zero, out)
    finish(board)  # a may be the last job's output
    words, row_sums = unsigned_rows(a, flip, tiles.shape[1])
    raw = np.empty((a.shape[0], tiles.shape[0] * TILE), np.int32)
    sequence = begin_job(board, STEP_PATIENCE)
    job = board.job
    box = words_of(job)
    store(box, KIND, VNNI)
    hold_bytes(job, VNNI_WORDS, words)
    hold_bytes(job, VNNI_TILES_AT, tiles)
    hold_bytes(job, VNNI_RAW, raw)
    store(box, VNNI_ROWS, a.shape[0])
    store(box, VNNI_TILE_COUNT, tiles.shape[0])
    store(box, VNNI_GROUPS, tiles.shape[1])
    idle = open_job(board, workers, sequence, (tiles.shape[0] + VNNI_TILES - 1) // VNNI_TILES)
    _finished(board)
    with_zero_points(raw, a.shape[1], row_sums, column_sums, a_zero, b_zero, out)
    return idle


@_jit
def _check_rows(x, out):
    """ValueError unless x and out are what a rows job reads and writes."""
    if (x.shape[0] != out.shape[0] or x.shape[1] != out.shape[1] or not x.flags.c_contiguous
            or not out.flags.c_contiguous or x.itemsize != 4 or out.itemsize != 4):
        raise ValueError("a rows job takes C-contiguous float32 input and output rows of one shape")


@_jit
def _begin_rows(board, kernel, x, out):
    """`begin_job` of row kernel `kernel` from x into out (C-contiguous float32 (rows, columns)),
    after which workers sleep at once; its sequence number (the kernel's arguments posted after)."""
    _check_rows(x, out)
    sequence = begin_job(board, 0)
    job = board.job
    box = words_of(job)
    store(box, KIND, ROWS)
    store(box, ROW_KERNEL, kernel)
    hold_floats(job, ROWS_IN, x)
    hold_floats(job, ROWS_OUT, out)
    store(box, ROW_COUNT, out.shape[0])
    store(box, ROW_COLUMNS, out.shape[1])
    return sequence


@_jit
def _run_rows(board, workers, sequence, rows):
    """Run the rows job `sequence` over `rows` rows, as blocks of rows, and release its arrays."""
    run_job(board, workers, sequence, (rows + ROW_BLOCK - 1) // ROW_BLOCK)
    release_finished(board.job)


@_jit
def post_softmax(board, workers, scores, fill):
    """Softmax of each row of scores (rows, columns), in place, NaN rows set to `fill`, as a rows job."""
    sequence = _begin_rows(board, SOFTMAX_ROWS, scores, scores)
    store(words_of(board.job), ROW_ARGUMENTS, bits_of_float64(fill))
    _run_rows(board, workers, sequence, scores.shape[0])


@_jit
def post_gelu(board, workers, x, bias, divisor, one, half, out):
    """The erf GELU of x + bias (an empty bias: none) into out, (rows, columns), as a rows job."""
    _check_rows(x, out)
    if (bias.size != 0 and bias.size != x.shape[1]) or not bias.flags.c_contiguous or bias.itemsize != 4:
        raise ValueError("a GELU job's bias is a C-contiguous float32 vector of one value a column, or empty")
    sequence = _begin_rows(board, GELU_ROWS, x, out)
    job = board.job
    hold_floats(job, ROWS_BIAS, bias)
    store(words_of(job), ROW_ARGUMENTS, bits_of_float64(divisor))
    store(words_of(job), ROW_ARGUMENTS + 1, bits_of_float64(one))
    store(words_of(job), ROW_ARGUMENTS + 2, bits_of_float64(half))
    _run_rows(board, workers, sequence, out.shape[0])


@_jit
def _check_gemm(a, b, out, columns_given, unit):
    """ValueError unless the arrays are what `post_gemm` reads and writes."""
    rows, depth = a.shape
    columns = out.shape[1]
    b_shape = (columns, depth) if columns_given else (depth, columns)
    if (out.shape[0] != rows or b.shape[0] != b_shape[0] or b.shape[1] != b_shape[1] or a.itemsize != 4
            or b.itemsize != 4 or out.itemsize != 4 or not a.flags.c_contiguous or not b.flags.c_contiguous
            or out.strides[1] != 4 or out.strides[0] < 0 or out.strides[0] % 4 != 0 or unit <= 0 or unit % NR != 0):
        raise ValueError("a prompt's products job takes C-contiguous float32 a (M, K) and b (K, N; (N, K) when its "
                         "columns are given), out (M, N) with contiguous rows, and columns a unit, a multiple of NR")


@_jit
def _check_gemms(a, weights, outs, columns_given, unit):
    """ValueError unless the arrays are what `post_gemms` reads and writes."""
    if len(weights) != len(outs) or len(weights) > MAX_GEMM_PARTS:
        raise ValueError("a prompt's products job takes one output a weight, at most MAX_GEMM_PARTS of them")
    for p in range(len(weights)):
        _check_gemm(a, weights[p], outs[p], columns_given, unit)


@_jit
def post_gemm(board, workers, a, b, out, columns_given, unit):
    """out = a @ b (b.T given, when `columns_given`) by `product_columns`, as one job of `unit` columns a
    unit (`post_gemms` of one product); whether a worker was idle."""
    return post_gemms(board, workers, a, (b,), (out,), columns_given, unit)


@_jit
def post_gemms(board, workers, a, weights, outs, columns_given, unit):
    """outs[p] = a @ weights[p] (weights[p].T given, when `columns_given`) for each p: the products of
    one input (a layer's query, key and value projections), by `product_columns`, as one job of
    `unit` columns a unit, each product's units after the one before's (one hand-off for all);
    whether a worker was idle. Every element is summed alike whichever unit holds it (the kernel's
    docstring), so each output is its one-thread product's bits. Arrays that do not fit (or more
    than MAX_GEMM_PARTS products) raise ValueError before anything is posted."""
    idle = open_gemms(board, workers, a, weights, outs, columns_given, unit)
    _finished(board)
    return idle


@_inlined
def open_gemms(board, workers, a, weights, outs, columns_given, unit):
    """`post_gemms` opened (`mailbox.open_job`): it returns before the units are computed, the job
    holding every array until it is released. Whether a worker was idle."""
    _check_gemms(a, weights, outs, columns_given, unit)
    sequence = begin_job(board, PATIENCE)  # (which finishes the last job, whose output a may be)
    job = board.job
    box = words_of(job)
    store(box, KIND, GEMM)
    hold_floats(job, GEMM_A, a)
    store(box, GEMM_ROWS, a.shape[0])
    store(box, GEMM_DEPTH, a.shape[1])
    store(box, GEMM_COLUMNS_GIVEN, 1 if columns_given else 0)
    store(box, GEMM_UNIT, unit)
    store(box, GEMM_COUNT, len(weights))
    units = 0
    for p in range(len(weights)):
        slot = GEMM_PARTS + GEMM_PER_PART * p
        hold_floats(job, GEMM_A + 1 + p, weights[p])
        store(box, slot + GEMM_WIDTH, outs[p].shape[1])
        store(box, slot + GEMM_FIRST_UNIT, units)
        hold_matrix(job, p, outs[p])
        units += (outs[p].shape[1] + unit - 1) // unit
    return open_job(board, workers, sequence, units)


@_jit
def rows_contiguous(x):
    """Whether each (b, g) of x (B, G, K, W) is a C-contiguous (K, W) matrix, as a prompt's attention
    job reads its keys and values (the stride of an axis of one element does not count)."""
    return (x.shape[3] <= 1 or x.strides[3] == 4) and (x.shape[2] <= 1 or x.strides[2] == 4 * x.shape[3])


@_jit
def _check_attention_blocks(scaled, key_panels, value, bias, ends, out, positions):
    """ValueError unless the arrays are what `post_attention_blocks` reads and writes."""
    batch, size, depth = value.shape[0], value.shape[2], scaled.shape[3]
    _check_attention_shapes(scaled, (key_panels.shape[0], key_panels.shape[1], size, depth), key_panels.itemsize,
                            value, bias, out)
    if (size == 0 or depth > KC or key_panels.shape[2] != (size + NR - 1) // NR * depth or key_panels.shape[3] != NR
            or positions <= 0 or not rows_contiguous(key_panels) or not rows_contiguous(value)):
        raise ValueError("a prompt's attention job takes keys as panels of their columns (B, G, ceil(K / NR) D, "
                         "NR), D at most KC, and values by their rows, each KV head's C-contiguous, at least one "
                         "key, and positions a block")
    batch, heads, length = scaled.shape[0], scaled.shape[1], scaled.shape[2]
    if ends.shape[2] > 0 and ((ends.shape[0] != 1 and ends.shape[0] != batch)
                              or (ends.shape[1] != 1 and ends.shape[1] != heads)
                              or (ends.shape[2] != 1 and ends.shape[2] != length)):
        raise ValueError("a prompt's attention job's row ends broadcast to (B, H, Q)")
    for b in range(ends.shape[0]):
        for h in range(ends.shape[1]):
            for r in range(ends.shape[2]):
                if ends[b, h, r] < 1:
                    raise ValueError("a prompt's attention job's row ends are at least 1 (a row sees a key)")


@_jit
def post_attention_blocks(board, workers, scaled, key_panels, value, bias, ends, fill, positions, out):
    """softmax(scaled @ keys.T + bias) @ value into out (key_panels (B, G, ceil(K / NR) D, NR): the
    panels of keys.T, `key_panels_into`), NaN rows set to `fill`, each row's keys from its
    end on masked (`ends` (B, H, Q) broadcasting: `visible_ends` of the bias, or a causal prompt's;
    (1, 1, 0): none), as one job of a unit per block of `positions` query positions of each (batch
    entry, KV head), each against the keys its rows see; whether a worker was idle. Arrays that do
    not fit raise ValueError before anything is posted."""
    _check_attention_blocks(scaled, key_panels, value, bias, ends, out, positions)
    posted_ends = np.empty((1,) + ends.shape, np.float32)  # key counts: below 2^24, exact
    for b in range(ends.shape[0]):
        for h in range(ends.shape[1]):
            for r in range(ends.shape[2]):
                posted_ends[0, b, h, r] = ends[b, h, r]
    sequence = begin_job(board, PATIENCE)
    job = board.job
    box = words_of(job)
    store(box, KIND, BLOCKS)
    store(box, BLOCK_FILL, bits_of_float64(fill))
    store(box, BLOCK_PER, scaled.shape[1] // key_panels.shape[1])
    store(box, BLOCK_POSITIONS, positions)
    hold_grid(job, BLOCK_QUERY, scaled)
    hold_grid(job, BLOCK_KEY, key_panels)
    hold_grid(job, BLOCK_VALUE, value)
    hold_grid(job, BLOCK_ENDS, posted_ends)
    hold_grid(job, BLOCK_OUT, out)
    if bias is None:
        store(box, BLOCK_HAS_BIAS, 0)
    else:
        store(box, BLOCK_HAS_BIAS, 1)
        hold_grid(job, BLOCK_BIAS, bias)
    units = scaled.shape[0] * key_panels.shape[1] * ((scaled.shape[2] + positions - 1) // positions)
    idle = open_job(board, workers, sequence, units)
    _finished(board)
    return idle
