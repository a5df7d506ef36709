"""The decode pool: worker threads that take part of a decode step's heavy kernels, one-row products
and attention over a KV cache, when runnx has more than one thread.

A decode step is some two hundred one-row products (`row @ matrix`), each a few to a few hundred
microseconds of streaming weights from memory, and one attention per layer streaming the KV cache.
One core does not saturate memory on most machines (scripts/bench_gemv.py: 18 GB/s from one thread,
29 from two on the first one), but handing each kernel to a thread pool costs more than it gains:
numba's parallel regions and a Python-level hand-off take 30-50 us each. So the workers here never
leave native code: each spins on a shared mailbox (`mailbox.py`'s loop; its layout in `slots.py`,
what a unit computes in `units.py`, the jobs in `jobs.py`) for a few milliseconds after its last
job, then sleeps in the kernel until the next post wakes it (`mailbox.NATIVE_SLEEP`; where there is
no futex, its loop returns and it sleeps on its own Event: a shared one, cleared by whichever worker
wakes first, could leave another asleep through a wake-up meant for it). Before a job the caller
wakes sleeping workers (`_wake_sleeping`), as its post does; a job they come too late for runs on
the caller's thread. Fewer rows than two blocks (a decode step's GELU: not worth a wake-up) run a
rows job alone on a mailbox of their own (`alone`), never the pool's, so they never set its linger
to zero under a decode's spinning workers.

Memory: a job holds every array its units read and write (`board.py`: typed references in the
job's fields, numba's reference counts being atomic), from its posting function (`jobs.py`, which
checks each array's dtype, layout and shape against what the units read: ValueError, nothing
posted) until it is released: a `post_*` function releases its job before it returns; a job left
open (`open_*`: `products`, `open_nbits`, `open_call`) is released by this module, with the GIL,
once it is finished (`settle`, or this thread's next post, which finishes it first;
`open_jobs.py`). No unit can read memory its job does not keep alive, and no pointer is made from an
integer anywhere.
"""
from __future__ import annotations

import threading

import numba
import numpy as np

from runnx.ops import _native
from runnx.ops._kernels_linalg import ROW_CHUNKS, chunk_count, rows_times_bytes, rows_times_columns, rows_times_matrix
from runnx.ops._kernels_nibble_tiles import CHUNK_BYTES
from runnx.runtime.entry_points import run as run_entries
from runnx.runtime.jobs import (open_column_products, open_nbits, open_products, post_attention,
                                post_column_products, post_gelu, post_nbits, post_products, post_softmax, post_vnni)
from runnx.runtime.mailbox import NATIVE_SLEEP, finish, finish_and_release, make_board, rest, serve, stop, wake_idle
from runnx.runtime.open_jobs import deferred, holding, opening, run_deferred, settle
from runnx.runtime.slots import IDLE, MAX_MATRICES, MAX_WORKERS, ROW_BLOCK, SHARED

_SHARED_ROWS = 2 * ROW_BLOCK  # fewer rows (a decode step's GELU) run the job alone, never the pool
_BLAS_THREADED = 1 << 20  # multiply-adds from which a product is worth OpenBLAS's threads
# multiply-adds of a products job (an LM head's) from which sleeping workers are woken before it is
# posted, not after: a worker woken late still takes half of the product (an encoder-decoder's
# first step, its LM head right after BLAS's cross-attention products put the workers to sleep)
_WAKE_FIRST = 1 << 22
BUSY = object()  # what `DecodePool.call` returns when another thread has the pool


