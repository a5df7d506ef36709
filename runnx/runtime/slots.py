"""The decode pool's job layout: which int64 word of a job's mailbox holds what, for the claiming
loop (`mailbox.py`), the units each job kind is cut into (`units.py`) and the posting functions
(`jobs.py`); and which slot of the job's lists of arrays (`board.py`) holds each of its arrays."""
from __future__ import annotations

# mailbox slots, one cache line (8 int64) apart so the spinning reads do not share lines with the
# caller's writes; IDLE + w is worker w's, so there are at most MAX_WORKERS (one line of flags)
POSTED, CLAIM, COMPLETED, IDLE, STOP, SHARED, FIELDS = 0, 8, 16, 24, 32, 40, 48
MAX_WORKERS = STOP - IDLE
# a job's fields: its kind, unit count, polls a worker spins after it and the units of its first
# phase (0: one phase; none of the later units starts before those are complete), then the kind's own
KIND, UNITS, LINGER, FIRST_PHASE, OWN = FIELDS, FIELDS + 1, FIELDS + 2, FIELDS + 3, FIELDS + 4
PRODUCTS, ATTENTION, ROWS, NBITS, VNNI, GEMM, BLOCKS = 0, 1, 2, 3, 4, 5, 6
# products: rows, depth, chunks a matrix, then for each matrix (MATRICES + PER_MATRIX m) its width and
# whether its entries are float32 (FLOATS) or 8-bit integers (UNSIGNED, SIGNED) dequantized by a zero
# point and scale (float64 bits; `rows_into_bytes`); its first phase computes the partial rows (a unit
# a chunk of rows of one matrix), the second adds them into the outputs (a unit `SUM_BLOCK` columns of
# one output). COLUMNS: one float32 matrix given by its columns (N, K), a job of one phase whose
# CHUNKS units are ranges of columns (`columns_into`), each written into the output whole. Its arrays:
# the rows (float slot ROW), then each matrix's entries (float slot FIRST_MATRIX + FLOATS_PER_MATRIX m + MATRIX, or
# byte slot m when 8-bit), partial rows (+ PARTIALS) and output (+ OUT)
HEIGHT, DEPTH, CHUNKS, MATRICES = range(OWN, OWN + 4)
MAX_MATRICES = 4  # one job: rows times up to this many matrices (a layer's q, k, v projections)
WIDTH, ENTRIES, ENTRY_ZERO, ENTRY_SCALE, PER_MATRIX = range(5)
FLOATS, UNSIGNED, SIGNED, COLUMNS = 0, 1, 2, 3
ROW, FIRST_MATRIX, FLOATS_PER_MATRIX = 0, 1, 3
MATRIX, PARTIALS, OUT = 0, 1, 2
# columns per unit of a products job's second phase
SUM_BLOCK = 4096
# attention: scale, groups, whether there is a bias, the fill (float64 bits); its grids query, key,
# value, bias, the spans' partial sums and statistics and the output; its first phase computes the
# spans (a unit a span of one batch entry's KV head), the second combines them into the output (a
# unit a batch entry's KV head)
SCALE, GROUPS, HAS_BIAS, FILL = range(OWN, OWN + 4)
QUERY, KEY, VALUE, BIAS, PARTIAL_SUMS, SPAN_STATS, ATTENDED = range(7)
# a prompt's attention in blocks: the fill (float64 bits), query heads a KV head, query positions a
# block, whether there is a bias; its grids the scaled query, the keys' panels, value, bias, each
# row's end (float32 (1, B, H, Q), broadcasting; no positions: none) and the output; its units go
# from the last blocks (the most keys, under a causal mask) to the first
BLOCK_FILL, BLOCK_PER, BLOCK_POSITIONS, BLOCK_HAS_BIAS = range(OWN, OWN + 4)
BLOCK_QUERY, BLOCK_KEY, BLOCK_VALUE, BLOCK_BIAS, BLOCK_ENDS, BLOCK_OUT = range(6)
# rows: the row kernel, rows, columns, then the kernel's own: the softmax's fill; the GELU's divisor,
# one, half (floats as float64 bits); its floats the input, the output and the GELU's bias
ROW_KERNEL, ROW_COUNT, ROW_COLUMNS, ROW_ARGUMENTS = range(OWN, OWN + 4)
ROWS_IN, ROWS_OUT, ROWS_BIAS = range(3)
SOFTMAX_ROWS, GELU_ROWS = 0, 1
ROW_BLOCK = 16  # rows per unit
# 4-bit products: rows, columns, tiles and chunks, the zero points' bytes each (1: uint8, 4: float32)
# and rows of 16 (1: one shared by all chunks); its floats the row lanes, chunk sums, the tiles'
# scales, the output and float32 zero points, its bytes the tiles and uint8 zero points
(NBITS_ROWS, NBITS_WIDTH, NBITS_TILE_COUNT, NBITS_CHUNKS, NBITS_ZERO_BYTES,
 NBITS_ZERO_ROWS) = range(OWN, OWN + 6)
NBITS_LANES, NBITS_SUMS, NBITS_SCALES, NBITS_OUT, NBITS_FLOAT_ZEROS = range(5)
NBITS_TILES_AT, NBITS_BYTE_ZEROS = range(2)
NBITS_TILES = 4  # tiles of 16 output columns per unit
# 8-bit products: rows, tiles and groups of 4 bytes; its bytes the rows' unsigned words, the tiles and
# the raw int32 sums
VNNI_ROWS, VNNI_TILE_COUNT, VNNI_GROUPS = range(OWN, OWN + 3)
VNNI_WORDS, VNNI_TILES_AT, VNNI_RAW = range(3)
VNNI_TILES = 8  # tiles of 16 output columns per unit
# a prompt's float32 products of one a: M, K, whether b's columns are given, the columns a unit
# computes and how many products, then for each (`GEMM_PARTS` + p `GEMM_PER_PART`) its N and first
# unit; its floats a (M, K) and each b (K, N; or its columns, (N, K)) at 1 + p, its grids each output
# (M, N) as `hold_matrix` holds it (its rows contiguous, any row stride) at p
GEMM_ROWS, GEMM_DEPTH, GEMM_COLUMNS_GIVEN, GEMM_UNIT, GEMM_COUNT, GEMM_PARTS = range(OWN, OWN + 6)
GEMM_WIDTH, GEMM_FIRST_UNIT, GEMM_PER_PART = 0, 1, 2
GEMM_A = 0
MAX_GEMM_PARTS = MAX_MATRICES
# a claim takes the units left shifted right by this (`mailbox._work`; a mailbox's own, set by `new_box`)
CLAIM_SHIFT = max(MATRICES + PER_MATRIX * MAX_MATRICES, FILL + 1, NBITS_ZERO_ROWS + 1, VNNI_GROUPS + 1,
                  GEMM_PARTS + GEMM_PER_PART * MAX_GEMM_PARTS, BLOCK_HAS_BIAS + 1, ROW_ARGUMENTS + 3)
# how many slots of each list the job holds arrays in (`board.py`, the poster's only)
FLOATS_USED, GRIDS_USED, BYTES_USED = CLAIM_SHIFT + 1, CLAIM_SHIFT + 2, CLAIM_SHIFT + 3
MAILBOX_SIZE = BYTES_USED + 1
FLOAT_SLOTS = FIRST_MATRIX + FLOATS_PER_MATRIX * MAX_MATRICES
GRID_SLOTS = ATTENDED + 1
BYTE_SLOTS = MAX_MATRICES
INDEX_BITS = 32
NOTHING_TO_CLAIM = (1 << INDEX_BITS) - 1
