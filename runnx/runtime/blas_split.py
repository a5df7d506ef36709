"""Independent parts of a job shared among Python threads that each run BLAS single-threaded.

BLAS parallelises each product over its threads. A batch of independent parts with work between
their products (an encoder's attention: per head, blocks of a scores product, a softmax and a
product with the values) runs better as whole parts per thread, each thread with BLAS to itself:
no barrier inside every product, and each thread's scores stay in its own cache. BLAS's thread
count is the process's, so it is lowered to one for the duration, by one caller at a time; the
numeric kernels run between products must release the GIL (numba's nogil). OpenBLAS's own
threads must sleep right after their calls (`openblas.py`): spinning beside the helpers
they made the same attention 1.5x slower than BLAS's threads alone, so it is not split then.
"""
from __future__ import annotations

import threading

from runnx.runtime import helpers, openblas
from runnx.runtime import pool as decode_pool

_lock = threading.Lock()
_controllers = None  # threadpoolctl's BLAS libraries, found once


def blas_libraries() -> list:
    """threadpoolctl's controllers of the BLAS libraries loaded (found once)."""
    global _controllers
    if _controllers is None:
        import threadpoolctl

        _controllers = [c for c in threadpoolctl.ThreadpoolController().lib_controllers if c.user_api == "blas"]
    return _controllers


def blas_threads() -> int:
    """The threads BLAS may use now (runnx's thread count once set: `thread_limits.py`)."""
    return min((c.num_threads for c in blas_libraries()), default=1)


def split_among_threads(work, parts: list, calls_blas: bool = True) -> bool:
    """work(part) for every part, the parts dealt round-robin to as many threads (this one and
    helpers) as BLAS has, BLAS single-threaded meanwhile (the parts' own products, runnx's kernels
    included, are then not split further). False, having run nothing, when BLAS has one thread (or
    none is known), there is one part, the parts call BLAS (`calls_blas`) while OpenBLAS's threads
    spin after their calls, or another caller is splitting (the BLAS setting is the process's)."""
    if calls_blas and not openblas.THREADS_SLEEP:
        return False
    blas = blas_libraries()
    count = min(blas_threads(), len(parts))
    if count < 2 or not _lock.acquire(blocking=False):
        return False
    previous = [c.num_threads for c in blas]
    try:
        decode_pool.rest_workers()  # spinning decode workers would hold the cores
        for c in blas:
            c.set_num_threads(1)
        helpers.run_parts(lambda index: _each(work, parts[index::count]), list(range(count)))
    finally:
        for c, threads in zip(blas, previous):
            c.set_num_threads(threads)
        _lock.release()
    return True


def _each(work, parts: list) -> None:
    for part in parts:
        work(part)