class DecodePool:
    """Worker threads for a decode step's one-row float32 products and attention; safe to call from
    any thread (a caller that finds the pool busy computes alone)."""

    def __init__(self, workers: int):
        if not 0 < workers <= MAX_WORKERS:
            raise ValueError(f"a decode pool has 1 to {MAX_WORKERS} workers, not {workers}")
        # compile the workers' loop on this thread first: a process that ends while a worker is
        # still compiling aborts inside LLVM, and never writes numba's cache for the next one; and
        # `rest`, first called by a multi-threaded BLAS product while workers spin (an
        # encoder-decoder window's first step after a decode): loading it from numba's cache there
        # would stall that step
        stopped, stopped_box = make_board()
        rest(stopped)
        wake_idle(stopped_box, 0)
        stop(stopped)
        serve(stopped, 0)
        finish(stopped)  # (and what this class calls from Python: `settle`'s finish and release, a
        finish_and_release(stopped)  # scratch's chunk count)
        chunk_count(1)
        self.board, self.box = make_board()  # the board every call posts on, and its mailbox's words
        self._workers = workers
        self._partials = np.empty(0, np.float32)
        self._lanes = np.empty(0, np.float32)
        self._lock = threading.Lock()
        self._open = None  # the arrays of a job left open (`open_jobs.py`), the lock held till `settle`
        self._tail = None  # (function, arguments) this thread runs once that job is finished (`open_call`)
        self.left_open = 0  # jobs left open so far
        self._wakes = [threading.Event() for _ in range(workers)]  # one each: only its worker clears it
        self._threads = [threading.Thread(target=self._serve, args=(i,), name=f"runnx-decode-{i}", daemon=True)
                         for i in range(workers)]
        for thread in self._threads:
            thread.start()

    def _serve(self, worker: int):
        while not serve(self.board, worker):
            self._wakes[worker].wait()
            self._wakes[worker].clear()

    def _wake(self):
        """Wake workers sleeping on their Events (none where they sleep in native code, woken by the
        post itself)."""
        if not NATIVE_SLEEP:
            for wake in self._wakes:
                wake.set()

    def _wake_sleeping(self):
        """Wake the workers that are asleep (or falling asleep), under the lock, before a job."""
        if NATIVE_SLEEP:
            wake_idle(self.box, self._workers)
            return
        for worker, wake in enumerate(self._wakes):
            if self.box[IDLE + worker]:
                wake.set()

    def _enter(self) -> bool:
        """Take the pool for a post: True when this thread has its lock, taken now or held through
        a job it left open (closed now when it has a tail, else by the post right before its native
        call, `_close`, so that the post's Python runs while the workers compute); False when another
        thread has it (this thread then has no job open). This thread's deferred calls run first
        (`open_jobs.defer`: nothing overtakes them), and a job it left open on a pool since
        replaced (`set_workers`) is finished."""
        if deferred.calls is not None:
            run_deferred()
        held = holding.pool
        if held is self:
            if self._tail is not None:  # what reads the job's output comes first (`open_call`)
                self._close()
            return True
        if held is not None:
            held.settle()
        return self._lock.acquire(blocking=False)

    def _close(self) -> None:
        """Finish the job this thread left open, release its arrays (with the GIL: `board.py`) and
        run its tail, if any; the pool stays this thread's (nothing is open now)."""
        if self._open is None:
            return
        tail, self._tail = self._tail, None
        try:
            finish_and_release(self.board)
            if tail is not None:  # what reads the job's output (`open_call`)
                tail[0](*tail[1])
        except BaseException:
            self._leave(None)
            raise
        self._open = None

    def _leave(self, open_arrays) -> None:
        """After a post: keep the lock and the arrays of a job left open (`open_arrays`; every
        array its units read or write), or (None: the job is finished) release both."""
        self._open = open_arrays
        if open_arrays is None:
            self._tail = None
            holding.pool = None
            self._lock.release()
        else:
            holding.pool = self
            self.left_open += 1

    def settle(self) -> None:
        """Finish the job this thread left open (every unit complete) and run its tail, if any;
        release its arrays and the lock."""
        self._close()
        self._leave(None)

    def open_call(self, job, arguments: tuple, arrays: tuple, tail, tail_arguments: tuple, scratch: int = 0) -> bool:
        """job(board, workers, *arguments[, the pool's scratch of `scratch` floats]), a numba function
        opening one job (`open_gated_down_nbits`) and returning 1 when a worker was idle, 0 when not,
        -1 when it posted nothing (its arrays do not fit); the job left open: the pool keeps
        `arrays` (every array its units read or write) and its lock, and this thread runs
        tail(*tail_arguments) (what completes the outputs from the job's: a residual add and norm;
        None: nothing) once the job is finished: at `settle`, or first thing in its next post. False
        when the pool is busy or the job posted nothing (nothing done)."""
        if not self._enter():
            return False
        try:
            if scratch:
                partials = self._scratch(scratch)
                arguments, arrays = (*arguments, partials), (*arrays, partials)
            self._wake_sleeping()
            self._close()
            state = job(self.board, self._workers, *arguments)
        except BaseException:
            self.settle()
            raise
        if state < 0:
            self._leave(None)
            return False
        self._leave(arrays)
        self._tail = (tail, tail_arguments) if tail is not None else None
        if state:
            self._wake()
        return True

    def open_nbits(self, rows, tiles, scales, zeros, out) -> bool:
        """Post `open_nbits` and return before its units are computed, keeping its arrays and the
        pool's lock until this thread's `settle`; False when the pool is busy (nothing posted)."""
        if not self._enter():
            return False
        try:
            self._close()  # (its lanes and sums are the last 4-bit job's)
            lanes, sums = self._nbits_scratch(rows.shape[0], tiles.shape[1])
            idle = open_nbits(self.board, self._workers, rows, lanes, sums, tiles, scales, zeros, out)
        except BaseException:
            self.settle()
            raise
        self._leave((rows, lanes, sums, tiles, scales, zeros, out))
        if idle:
            self._wake()
        return True

    def products(self, row, matrices: tuple, dequantized: tuple = (), leave_open: bool = False) -> tuple:
        """(row @ matrix for matrix in matrices) for a float32 vector row (K,), or a few rows (M, K)
        (at most `FEW_ROWS`), and C-contiguous float32 matrices (K, N_m), as one job per
        `MAX_MATRICES`; dequantized (zero, scale): 8-bit matrices, read as (float32(entry) - zero)
        * scale (`rows_into_bytes`). leave_open: the last job may be left open, when this call has
        leave (`opening`): the outputs are then written until `settle`."""
        if len(matrices) > MAX_MATRICES:
            return (self.products(row, matrices[:MAX_MATRICES], dequantized)
                    + self.products(row, matrices[MAX_MATRICES:], dequantized, leave_open))
        if not row.flags.c_contiguous:
            settle()  # (copying it reads it)
            row = np.ascontiguousarray(row)  # the workers read it as a C-contiguous vector
        if not self._enter():
            rows = row.reshape(-1, row.shape[-1])
            if dequantized:
                numbers = tuple(np.float32(n) for n in dequantized)
                return tuple(rows_times_bytes(rows, matrix, *numbers).reshape(row.shape[:-1] + matrix.shape[1:])
                             for matrix in matrices)
            return tuple(rows_times_matrix(rows, matrix).reshape(row.shape[:-1] + matrix.shape[1:])
                         for matrix in matrices)
        try:
            height = row.size // row.shape[-1]
            if height * sum([matrix.size for matrix in matrices]) >= _WAKE_FIRST:
                self._wake_sleeping()
            outs = tuple([np.empty(height * matrix.shape[1], np.float32) for matrix in matrices])
            zero, scale = (float(dequantized[0]), float(dequantized[1])) if dequantized else (0.0, 1.0)
            scratch = self._scratch(chunk_count(row.shape[-1]) * sum([out.size for out in outs]))
        except BaseException:
            self.settle()
            raise
        self._post(leave_open, open_products, post_products, (row, matrices, outs, scratch, zero, scale),
                   (row, matrices, outs, scratch))
        if row.ndim > 1:
            return tuple(out.reshape(row.shape[:-1] + (-1,)) for out in outs)
        return outs

    def column_products(self, row, columns, leave_open: bool = False):
        """row @ columns.T for a float32 vector row (K,) or a few rows (M, K) and a C-contiguous
        float32 matrix given by its columns (N, K), as one job (`open_column_products`: every element
        summed alike on any thread); leave_open as `products`."""
        if not row.flags.c_contiguous:
            settle()  # (copying it reads it)
            row = np.ascontiguousarray(row)
        shape = row.shape[:-1] + (columns.shape[0],)
        if not self._enter():
            return rows_times_columns(row.reshape(-1, row.shape[-1]), columns).reshape(shape)
        try:
            height = row.size // row.shape[-1]
            if height * columns.size >= _WAKE_FIRST:
                self._wake_sleeping()
            out = np.empty(height * columns.shape[0], np.float32)
        except BaseException:
            self.settle()
            raise
        self._post(leave_open, open_column_products, post_column_products, (row, columns, out), (row, columns, out))
        return out.reshape(shape)

    def _post(self, leave_open: bool, opened, posted, arguments: tuple, arrays: tuple) -> None:
        """Post a job with this thread holding the pool: `opened` when it may be left open (keeping
        `arrays`, every array its units read or write, until `settle`), else `posted` (finished on
        return); a post that raises settles the pool first."""
        kept = None
        try:
            self._close()
            if leave_open and opening.allowed:
                idle = opened(self.board, self._workers, *arguments)
                kept = arrays
            else:
                idle = posted(self.board, self._workers, *arguments)
        except BaseException:
            self.settle()
            raise
        self._leave(kept)
        if idle:
            self._wake()

    def _nbits_scratch(self, height: int, chunks: int) -> tuple:
        """`open_nbits`'s lanes and sums for `height` rows and `chunks` chunks, views of one buffer kept
        between jobs (under the lock): `open_nbits` finishes the last job before it writes them."""
        lanes, sums = height * 2 * chunks * CHUNK_BYTES, height * chunks
        if self._lanes.size < lanes + sums:
            self._lanes = np.empty(lanes + sums, np.float32)
        return (self._lanes[:lanes].reshape(height, 2, chunks * CHUNK_BYTES),
                self._lanes[lanes:lanes + sums].reshape(height, chunks))

    def _scratch(self, size: int) -> np.ndarray:
        """The partial rows' buffer, kept between jobs (under the lock): an LM head's are 1.5 MB, and
        freeing and allocating them every step sent glibc's heap into trim-and-fault cycles
        (hundreds of page faults a decode step)."""
        if self._partials.size < size:
            self._partials = np.empty(size, np.float32)
        return self._partials

    def attention(self, query, key, value, bias, scale: float, fill: float):
        """`attention_job` with this pool's workers (alone when the pool is busy)."""
        out = np.empty(query.shape[:3] + value.shape[3:], np.float32)
        if self.call(post_attention, query, key, value, bias, scale, fill, out) is BUSY:
            alone(post_attention, query, key, value, bias, scale, fill, out)
        return out

    def call(self, job, *arguments):
        """job(board, workers, *arguments), a numba function posting this pool's jobs (`post_softmax`,
        `post_gelu`, a decoder block of `ops/_decode_blocks.py`), with sleeping workers woken first (its
        posts wake them too where they sleep in native code); its result, or BUSY when the pool is busy
        (nothing done)."""
        if not self._enter():
            return BUSY
        try:
            self._wake_sleeping()
            self._close()
            result = job(self.board, self._workers, *arguments)
        except BaseException:
            self.settle()
            raise
        self._leave(None)  # (`job` posts finished jobs only)
        return result

    def run_calls(self, calls: list) -> bool:
        """`run_calls` with this pool taken once for all the calls (through their entry points,
        `entry_points.run`), sleeping workers woken before the first job and before each job after
        a call that is not one; False when another thread has the pool (nothing run). Back to back,
        jobs keep the workers spinning (a decode step's linger `STEP_PATIENCE`): checking their idle
        flags before each one cost a two-thread SmolLM2 step ~0.17 ms of 120 checks."""
        if not self._enter():
            return False
        try:
            self._close()
            run_entries(calls, self.board, self._workers, self._wake_sleeping)
        finally:
            self.settle()  # (nothing is open: releases the lock)
        return True

    def rest(self):
        """Let workers spinning after a decode job sleep now: a multi-threaded BLAS product is
        about to run, and OpenBLAS's threads need their cores (an encoder-decoder's first decoder step,
        its cross-attention keys and values of 1500 encoder rows between pool jobs)."""
        settle()
        # a worker woken after a job it came too late for still reads as idle until its thread
        # runs: it would then spin through the product beside OpenBLAS's threads. Its wake-up
        # leaves no trace where workers sleep in native code: the empty job is posted anyway (it
        # wakes no one), and such a worker finds it and sleeps again at once
        waking = NATIVE_SLEEP or any([wake.is_set() for wake in self._wakes])
        if (waking or self.spinning()) and self._lock.acquire(blocking=False):
            try:
                rest(self.board)
            finally:
                self._lock.release()

    def spinning(self) -> bool:
        """Whether a worker is awake (spinning after a job, or computing one) rather than asleep."""
        return not all(self.box[IDLE:IDLE + self._workers])

    @property
    def worker_threads(self) -> int:
        """The workers beside the calling thread."""
        return self._workers

    @property
    def shared_units(self) -> int:
        """Units the workers have computed so far (the rest ran on callers' threads)."""
        return int(self.box[SHARED])

    def close(self):
        stop(self.board)
        self._wake()
        for thread in self._threads:
            thread.join()


