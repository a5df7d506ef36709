"""The decode pool's mailbox layout: which int64 slot of a mailbox holds what, for the claiming loop
(`mailbox.py`), the units each job kind is cut into (`units.py`) and the posting functions
(`jobs.py`); and the nine slots an array posted by address takes (`post_array`, `posted_array`)."""
from __future__ import annotations

import numba

from runnx.ops import _jit_cache  # noqa: F401  (numba caches this module's kernels under RUNNX_CACHE)
from runnx.runtime.addresses import float32_view
from runnx.runtime.atomics import load, store

# mailbox slots, one cache line (8 int64) apart so the spinning reads do not share lines with the
# caller's writes; IDLE + w is worker w's, so there are at most MAX_WORKERS (one line of flags)
POSTED, CLAIM, COMPLETED, IDLE, STOP, SHARED, FIELDS = 0, 8, 16, 24, 32, 40, 48
MAX_WORKERS = STOP - IDLE
# a job's fields: its kind, unit count, polls a worker spins after it and the units of its first
# phase (0: one phase; none of the later units starts before those are complete), then the kind's own
KIND, UNITS, LINGER, FIRST_PHASE, OWN = FIELDS, FIELDS + 1, FIELDS + 2, FIELDS + 3, FIELDS + 4
PRODUCTS, ATTENTION, ROWS, NBITS, VNNI, GEMM, BLOCKS = 0, 1, 2, 3, 4, 5, 6
# products: the rows (address, count), then (matrix, width, partial rows, output) for each matrix;
# its first phase computes the partial rows (a unit a chunk of rows of one matrix), the second adds
# them into the outputs (a unit `SUM_BLOCK` columns of one output)
ROW, HEIGHT, DEPTH, CHUNKS, MATRICES = range(OWN, OWN + 5)
MAX_MATRICES = 4  # one job: rows times up to this many matrices (a layer's q, k, v projections)
# matrix m's slots start at MATRICES + PER_MATRIX m: its address, width, partial rows, output, then
# whether its entries are float32 (FLOATS) or 8-bit integers (UNSIGNED, SIGNED) dequantized by a
# zero point and scale (float64 bits; `rows_into_bytes`). COLUMNS: one float32 matrix given by its
# columns (N, K), a job of one phase whose CHUNKS units are ranges of columns (`columns_into`), each
# written into the output whole
MATRIX, WIDTH, PARTIALS, OUT, ENTRIES, ENTRY_ZERO, ENTRY_SCALE, PER_MATRIX = range(8)
FLOATS, UNSIGNED, SIGNED, COLUMNS = 0, 1, 2, 3
# columns per unit of a products job's second phase
SUM_BLOCK = 4096
# attention: scale, groups, whether there is a bias, the fill (float64 bits), then query, key, value,
# bias, the spans' partial sums and statistics and the output as (address, 4 dimensions, 4 byte
# strides); its first phase computes the spans (a unit a span of one batch entry's KV head), the
# second combines them into the output (a unit a batch entry's KV head)
SCALE, GROUPS, HAS_BIAS, FILL, ARRAYS = range(OWN, OWN + 5)
QUERY, KEY, VALUE, BIAS, PARTIAL_SUMS, SPAN_STATS, ATTENDED = (ARRAYS + 9 * i for i in range(7))
# a prompt's attention in blocks: the fill (float64 bits), query heads a KV head, query positions a
# block, whether there is a bias, then the scaled query, the keys' panels, value, bias, each row's end (float32 (1,
# B, H, Q), broadcasting; no positions: none) and the output as (address, 4 dimensions, 4 byte
# strides); its units go from the last blocks (the most keys, under a causal mask) to the first
BLOCK_FILL, BLOCK_PER, BLOCK_POSITIONS, BLOCK_HAS_BIAS, BLOCK_ARRAYS = range(OWN, OWN + 5)
BLOCK_QUERY, BLOCK_KEY, BLOCK_VALUE, BLOCK_BIAS, BLOCK_ENDS, BLOCK_OUT = (BLOCK_ARRAYS + 9 * i for i in range(6))
# rows: the row kernel, the input's and the output's addresses, rows, columns, then the kernel's own:
# the softmax's fill; the GELU's bias (address, size), divisor, one, half (floats as float64 bits)
ROW_KERNEL, ROWS_IN, ROWS_OUT, ROW_COUNT, ROW_COLUMNS, ROW_ARGUMENTS = range(OWN, OWN + 6)
SOFTMAX_ROWS, GELU_ROWS = 0, 1
ROW_BLOCK = 16  # rows per unit
# 4-bit products: the addresses of the row lanes, chunk sums, tiles, their scales, their zero points
# and the output (all C-contiguous), then rows, columns, tiles and chunks, the zero points' bytes each
# (1: uint8, 4: float32) and rows of 16 (1: one shared by all chunks)
(NBITS_LANES, NBITS_SUMS, NBITS_TILES_AT, NBITS_SCALES, NBITS_ZEROS, NBITS_OUT, NBITS_ROWS, NBITS_WIDTH,
 NBITS_TILE_COUNT, NBITS_CHUNKS, NBITS_ZERO_BYTES, NBITS_ZERO_ROWS) = range(OWN, OWN + 12)
