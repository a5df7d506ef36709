"""The decode pool's native side (`pool.py` starts the threads and calls the jobs): the
mailbox, an int64 array every thread reads and writes with the atomic instructions of
`atomics.py`; the units a job is cut into; the workers' loop; the jobs that post them.

A job is cut into units that give the same result whoever computes them:
- products: one row (or a short prompt's few rows) times up to four matrices (a layer's
  projections of one input; float32, or 8-bit read through a zero point and scale); each product
  in the row chunks of `rows_times_matrix`
  (`ops/_kernels_linalg.py`), each summed into its own partial rows, the partial rows added in chunk
  order: bitwise the one-thread loop's;
- attention: one unit per (batch entry, KV head, span of the cache), `attention_span` of
  `ops/_kernels_fused.py` as the one-thread `attention` runs it, the caller combining the spans after;
- 4-bit products (MatMulNBits of one row or a few): one unit per `_NBITS_TILES` tiles of 16 output
  columns, `tile_rows` of `ops/_kernels_nibble_tiles.py` over them (each column computed whole by
  one unit, so the same values as the one-thread loop's);
- 8-bit products (MatMulInteger of one row or a few, on AVX-512 VNNI): one unit per `_VNNI_TILES`
  tiles of 16 output columns, `tile_sums_into` of `ops/_kernels_vnni.py` (exact integer sums);
- rows (a prefill's or an encoder's attention softmax, the encoder's GELU: row kernels of
  `ops/_kernels_rows.py` between BLAS products): blocks of 16 rows. OpenBLAS's threads run the
  products around them, so after such a job a worker does not spin but sleeps at once.
Threads claim units with compare-and-swap on a counter tagged with the job's sequence number, so
the caller never waits for a worker that has not started (it takes the units itself) and a late
worker cannot claim a later job's unit with an earlier job's fields (the caller retags the counter
before it rewrites them). The caller waits only for units a worker has claimed, then returns.
Every thread, the caller as well as the workers, computes units through one compiled copy of the
unit loop (`_units_entry`, called by the address in the mailbox): a result never depends on which
thread took which unit.
Each job says how long a worker spins after it (`_LINGER`): decode jobs come every few microseconds.
A job's arrays are posted by address, by the `post_*` functions only, each checking its arrays first
and returning when every unit is complete (the memory rule in `pool.py`).
"""
from __future__ import annotations

import numba
import numpy as np
from numba.extending import overload

from runnx.ops import _jit_cache  # noqa: F401  (numba caches this module's kernels under RUNNX_CACHE)
from runnx.ops._kernels_fused import attention_combine, attention_scratch, attention_span
from runnx.ops._kernels_linalg import add_partials_into, chunk_bounds, chunk_count, rows_into, rows_into_bytes
from runnx.ops._kernels_nibble_tiles import CHUNK_BYTES, TILE, split_rows, tile_rows
from runnx.ops._kernels_rows import gelu_rows_float32, softmax_rows_float32
from runnx.ops._kernels_vnni import tile_sums_into, unsigned_rows, with_zero_points
from runnx.runtime.atomics import (add, bits_of_float64, byte_pointer, call_units, compare_and_swap,
                                   float32_pointer, float32_view, float64_from_bits, load, pause, store)