def attention_job(query, key, value, bias, scale: float, fill: float):
    """`attention(query, key, value, bias, scale, fill)` of ops/_kernels_fused.py for float32 arrays of
    4 dimensions (bias too, or None), computed as the pool computes it (the same compiled code:
    with its reassociating float flags, `attention` compiled for other array layouts may round
    differently), on this thread; `pool().attention` shares it with the workers."""
    out = np.empty(query.shape[:3] + value.shape[3:], np.float32)
    alone(post_attention, query, key, value, bias, scale, fill, out)
    return out


def rest_workers(multiply_adds: int | None = None) -> None:
    """`DecodePool.rest` when the process has a pool and a BLAS product of `multiply_adds` is about
    to run that is worth OpenBLAS's threads (the rotary MatMuls of every decode step, one a layer,
    must not put the workers to sleep), or (None) other threads' work that needs the cores."""
    if _pool is not None and (multiply_adds is None or multiply_adds >= _BLAS_THREADED):
        _pool.rest()


def workers_spinning() -> bool:
    """Whether the process's pool has workers spinning now, after a job (a short prompt's products
    share their columns with them), rather than asleep or absent."""
    workers = _pool
    return workers is not None and workers.spinning()


def softmax_rows(scores, fill: float) -> None:
    """Softmax along the last axis of C-contiguous float32 scores (rows, columns), in place, rows
    whose softmax is NaN set to `fill` (`softmax_rows_float32`)."""
    if scores.shape[0] < _SHARED_ROWS:
        alone(post_softmax, scores, fill)
    else:
        shared_call(post_softmax, scores, fill)