NBITS_TILES = 4  # tiles of 16 output columns per unit
# 8-bit products: the addresses of the rows' unsigned words, the tiles and the raw int32 sums (all
# C-contiguous), then rows, tiles and groups of 4 bytes
VNNI_WORDS, VNNI_TILES_AT, VNNI_RAW, VNNI_ROWS, VNNI_TILE_COUNT, VNNI_GROUPS = range(OWN, OWN + 6)
VNNI_TILES = 8  # tiles of 16 output columns per unit
# a prompt's float32 products of one a: the address of a (M, K), C-contiguous, M, K, whether b's columns
# are given, the columns a unit computes and how many products, then for each (`GEMM_PARTS` + p
# `GEMM_PER_PART`) the address of its b (K, N; or its columns, (N, K)), C-contiguous, N, its first
# unit and its output (M, N) as posted by `post_matrix` (its rows contiguous, any row stride)
GEMM_A, GEMM_ROWS, GEMM_DEPTH, GEMM_COLUMNS_GIVEN, GEMM_UNIT, GEMM_COUNT, GEMM_PARTS = range(OWN, OWN + 7)
GEMM_B, GEMM_WIDTH, GEMM_FIRST_UNIT, GEMM_OUT, GEMM_PER_PART = 0, 1, 2, 3, 12
MAX_GEMM_PARTS = MAX_MATRICES
# the address of `mailbox._units_entry`, the compiled unit loop every thread of a box calls (`new_box`)
UNITS_CODE = max(MATRICES + PER_MATRIX * MAX_MATRICES, ATTENDED + 9, NBITS_ZERO_ROWS + 1, VNNI_GROUPS + 1,
                 GEMM_PARTS + GEMM_PER_PART * MAX_GEMM_PARTS, BLOCK_OUT + 9)
# a claim takes the units left shifted right by this (`mailbox._work`; a mailbox's own, set by `new_box`)
CLAIM_SHIFT = UNITS_CODE + 1
MAILBOX_SIZE = CLAIM_SHIFT + 1
INDEX_BITS = 32
NOTHING_TO_CLAIM = (1 << INDEX_BITS) - 1

_jit = numba.njit(cache=True, nogil=True, error_model="numpy")


@_jit
def posted_array(box, slot):
    """The float32 array posted at `slot` (`post_array`), viewed by address."""
    shape = (load(box, slot + 1), load(box, slot + 2), load(box, slot + 3), load(box, slot + 4))
    strides = (load(box, slot + 5), load(box, slot + 6), load(box, slot + 7), load(box, slot + 8))
    return float32_view(load(box, slot), shape, strides)


@_jit
def post_array(box, slot, array):
    """Posts `array` (4 dimensions) at slot .. slot + 9: its address, shape and byte strides. Only the
    posting functions call it, after checking the array."""
    store(box, slot, array.ctypes.data)
    for axis in range(4):
        store(box, slot + 1 + axis, array.shape[axis])
        store(box, slot + 5 + axis, array.strides[axis])


@_jit
def post_matrix(box, slot, matrix):
    """Posts a 2-D `matrix` at slot .. slot + 9 as `post_array` posts a (1, 1, M, N) array, which
    `posted_array(box, slot)[0, 0]` views again."""
    store(box, slot, matrix.ctypes.data)
    store(box, slot + 1, 1)
    store(box, slot + 2, 1)
    store(box, slot + 3, matrix.shape[0])
    store(box, slot + 4, matrix.shape[1])
    store(box, slot + 5, 0)
    store(box, slot + 6, 0)
    store(box, slot + 7, matrix.strides[0])
    store(box, slot + 8, matrix.strides[1])
