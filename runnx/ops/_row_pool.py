"""One-row products shared with spinning worker threads: decoding with two threads.

A decode step is some two hundred one-row products (`row @ matrix`), each a few to a few hundred
microseconds of streaming weights from memory. One core does not saturate this machine's memory
(scripts/bench_gemv.py: 18 GB/s from one thread, 29 from two), but handing each product to a
thread pool costs more than it gains: numba's parallel regions and a Python-level hand-off take
30-50 us each. So the workers here never leave native code while a decode is running: each spins
on a shared mailbox (an int64 array read and written with atomic instructions) for a few
milliseconds after its last job, then sleeps on its own Event (a shared one, cleared by whichever
worker wakes first, could leave another asleep through a wake-up meant for it).

A job is one row times up to four matrices (a layer's projections of one input); each product is
cut into the row chunks of `row_times_matrix` (`_kernels_linalg.py`), each summed into its own
partial row, and the partial rows are added in chunk order: the result is bitwise the one-thread
`row_times_matrix`'s, whoever computes which chunk. Threads claim chunks with compare-and-swap on
a counter tagged with the job's sequence number, so the caller never waits for a worker that has
not started (it takes the chunks itself) and a late worker cannot claim a later job's chunk with
an earlier job's pointers. The caller waits only for chunks a worker has claimed, then returns.
Workers found asleep are woken for the next job; the current one runs on the caller's thread.
"""
from __future__ import annotations

import platform
import threading

import numba
import numpy as np
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from runnx.ops._kernels_linalg import (ROW_CHUNKS, add_partials_into, chunk_bounds, chunk_count, row_times_matrix,
                                      rows_into)

# mailbox slots, one cache line (8 int64) apart so the spinning reads do not share lines with the
# caller's writes
_POSTED, _CLAIM, _COMPLETED, _IDLE, _STOP, _SHARED, _FIELDS = 0, 8, 16, 24, 32, 40, 48  # _IDLE + w: worker w's
_ROW, _DEPTH, _CHUNKS, _COUNT, _MATRICES = range(_FIELDS, _FIELDS + 5)
MAX_MATRICES = 4  # one job: one row times up to this many matrices (a layer's q, k, v projections)
_MATRIX, _WIDTH, _PARTIALS, _PER_MATRIX = 0, 1, 2, 3  # the slots of matrix m start at _MATRICES + 3 m
_MAILBOX_SIZE = _MATRICES + _PER_MATRIX * MAX_MATRICES
_INDEX_BITS = 32
_NOTHING_TO_CLAIM = (1 << _INDEX_BITS) - 1
_SEQUENCES = (1 << 31) - 1  # job numbers wrap here, so that the tagged counter stays positive
_X86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")
_PATIENCE = 1 << 16  # polls (each a `pause`) before a worker sleeps: about 2.5 ms here


def _slot_pointer(context, builder, signature, args):
    array = context.make_array(signature.args[0])(context, builder, args[0])
    return cgutils.get_item_pointer(context, builder, signature.args[0], array, [args[1]])


@intrinsic
def _load(typingctx, box, index):
    """box[index], a sequentially consistent atomic load."""
    def codegen(context, builder, signature, args):
        return builder.load_atomic(_slot_pointer(context, builder, signature, args), "seq_cst", 8)

    return types.int64(box, index), codegen


@intrinsic
def _store(typingctx, box, index, value):
    """box[index] = value, a sequentially consistent atomic store."""
    def codegen(context, builder, signature, args):
        builder.store_atomic(args[2], _slot_pointer(context, builder, signature, args), "seq_cst", 8)
        return context.get_dummy_value()

    return types.void(box, index, types.int64), codegen


@intrinsic
def _compare_and_swap(typingctx, box, index, expected, new):
    """Whether box[index] was `expected` and is now `new` (atomically)."""
    def codegen(context, builder, signature, args):
        pair = builder.cmpxchg(_slot_pointer(context, builder, signature, args), args[2], args[3],
                               "seq_cst", "seq_cst")
        return builder.extract_value(pair, 1)

    return types.boolean(box, index, types.int64, types.int64), codegen


@intrinsic
def _add(typingctx, box, index, value):
    """box[index] += value (atomically)."""
    def codegen(context, builder, signature, args):
        builder.atomic_rmw("add", _slot_pointer(context, builder, signature, args), args[2], "seq_cst")
        return context.get_dummy_value()

    return types.void(box, index, types.int64), codegen


@intrinsic
def _pause(typingctx):
    """The spin-wait hint: frees the core's shared resources while polling."""
    def codegen(context, builder, signature, args):
        if _X86:
            hint = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []),
                                                  "llvm.x86.sse2.pause")
            builder.call(hint, [])
        return context.get_dummy_value()

    return types.void(), codegen


@intrinsic
def _float32_pointer(typingctx, address):
    """The address of a caller's float32 buffer (kept alive by the caller until the job is done)."""
    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(types.CPointer(types.float32)))

    return types.CPointer(types.float32)(types.int64), codegen


_jit = numba.njit(cache=True, nogil=True, error_model="numpy")