def gelu_rows(x, bias, divisor, one, half, out) -> None:
    """`gelu_rows_float32` from C-contiguous float32 x (rows, columns) into out, bias a float32
    vector (empty: none), divisor, one and half float32 numbers."""
    arguments = (x, bias, float(divisor), float(one), float(half), out)
    if x.shape[0] < _SHARED_ROWS:
        alone(post_gelu, *arguments)
    else:
        shared_call(post_gelu, *arguments)


def open_nbits_rows(rows, tiles, scales, zeros, out) -> None:
    """`nbits_rows`, left open when this call has leave (`opening`) and the pool is free:
    `out` is then written while the caller goes on, until `settle`."""
    if opening.allowed and (workers := pool()) is not None:
        if workers.open_nbits(rows, tiles, scales, zeros, out):
            return
    nbits_rows(rows, tiles, scales, zeros, out)


def nbits_rows(rows, tiles, scales, zeros, out) -> None:
    """out (M, N) = rows (M, K) times 4-bit tiles (`post_nbits`: C-contiguous float32 arrays, uint8
    tiles), with the pool's workers when there are any: the same compiled code on every thread,
    so the same values whatever the thread count."""
    shared_call(post_nbits, rows, tiles, scales, zeros, out)


def vnni_rows(a, flip: bool, tiles, column_sums, a_zero, b_zero, out) -> None:
    """out (M, N) int32 = the 8-bit product of `post_vnni` (C-contiguous tiles), with the pool's
    workers when there are any (exact integer sums: the same values whoever computes them)."""
    shared_call(post_vnni, a, flip, tiles, column_sums, a_zero, b_zero, out)