# mailbox slots, one cache line (8 int64) apart so the spinning reads do not share lines with the
# caller's writes; _IDLE + w is worker w's, so there are at most MAX_WORKERS (one line of flags)
_POSTED, _CLAIM, _COMPLETED, _IDLE, _STOP, _SHARED, _FIELDS = 0, 8, 16, 24, 32, 40, 48
MAX_WORKERS = _STOP - _IDLE
# a job's fields: its kind, unit count and polls a worker spins after it, then the kind's own
_KIND, _UNITS, _LINGER, _OWN = _FIELDS, _FIELDS + 1, _FIELDS + 2, _FIELDS + 3
_PRODUCTS, _ATTENTION, _ROWS, _SUMS, _NBITS, _VNNI = 0, 1, 2, 3, 4, 5
# products: the rows (address, count), then (matrix, width, partial rows, output) for each matrix;
# a products job's partial rows are then added by a sums job of the same fields when they are wide
# (an LM head's)
_ROW, _HEIGHT, _DEPTH, _CHUNKS, _MATRICES = range(_OWN, _OWN + 5)
MAX_MATRICES = 4  # one job: rows times up to this many matrices (a layer's q, k, v projections)
# a few rows (a short prompt's) take a products job rather than OpenBLAS, which packs the whole
# matrix for them: up to FEW_ROWS, their partial sums in one pass over the matrix (rows x columns)
# up to FEW_ROW_SUMS, a quarter of an L2 cache (2 threads here: 16 rows times 576 x 1536 495 us,
# OpenBLAS 507; 2 rows times an LM head of 51864 columns 4.0 ms, OpenBLAS 5.9; 4 rows 5.7 and 5.4)
FEW_ROWS = 16
FEW_ROW_SUMS = 1 << 17
# matrix m's slots start at _MATRICES + _PER_MATRIX m: its address, width, partial rows, output, then
# whether its entries are float32 (_FLOATS) or 8-bit integers (_UNSIGNED, _SIGNED) dequantized by a
# zero point and scale (float64 bits; `rows_into_bytes`)
_MATRIX, _WIDTH, _PARTIALS, _OUT, _ENTRIES, _ENTRY_ZERO, _ENTRY_SCALE, _PER_MATRIX = range(8)
_FLOATS, _UNSIGNED, _SIGNED = 0, 1, 2
# columns per unit of a sums job, and the columns (all products') from which the partial rows are
# added by the pool: an LM head's 8 partial rows of 50k columns take ~250 us to add on one thread
_SUM_BLOCK = 4096
_SHARED_SUMS = 4 * _SUM_BLOCK
# attention: scale, groups, whether there is a bias, then query, key, value, bias and the spans'
# partial sums and statistics as (address, 4 dimensions, 4 byte strides)
_SCALE, _GROUPS, _HAS_BIAS, _ARRAYS = range(_OWN, _OWN + 4)
_QUERY, _KEY, _VALUE, _BIAS, _PARTIAL_SUMS, _SPAN_STATS = (_ARRAYS + 9 * i for i in range(6))
# rows: the row kernel, the input's and the output's addresses, rows, columns, then the kernel's own:
# the softmax's fill; the GELU's bias (address, size), divisor, one, half (floats as float64 bits)
_ROW_KERNEL, _ROWS_IN, _ROWS_OUT, _ROW_COUNT, _ROW_COLUMNS, _ROW_ARGUMENTS = range(_OWN, _OWN + 6)
_SOFTMAX_ROWS, _GELU_ROWS = 0, 1
_ROW_BLOCK = 16  # rows per unit
# 4-bit products: the addresses of the row lanes, chunk sums, tiles, their scales, their zero points
# times scales and the output (all C-contiguous), then rows, columns, tiles and chunks
(_NBITS_LANES, _NBITS_SUMS, _NBITS_TILES_AT, _NBITS_SCALES, _NBITS_ZEROS, _NBITS_OUT, _NBITS_ROWS, _NBITS_WIDTH,
 _NBITS_TILE_COUNT, _NBITS_CHUNKS) = range(_OWN, _OWN + 10)
_NBITS_TILES = 4  # tiles of 16 output columns per unit
# 8-bit products: the addresses of the rows' unsigned words, the tiles and the raw int32 sums (all
# C-contiguous), then rows, tiles and groups of 4 bytes
_VNNI_WORDS, _VNNI_TILES_AT, _VNNI_RAW, _VNNI_ROWS, _VNNI_TILE_COUNT, _VNNI_GROUPS = range(_OWN, _OWN + 6)
_VNNI_TILES = 8  # tiles of 16 output columns per unit
# the address of `_units_entry`, the compiled unit loop every thread of a box calls (`new_box`)
_UNITS_CODE = max(_MATRICES + _PER_MATRIX * MAX_MATRICES, _SPAN_STATS + 9, _NBITS_CHUNKS + 1, _VNNI_GROUPS + 1)
# a claim takes the units left shifted right by this (`_work`; a mailbox's own, set by `new_box`)
_CLAIM_SHIFT = _UNITS_CODE + 1
CLAIM_SHIFT = 3
_MAILBOX_SIZE = _CLAIM_SHIFT + 1
_INDEX_BITS = 32
_NOTHING_TO_CLAIM = (1 << _INDEX_BITS) - 1
_SEQUENCES = (1 << 31) - 1  # job numbers wrap here, so that the tagged counter stays positive
_PATIENCE = 1 << 16  # polls (each a `pause`) before a worker sleeps: about 2.5 ms here