@_jit
def _work(box, sequence):
    """Claim and compute chunks of job `sequence` until none are left (or a later job is posted);
    returns how many it computed."""
    depth, chunks, count = _load(box, _DEPTH), _load(box, _CHUNKS), _load(box, _COUNT)
    row = numba.carray(_float32_pointer(_load(box, _ROW)), (depth,))
    computed = 0
    while True:
        claim = _load(box, _CLAIM)
        index = claim & _NOTHING_TO_CLAIM
        if claim >> _INDEX_BITS != sequence or index >= chunks * count:
            return computed  # the fields read above may be a later job's: the tag check rejects them
        if _compare_and_swap(box, _CLAIM, claim, claim + 1):
            slots = _MATRICES + _PER_MATRIX * (index // chunks)  # read after the claim: this job's
            width = _load(box, slots + _WIDTH)
            matrix = numba.carray(_float32_pointer(_load(box, slots + _MATRIX)), (depth, width))
            partials = numba.carray(_float32_pointer(_load(box, slots + _PARTIALS)), (chunks, width))
            chunk = index % chunks
            start, stop = chunk_bounds(depth, chunks, chunk)
            rows_into(row, matrix, partials[chunk], start, stop)
            _add(box, _COMPLETED, 1)
            computed += 1


@_jit
def _serve(box, worker, patience):
    """Worker `worker`'s loop: returns True when told to stop, False when idle for `patience` polls."""
    _store(box, _IDLE + worker, 0)
    handled, polls = -1, 0
    while not _load(box, _STOP):
        posted = _load(box, _POSTED)
        if posted != handled:
            computed = _work(box, posted)
            if computed:
                _add(box, _SHARED, computed)
            handled, polls = posted, 0
        elif polls < patience:
            polls += 1
            _pause()
        else:
            _store(box, _IDLE + worker, 1)
            if _load(box, _POSTED) == handled:  # nothing posted in between: the caller will wake us
                return False
            _store(box, _IDLE + worker, 0)
    return True


@_jit
def _products(box, workers, row, matrices, outs):
    """Post row @ matrices[m] for each m as one job, take chunks of it, wait for the chunks workers
    claimed, add each product's partial sums in chunk order into outs[m]; returns whether a worker
    was idle (asleep or falling asleep) when the job was posted."""
    depth = row.size
    chunks = chunk_count(depth)
    count = len(matrices)
    partials = [np.empty((chunks, out.size), np.float32) for out in outs]
    sequence = (_load(box, _POSTED) + 1) & _SEQUENCES
    _store(box, _CLAIM, (sequence << _INDEX_BITS) | _NOTHING_TO_CLAIM)  # first: invalidates the fields
    _store(box, _ROW, row.ctypes.data)
    _store(box, _DEPTH, depth)
    _store(box, _CHUNKS, chunks)
    _store(box, _COUNT, count)
    for m in range(count):
        slots = _MATRICES + _PER_MATRIX * m
        _store(box, slots + _MATRIX, matrices[m].ctypes.data)
        _store(box, slots + _WIDTH, matrices[m].shape[1])
        _store(box, slots + _PARTIALS, partials[m].ctypes.data)
    _store(box, _COMPLETED, 0)
    _store(box, _CLAIM, sequence << _INDEX_BITS)
    _store(box, _POSTED, sequence)
    idle = False
    for worker in range(workers):
        idle |= _load(box, _IDLE + worker) != 0
    _work(box, sequence)
    while _load(box, _COMPLETED) < chunks * count:
        _pause()
    for m in range(count):
        add_partials_into(partials[m], outs[m])
    return idle


@_jit
def _stop(box):
    _store(box, _STOP, 1)


class RowPool:
    """Worker threads for one-row float32 products; `product` is safe to call from any thread (a
    caller that finds the pool busy computes alone)."""

    def __init__(self, workers: int):
        self.box = np.zeros(_MAILBOX_SIZE, np.int64)
        self._lock = threading.Lock()
        self._wakes = [threading.Event() for _ in range(workers)]  # one each: only its worker clears it
        self._threads = [threading.Thread(target=self._serve, args=(i,), name=f"runnx-row-{i}", daemon=True)
                         for i in range(workers)]
        for thread in self._threads:
            thread.start()

    def _serve(self, worker: int):
        while not _serve(self.box, worker, _PATIENCE):
            self._wakes[worker].wait()
            self._wakes[worker].clear()

    def _wake(self):
        for wake in self._wakes:
            wake.set()

    def products(self, row, matrices: tuple) -> tuple:
        """(row @ matrix for matrix in matrices) for a float32 vector row (K,) and
        C-contiguous float32 matrices (K, N_m), as one job per `MAX_MATRICES`."""
        if len(matrices) > MAX_MATRICES:
            return self.products(row, matrices[:MAX_MATRICES]) + self.products(row, matrices[MAX_MATRICES:])
        row = np.ascontiguousarray(row)  # the workers read it by address
        outs = tuple(np.empty(matrix.shape[1], np.float32) for matrix in matrices)
        if not self._lock.acquire(blocking=False):
            return tuple(row_times_matrix(row, matrix) for matrix in matrices)
        try:
            idle = _products(self.box, len(self._threads), row, matrices, outs)
        finally:
            self._lock.release()
        if idle:
            self._wake()
        return outs

    @property
    def shared_chunks(self) -> int:
        """Chunks the workers have computed so far (the rest ran on callers' threads)."""
        return int(self.box[_SHARED])

    def close(self):
        _stop(self.box)
        self._wake()
        for thread in self._threads:
            thread.join()


_pool: RowPool | None = None
_workers: int | None = None  # None: the core count's worth, set on first use


def set_workers(count: int | None) -> None:
    """Worker threads for one-row products from now on (0: none; None: one per core beyond the
    first). More than `ROW_CHUNKS - 1` would find no chunk to take."""
    global _pool, _workers
    if _pool is not None and count != _workers:
        _pool.close()
        _pool = None
    _workers = count


def pool() -> RowPool | None:
    """The process's pool, started on first use; None when it has no workers."""
    global _pool
    if _pool is None and worker_count() > 0:
        _pool = RowPool(worker_count())
    return _pool


def worker_count() -> int:
    """The workers `pool()` has or will have."""
    count = max(0, numba.config.NUMBA_NUM_THREADS - 1) if _workers is None else _workers
    return min(count, ROW_CHUNKS - 1)