def shared_call(job, *arguments):
    """job(board, workers, *arguments) (see `DecodePool.call`) with the pool's workers when there are
    any and it is free, else `alone`: the same compiled code either way, so the same results."""
    workers = pool()
    if workers is not None:
        result = workers.call(job, *arguments)
        if result is not BUSY:
            return result
    return alone(job, *arguments)


def open_shared_call(job, arguments: tuple, arrays: tuple, tail, tail_arguments: tuple, scratch: int = 0) -> bool:
    """`DecodePool.open_call` on the process's pool when it is there and free; False otherwise
    (nothing done: the caller computes it finished). For a kernel given leave, which it took for
    this call (`take_leave`)."""
    workers = pool()
    return workers is not None and workers.open_call(job, arguments, arrays, tail, tail_arguments, scratch)


def run_calls(calls: list) -> None:
    """Run deferred calls (`open_jobs.defer`: (function, arguments, whether a pool job)) in order, the
    jobs with the pool's workers when there are any and it is free (`DecodePool.run_calls`), else
    on this thread's own board: the same compiled code either way (each call's entry point, past
    numba's dispatcher: `entry_points.py`), so the same results."""
    workers = pool()
    if workers is not None and workers.run_calls(calls):
        return
    run_entries(calls, _own_board(), 0)