_jit = numba.njit(cache=True, nogil=True, error_model="numpy")


def few(rows: int, columns: int) -> bool:
    """Whether `rows` rows times a matrix of `columns` columns are one row or few enough for the
    products loop (`FEW_ROWS`, `FEW_ROW_SUMS`)."""
    return rows == 1 or (rows <= FEW_ROWS and rows * columns <= FEW_ROW_SUMS)


@_jit
def _product_chunk(box, index):
    """Unit `index` of a products job: one row chunk of one product into its partial rows."""
    height, depth, chunks = load(box, _HEIGHT), load(box, _DEPTH), load(box, _CHUNKS)
    slots = _MATRICES + _PER_MATRIX * (index // chunks)
    width = load(box, slots + _WIDTH)
    rows = numba.carray(float32_pointer(load(box, _ROW)), (height, depth))
    partials = numba.carray(float32_pointer(load(box, slots + _PARTIALS)), (chunks, height, width))
    chunk = index % chunks
    start, stop = chunk_bounds(depth, chunks, chunk)
    entries = load(box, slots + _ENTRIES)
    if entries == _FLOATS:
        matrix = numba.carray(float32_pointer(load(box, slots + _MATRIX)), (depth, width))
        rows_into(rows, matrix, partials[chunk], start, stop)
        return
    zero = np.float32(float64_from_bits(load(box, slots + _ENTRY_ZERO)))
    scale = np.float32(float64_from_bits(load(box, slots + _ENTRY_SCALE)))
    matrix = numba.carray(byte_pointer(load(box, slots + _MATRIX)), (depth, width))
    if entries == _UNSIGNED:
        rows_into_bytes(rows, matrix, zero, scale, partials[chunk], start, stop)
    else:
        rows_into_bytes(rows, matrix.view(np.int8), zero, scale, partials[chunk], start, stop)


@_jit
def _sum_block(box, index):
    """Unit `index` of a sums job: one block of columns of one product, its partial rows added in
    chunk order (`add_partials_into`'s order, so the same result as on one thread), each block of a
    chunk's partial rows (all rows of the product in turn) a contiguous vector."""
    height, chunks = load(box, _HEIGHT), load(box, _CHUNKS)
    slots = _MATRICES
    width = height * load(box, slots + _WIDTH)
    blocks = (width + _SUM_BLOCK - 1) // _SUM_BLOCK
    while index >= blocks:  # the units run through the products' blocks in turn
        index -= blocks
        slots += _PER_MATRIX
        width = height * load(box, slots + _WIDTH)
        blocks = (width + _SUM_BLOCK - 1) // _SUM_BLOCK
    start = index * _SUM_BLOCK
    size = min(_SUM_BLOCK, width - start)
    partials = load(box, slots + _PARTIALS) + 4 * start  # chunk c's columns at 4 * c * width bytes on
    out = numba.carray(float32_pointer(load(box, slots + _OUT) + 4 * start), (size,))
    out[:] = numba.carray(float32_pointer(partials), (size,))
    for chunk in range(1, chunks):
        part = numba.carray(float32_pointer(partials + 4 * chunk * width), (size,))
        for n in range(size):
            out[n] += part[n]


@_jit
def _posted_array(box, slot):
    shape = (load(box, slot + 1), load(box, slot + 2), load(box, slot + 3), load(box, slot + 4))
    strides = (load(box, slot + 5), load(box, slot + 6), load(box, slot + 7), load(box, slot + 8))
    return float32_view(load(box, slot), shape, strides)


@_jit
def _post_array(box, slot, array):
    store(box, slot, array.ctypes.data)
    for axis in range(4):
        store(box, slot + 1 + axis, array.shape[axis])
        store(box, slot + 5 + axis, array.strides[axis])


@_jit
def _attention_span(box, index):
    """Unit `index` of an attention job: the query rows of one (batch entry, KV head) against one
    span of the cache."""
    groups = load(box, _GROUPS)
    query, key, value = _posted_array(box, _QUERY), _posted_array(box, _KEY), _posted_array(box, _VALUE)
    partials, stats = _posted_array(box, _PARTIAL_SUMS), _posted_array(box, _SPAN_STATS)
    scale = float64_from_bits(load(box, _SCALE))
    unit, span = index // partials.shape[1], index % partials.shape[1]
    if load(box, _HAS_BIAS):
        attention_span(query, key, value, _posted_array(box, _BIAS), scale, partials, stats, unit // groups,
                       unit % groups, span)
    else:
        attention_span(query, key, value, None, scale, partials, stats, unit // groups, unit % groups, span)


@_jit
def _row_block(box, index):
    """Unit `index` of a rows job: its block of rows."""
    rows, columns = load(box, _ROW_COUNT), load(box, _ROW_COLUMNS)
    start = index * _ROW_BLOCK
    count = min(rows - start, _ROW_BLOCK)
    out = numba.carray(float32_pointer(load(box, _ROWS_OUT) + 4 * start * columns), (count, columns))
    if load(box, _ROW_KERNEL) == _SOFTMAX_ROWS:
        softmax_rows_float32(out, float64_from_bits(load(box, _ROW_ARGUMENTS)))
        return
    x = numba.carray(float32_pointer(load(box, _ROWS_IN) + 4 * start * columns), (count, columns))
    bias = numba.carray(float32_pointer(load(box, _ROW_ARGUMENTS)), (load(box, _ROW_ARGUMENTS + 1),))
    divisor = np.float32(float64_from_bits(load(box, _ROW_ARGUMENTS + 2)))
    one = np.float32(float64_from_bits(load(box, _ROW_ARGUMENTS + 3)))
    half = np.float32(float64_from_bits(load(box, _ROW_ARGUMENTS + 4)))
    gelu_rows_float32(x, bias, divisor, one, half, out)


@_jit
def _nbits_block(box, index):
    """Unit `index` of a 4-bit products job: its tiles of output columns."""
    rows, columns = load(box, _NBITS_ROWS), load(box, _NBITS_WIDTH)
    count, chunks = load(box, _NBITS_TILE_COUNT), load(box, _NBITS_CHUNKS)
    lanes = numba.carray(float32_pointer(load(box, _NBITS_LANES)), (rows, 2, chunks * CHUNK_BYTES))
    sums = numba.carray(float32_pointer(load(box, _NBITS_SUMS)), (rows, chunks))
    tiles = numba.carray(float32_pointer(load(box, _NBITS_TILES_AT)),
                         (count, chunks, CHUNK_BYTES, TILE >> 2)).view(np.uint8)
    scales = numba.carray(float32_pointer(load(box, _NBITS_SCALES)), (count, chunks, TILE))
    zero_scales = numba.carray(float32_pointer(load(box, _NBITS_ZEROS)), (count, chunks, TILE))
    out = numba.carray(float32_pointer(load(box, _NBITS_OUT)), (rows, columns))
    first = index * _NBITS_TILES
    tile_rows(lanes, sums, tiles, scales, zero_scales, out, first, min(first + _NBITS_TILES, count))


@_jit
def _vnni_block(box, index):
    """Unit `index` of an 8-bit products job: its tiles of output columns, as raw int32 sums."""
    rows, count, groups = load(box, _VNNI_ROWS), load(box, _VNNI_TILE_COUNT), load(box, _VNNI_GROUPS)
    words = numba.carray(float32_pointer(load(box, _VNNI_WORDS)), (rows, groups)).view(np.int32)
    tiles = numba.carray(float32_pointer(load(box, _VNNI_TILES_AT)), (count, groups, TILE, 1)).view(np.uint8)
    raw = numba.carray(float32_pointer(load(box, _VNNI_RAW)), (rows, count * TILE)).view(np.int32)
    first = index * _VNNI_TILES
    tile_sums_into(tiles, words, raw, first, min(first + _VNNI_TILES, count))


@_jit
def _work(box, sequence):
    """Claim and compute units of job `sequence` until none are left (or a later job is posted);
    returns how many it computed. A claim takes an eighth of the units left (at least one): a
    large job's claims are a few dozen atomic swaps, not one a unit, and its last units still go
    one at a time to whichever thread is free."""
    computed = 0
    while True:
        claim = load(box, _CLAIM)
        first, units = claim & _NOTHING_TO_CLAIM, load(box, _UNITS)
        if claim >> _INDEX_BITS != sequence or first >= units:
            return computed  # (a later job's unit count read here: its retag fails the swap below)
        take = max(1, (units - first) >> load(box, _CLAIM_SHIFT))
        if compare_and_swap(box, _CLAIM, claim, claim + take):  # the fields stay this job's until it is done
            kind = load(box, _KIND)
            for unit in range(first, first + take):
                if kind == _PRODUCTS:
                    _product_chunk(box, unit)
                elif kind == _ATTENTION:
                    _attention_span(box, unit)
                elif kind == _SUMS:
                    _sum_block(box, unit)
                elif kind == _NBITS:
                    _nbits_block(box, unit)
                elif kind == _VNNI:
                    _vnni_block(box, unit)
                else:
                    _row_block(box, unit)
            add(box, _COMPLETED, take)
            computed += take


def _units_entry(box_data, sequence):
    """`_work` on the mailbox at box_data: compiled once, as a C function (`_units_address`)."""
    return _work(numba.carray(box_data, (_MAILBOX_SIZE,)), sequence)


_units_compiled = None


def _units_address() -> int:
    """The address of `_units_entry`, compiled (or loaded from numba's cache) on first use. Every
    thread computes a job's units through it, the caller as well as the workers: numba inlines a
    kernel into each function that calls it, and LLVM may vectorise the copies differently (with
    the kernels' reassociating float flags, 1 ulp apart on some rows, depending on the CPU and on
    what was compiled first), so which thread took a unit would change the result."""
    global _units_compiled
    if _units_compiled is None:
        signature = numba.types.int64(numba.types.CPointer(numba.types.int64), numba.types.int64)
        _units_compiled = numba.cfunc(signature, cache=True, error_model="numpy")(_units_entry)
    return _units_compiled.address


def new_box() -> np.ndarray:
    """A mailbox for a pool of workers or for a job run alone."""
    box = np.zeros(_MAILBOX_SIZE, np.int64)
    box[_UNITS_CODE] = _units_address()
    box[_CLAIM_SHIFT] = CLAIM_SHIFT
    return box


@_jit
def own_box(box):
    """A new mailbox that calls the same unit code as `box` (a job run alone inside another)."""
    alone = np.zeros(_MAILBOX_SIZE, np.int64)
    alone[_UNITS_CODE] = box[_UNITS_CODE]
    alone[_CLAIM_SHIFT] = box[_CLAIM_SHIFT]
    return alone


@_jit
def _serve(box, worker):
    """Worker `worker`'s loop: returns True when told to stop, False when it has been idle for as
    many polls as its last job said (`_LINGER`)."""
    store(box, _IDLE + worker, 0)
    handled, polls, patience = -1, 0, 0
    while not load(box, _STOP):
        posted = load(box, _POSTED)
        if posted != handled:
            computed = call_units(load(box, _UNITS_CODE), box, posted)
            if computed:
                add(box, _SHARED, computed)
            handled, polls, patience = posted, 0, load(box, _LINGER)
        elif polls < patience:
            polls += 1
            pause()
        else:
            store(box, _IDLE + worker, 1)
            if load(box, _POSTED) == handled:  # nothing posted in between: the caller will wake us
                return False
            store(box, _IDLE + worker, 0)
    return True


@_jit
def _begin(box, linger):
    """The next job's sequence number, its counter retagged so that no unit of it can be claimed
    (nor one of an earlier job) while the caller writes its fields (`linger` the first)."""
    sequence = (load(box, _POSTED) + 1) & _SEQUENCES
    store(box, _CLAIM, (sequence << _INDEX_BITS) | _NOTHING_TO_CLAIM)
    store(box, _LINGER, linger)
    return sequence


@_jit
def _run(box, workers, sequence, units):
    """Open job `sequence` of `units` units, take units of it, wait for those workers claimed;
    returns whether a worker was idle (asleep or falling asleep) when the job was posted."""
    store(box, _UNITS, units)
    store(box, _COMPLETED, 0)
    store(box, _CLAIM, sequence << _INDEX_BITS)
    store(box, _POSTED, sequence)
    idle = False
    for worker in range(workers):
        idle |= load(box, _IDLE + worker) != 0
    call_units(load(box, _UNITS_CODE), box, sequence)
    while load(box, _COMPLETED) < units:
        pause()
    return idle


def _entries_of(matrix) -> int:
    """How a products job reads `matrix`'s entries: _FLOATS (float32), _UNSIGNED (uint8), _SIGNED
    (int8), or -1 (any other type: refused)."""
    return {np.dtype(np.float32): _FLOATS, np.dtype(np.uint8): _UNSIGNED, np.dtype(np.int8): _SIGNED}.get(matrix.dtype, -1)


@overload(_entries_of)
def _entries_of_compiled(matrix):
    entries = {numba.float32: _FLOATS, numba.uint8: _UNSIGNED, numba.int8: _SIGNED}.get(matrix.dtype, -1)
    return lambda matrix: entries


@_jit
def _check_products(row, matrices, outs, scratch):
    """ValueError unless the arrays are what `post_products` reads and writes by address."""
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


@_jit
def post_products(box, workers, row, matrices, outs, scratch, zero=0.0, scale=1.0):
    """row @ matrices[m] into outs[m] for each m, as one job, for C-contiguous float32 `row` of one
    row (K,) or a few (M, K) and outs[m] of M * N_m elements, the partial rows in `scratch` (room
    for chunk_count(K) times every output); whether a worker was idle. 8-bit matrices are read as
    (float32(entry) - zero) * scale (`rows_into_bytes`). Arrays that do not fit raise ValueError before
    anything is posted."""
    _check_products(row, matrices, outs, scratch)
    depth = matrices[0].shape[0]
    chunks = chunk_count(depth)
    partials = []
    start = 0
    for out in outs:
        partials.append(scratch[start:start + chunks * out.size].reshape((chunks, out.size)))
        start += chunks * out.size
    sequence = _begin(box, _PATIENCE)
    store(box, _KIND, _PRODUCTS)
    store(box, _ROW, row.ctypes.data)
    store(box, _HEIGHT, row.size // depth)
    store(box, _DEPTH, depth)
    store(box, _CHUNKS, chunks)
    for m in range(len(matrices)):
        slots = _MATRICES + _PER_MATRIX * m
        store(box, slots + _MATRIX, matrices[m].ctypes.data)
        store(box, slots + _WIDTH, matrices[m].shape[1])
        store(box, slots + _PARTIALS, partials[m].ctypes.data)
        store(box, slots + _OUT, outs[m].ctypes.data)
        store(box, slots + _ENTRIES, _entries_of(matrices[m]))
        store(box, slots + _ENTRY_ZERO, bits_of_float64(zero))
        store(box, slots + _ENTRY_SCALE, bits_of_float64(scale))
    idle = _run(box, workers, sequence, chunks * len(matrices))
    columns = 0
    for out in outs:
        columns += out.size
    if workers and chunks > 1 and columns >= _SHARED_SUMS:
        units = 0
        for out in outs:
            units += (out.size + _SUM_BLOCK - 1) // _SUM_BLOCK
        sequence = _begin(box, _PATIENCE)  # the fields stay the products job's
        store(box, _KIND, _SUMS)
        _run(box, workers, sequence, units)
        return idle
    for m in range(len(matrices)):
        add_partials_into(partials[m], outs[m])
    return idle


@_jit
def _check_attention(query, key, value, bias, out):
    """ValueError unless the arrays are what `post_attention` reads and writes."""
    batch, heads, length, depth = query.shape
    groups, size = key.shape[1], key.shape[2]
    if (key.shape[0] != batch or key.shape[3] != depth or value.shape[0] != batch or value.shape[1] != groups
            or value.shape[2] != size or groups == 0 or heads % groups != 0):
        raise ValueError("an attention job takes query (B, H, Q, D), key (B, G, K, D), value (B, G, K, W), "
                         "H a multiple of G")
    if (out.shape[0] != batch or out.shape[1] != heads or out.shape[2] != length or out.shape[3] != value.shape[3]
            or query.itemsize != 4 or key.itemsize != 4 or value.itemsize != 4 or out.itemsize != 4):
        raise ValueError("an attention job takes float32 arrays and an output (B, H, Q, W)")
    if bias is not None:
        if ((bias.shape[0] != 1 and bias.shape[0] != batch) or (bias.shape[1] != 1 and bias.shape[1] != heads)
                or (bias.shape[2] != 1 and bias.shape[2] != length) or (bias.shape[3] != 1 and bias.shape[3] != size)
                or bias.itemsize != 4):
            raise ValueError("an attention job's bias is float32 and broadcasts to (B, H, Q, K)")


@_jit
def post_attention(box, workers, query, key, value, bias, scale, fill, out):
    """`attention` of ops/_kernels_fused.py into out, one unit per (batch entry, KV head, span), as one
    job, then the spans combined on this thread; whether a worker was idle. Arrays that do not fit
    raise ValueError before anything is posted."""
    _check_attention(query, key, value, bias, out)
    partials, stats = attention_scratch(query, key, value)
    sequence = _begin(box, _PATIENCE)
    store(box, _KIND, _ATTENTION)
    store(box, _SCALE, bits_of_float64(scale))
    store(box, _GROUPS, key.shape[1])
    _post_array(box, _QUERY, query)
    _post_array(box, _KEY, key)
    _post_array(box, _VALUE, value)
    _post_array(box, _PARTIAL_SUMS, partials)
    _post_array(box, _SPAN_STATS, stats)
    if bias is None:
        store(box, _HAS_BIAS, 0)
    else:
        store(box, _HAS_BIAS, 1)
        _post_array(box, _BIAS, bias)
    idle = _run(box, workers, sequence, partials.shape[0] * partials.shape[1])
    for unit in range(partials.shape[0]):
        attention_combine(value, partials, stats, fill, out, unit // key.shape[1], unit % key.shape[1])
    return idle


@_jit
def _check_nbits(rows, tiles, scales, zero_scales, out):
    """ValueError unless the arrays are what `post_nbits` reads and writes by address."""
    count, chunks = tiles.shape[0], tiles.shape[1]
    columns = out.shape[1]
    if (rows.shape[0] != out.shape[0] or rows.shape[1] > chunks * 2 * CHUNK_BYTES or tiles.shape[2] != CHUNK_BYTES
            or tiles.shape[3] != TILE or count != (columns + TILE - 1) // TILE
            or scales.shape[0] != count or scales.shape[1] != chunks or scales.shape[2] != TILE
            or zero_scales.shape[0] != count or zero_scales.shape[1] != chunks or zero_scales.shape[2] != TILE):
        raise ValueError("a 4-bit products job takes rows (M, K <= 32 C), tiles (N / 16, C, 16, 16) bytes, their "
                         "scales and zero points times scales (N / 16, C, 16) and out (M, N)")
    if (rows.itemsize != 4 or scales.itemsize != 4 or zero_scales.itemsize != 4 or out.itemsize != 4
            or tiles.itemsize != 1 or not tiles.flags.c_contiguous or not scales.flags.c_contiguous
            or not zero_scales.flags.c_contiguous or not out.flags.c_contiguous):
        raise ValueError("a 4-bit products job takes C-contiguous float32 arrays and uint8 tiles")


@_jit
def post_nbits(box, workers, rows, tiles, scales, zero_scales, out):
    """out (M, N) = rows (M, K) times the tiles as `tile_rows` computes it, as one job of column
    tiles; whether a worker was idle. Arrays that do not fit raise ValueError before anything is
    posted."""
    _check_nbits(rows, tiles, scales, zero_scales, out)
    lanes, sums = split_rows(rows, tiles.shape[1])
    height, columns = out.shape
    sequence = _begin(box, _PATIENCE)
    store(box, _KIND, _NBITS)
    store(box, _NBITS_LANES, lanes.ctypes.data)
    store(box, _NBITS_SUMS, sums.ctypes.data)
    store(box, _NBITS_TILES_AT, tiles.ctypes.data)
    store(box, _NBITS_SCALES, scales.ctypes.data)
    store(box, _NBITS_ZEROS, zero_scales.ctypes.data)
    store(box, _NBITS_OUT, out.ctypes.data)
    store(box, _NBITS_ROWS, height)
    store(box, _NBITS_WIDTH, columns)
    store(box, _NBITS_TILE_COUNT, tiles.shape[0])
    store(box, _NBITS_CHUNKS, tiles.shape[1])
    return _run(box, workers, sequence, (tiles.shape[0] + _NBITS_TILES - 1) // _NBITS_TILES)


@_jit
def _check_vnni(a, tiles, column_sums, a_zero, b_zero, out):
    """ValueError unless the arrays are what `post_vnni` reads (its tiles by address) and writes."""
    rows, columns = out.shape
    count, groups = tiles.shape[0], tiles.shape[1]
    if (a.shape[0] != rows or a.shape[1] > 4 * groups or tiles.shape[2] != TILE or tiles.shape[3] != 4
            or count != (columns + TILE - 1) // TILE or column_sums.shape[0] != columns or a_zero.shape[0] != rows
            or b_zero.shape[0] != columns or tiles.itemsize != 1 or not tiles.flags.c_contiguous or a.itemsize != 1):
        raise ValueError("an 8-bit products job takes rows (M, K <= 4 G) of bytes, tiles (N / 16, G, 16, 4) bytes, "
                         "column sums (N,), zero points (M,) and (N,) and out (M, N)")


@_jit
def post_vnni(box, workers, a, flip, tiles, column_sums, a_zero, b_zero, out):
    """out (M, N) = the 8-bit product of `ops/_kernels_vnni.py` (module docstring), its tile sums
    as one job of column tiles; whether a worker was idle. Arrays that do not fit raise ValueError
    before anything is posted."""
    _check_vnni(a, tiles, column_sums, a_zero, b_zero, out)
    words, row_sums = unsigned_rows(a, flip, tiles.shape[1])
    raw = np.empty((a.shape[0], tiles.shape[0] * TILE), np.int32)
    sequence = _begin(box, _PATIENCE)
    store(box, _KIND, _VNNI)
    store(box, _VNNI_WORDS, words.ctypes.data)
    store(box, _VNNI_TILES_AT, tiles.ctypes.data)
    store(box, _VNNI_RAW, raw.ctypes.data)
    store(box, _VNNI_ROWS, a.shape[0])
    store(box, _VNNI_TILE_COUNT, tiles.shape[0])
    store(box, _VNNI_GROUPS, tiles.shape[1])
    idle = _run(box, workers, sequence, (tiles.shape[0] + _VNNI_TILES - 1) // _VNNI_TILES)
    with_zero_points(raw, a.shape[1], row_sums, column_sums, a_zero, b_zero, out)
    return idle


@_jit
def _check_rows(x, out):
    """ValueError unless x and out are what a rows job reads and writes by address."""
    if (x.shape[0] != out.shape[0] or x.shape[1] != out.shape[1] or not x.flags.c_contiguous
            or not out.flags.c_contiguous or x.itemsize != 4 or out.itemsize != 4):
        raise ValueError("a rows job takes C-contiguous float32 input and output rows of one shape")


@_jit
def _rows(box, workers, kernel, x, out):
    """Row kernel `kernel` from x into out (C-contiguous float32 (rows, columns); its arguments
    already in the box) as one job of blocks of rows, after which workers sleep at once."""
    _check_rows(x, out)
    sequence = _begin(box, 0)
    store(box, _KIND, _ROWS)
    store(box, _ROW_KERNEL, kernel)
    store(box, _ROWS_IN, x.ctypes.data)
    store(box, _ROWS_OUT, out.ctypes.data)
    store(box, _ROW_COUNT, out.shape[0])
    store(box, _ROW_COLUMNS, out.shape[1])
    _run(box, workers, sequence, (out.shape[0] + _ROW_BLOCK - 1) // _ROW_BLOCK)


@_jit
def post_softmax(box, workers, scores, fill):
    """Softmax of each row of scores (rows, columns), in place, NaN rows set to `fill`, as a rows job."""
    _check_rows(scores, scores)
    store(box, _ROW_ARGUMENTS, bits_of_float64(fill))
    _rows(box, workers, _SOFTMAX_ROWS, scores, scores)


@_jit
def post_gelu(box, workers, x, bias, divisor, one, half, out):
    """The erf GELU of x + bias (an empty bias: none) into out, (rows, columns), as a rows job."""
    _check_rows(x, out)
    if (bias.size != 0 and bias.size != x.shape[1]) or not bias.flags.c_contiguous or bias.itemsize != 4:
        raise ValueError("a GELU job's bias is a C-contiguous float32 vector of one value a column, or empty")
    store(box, _ROW_ARGUMENTS, bias.ctypes.data)
    store(box, _ROW_ARGUMENTS + 1, bias.size)
    store(box, _ROW_ARGUMENTS + 2, bits_of_float64(divisor))
    store(box, _ROW_ARGUMENTS + 3, bits_of_float64(one))
    store(box, _ROW_ARGUMENTS + 4, bits_of_float64(half))
    _rows(box, workers, _GELU_ROWS, x, out)


@_jit
def _rest(box):
    """An empty job after which workers sleep at once."""
    _run(box, 0, _begin(box, 0), 0)


@_jit
def _stop(box):
    store(box, _STOP, 1)
