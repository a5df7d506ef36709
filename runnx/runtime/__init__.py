"""The process's machinery under the interpreter: threads (BLAS's, numba's and the decode pool's
workers), the decode pool itself, the arena numpy allocates a run's arrays from (`arena.kept`),
glibc's malloc thresholds and OpenBLAS's spin timeout.

These settings belong to the process, not to a model, so they live apart from `interp` (which
applies a model's options through the functions below) and from `ops` (whose decode kernels post
jobs to the pool: `pool.py`, `jobs.py`). `interp` and `generate` call only the names here.
Importing this package loads neither numpy nor numba, and changes nothing in the process: what
concerns the whole process (OpenBLAS's thread timeout, malloc's thresholds) is set by `runnx.load`,
the user's own call or the `runnx` command, whose process it is (`sleep_after_calls`, `keep_freed`).
"""
from __future__ import annotations

import operator

from runnx.runtime import arena
from runnx.runtime.allocator import keep_freed, keep_freed_if_asked
from runnx.runtime.open_jobs import defer, deferring, drop_deferred, opening, settle, take_leave
from runnx.runtime.openblas import sleep_after_calls


def set_threads(count: int) -> None:
    """Let BLAS, numba and the decode pool (count - 1 workers) use `count` threads from now on, for
    the whole process; 0 leaves the libraries' own counts (OPENBLAS_NUM_THREADS, NUMBA_NUM_THREADS,
    ... or the core count)."""
    from runnx.errors import InvalidOptionError
    try:
        whole = operator.index(count)
    except TypeError:
        whole = -1
    if isinstance(count, bool) or whole < 0:
        raise InvalidOptionError(f"threads must be a whole number >= 0 (0 leaves the libraries' own counts), "
                                 f"not {count!r} (runnx.runtime.set_threads, Options.threads, RUNNX_THREADS)")
    from runnx.runtime.thread_limits import apply_threads
    apply_threads(whole)


def threads() -> dict:
    """The thread counts in effect now: {'blas': threads (a list when BLAS libraries differ),
    'numba': threads, 'decode': the decode pool's (the caller's and its workers')}."""
    from runnx.runtime.thread_limits import thread_counts
    return thread_counts()


def pool_workers() -> int:
    """The decode pool's workers in effect now (0: jobs run on the calling thread)."""
    from runnx.runtime.pool import worker_count
    from runnx.ops import _native
    return worker_count() if _native.enabled else 0


def start_pool_in_background(model_path=None) -> None:
    """Start the decode pool on a thread of its own, beside a decoder's load (the first numba code a
    process loads carries numba's own start); nothing when the process runs one thread or the pool
    is there already (`pool_start.start_in_background`). The jobs every decoder calls are loaded too,
    unless `model_path` has a record of its kernels (`ops/kernel_loads.py`), which loads its own.
    RUNNX_KEEP_FREED is read first, as `runnx.load` reads it: before the threads allocate."""
    from runnx.runtime.pool_start import start_in_background
    keep_freed_if_asked()
    recorded = False
    if model_path is not None:
        from runnx.ops.kernel_loads import record_path
        path = record_path(model_path)
        recorded = path is not None and path.is_file()  # (records are written only when not empty)
    start_in_background(load_jobs=not recorded)


__all__ = ["arena", "defer", "deferring", "drop_deferred", "keep_freed", "keep_freed_if_asked", "opening",
           "pool_workers", "set_threads", "settle", "sleep_after_calls", "start_pool_in_background", "take_leave",
           "threads"]