def alone(job, *arguments):
    """job(board, workers, *arguments) on a board of this thread's, no worker: what the pool computes,
    on this thread. Row kernels take this path below two blocks of rows (a decode step's GELU)
    rather than a direct call, which numba may compile apart from the job's copy: with their
    reassociating float flags the two copies rounded some rows 1 ulp apart, depending on which the
    process compiled or loaded first (a row's softmax then depended on how many rows came with it).
    Each thread keeps its one board for these: a job is synchronous and never posts another from
    Python, so a thread's jobs never overlap."""
    settle()
    return job(_own_board(), 0, *arguments)


def _own_board():
    """This thread's board for jobs run alone."""
    board = getattr(_own_boards, "board", None)
    if board is None:
        board = _own_boards.board = make_board()[0]
    return board


_own_boards = threading.local()  # each thread's board for jobs run alone


_pool: DecodePool | None = None
_workers: int | None = None  # None: the core count's worth, set on first use
_pool_lock = threading.Lock()  # the pool is made (and replaced) by one thread at a time


def set_workers(count: int | None) -> None:
    """Worker threads from now on (0: none; None: one per core beyond the first), at most
    `MAX_WORKERS` and `ROW_CHUNKS - 1` (more would find no product chunk to take)."""
    global _pool, _workers
    with _pool_lock:
        if _pool is not None and count != _workers:
            _pool.close()
            _pool = None
        _workers = count


def pool() -> DecodePool | None:
    """The process's pool, started on first use; None when it has no workers, or while compiled
    kernels are off (`_native`: its workers run compiled code)."""
    global _pool
    if not _native.enabled:
        return None
    if _pool is not None or _workers == 0:  # (a decode step asks a few hundred times)
        return _pool
    if worker_count() > 0:
        with _pool_lock:
            if _pool is None and worker_count() > 0:
                _pool = DecodePool(worker_count())
    return _pool


def worker_count() -> int:
    """The workers `pool()` has or will have."""
    count = max(0, numba.config.NUMBA_NUM_THREADS - 1) if _workers is None else _workers
    return min(count, MAX_WORKERS, ROW_CHUNKS - 1)
