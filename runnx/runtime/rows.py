"""A prompt's row kernels shared among runnx's threads.

A norm or an activation over a prompt's (or an encoder window's) rows computes each row alone, so
its rows can be cut into ranges, one a thread (this one and `helpers.py`'s), each computed by the
same compiled code as in one call: the same bits for any thread count. Left on one thread, these
passes were a sixth of a 2-thread prompt of 512 tokens, the other core idle. Shared from
SHARED_FROM elements (a hand-off costs some ten microseconds), and only while the decode pool's
workers are not spinning: a short prompt's products share their columns with them, and putting
them to sleep for the helpers, then waking them for the next product, cost more than the rows
gained (a 128-token prompt at 2 threads 7% slower). OpenBLAS's threads must sleep after their calls
(`openblas.py`), or the helpers would wait for a core.
"""
from __future__ import annotations

from runnx.runtime import helpers, openblas
from runnx.runtime import pool as decode_pool

SHARED_FROM = 1 << 16  # elements (rows x columns) from which a row kernel's rows are shared


def share_rows(work, rows: int, columns: int) -> None:
    """work(start, stop) for ranges of rows 0 .. rows covering each once: one range on one thread
    below SHARED_FROM elements, with one thread, inside another shared call, or while OpenBLAS's
    threads or the decode pool's workers spin; else one a thread, in order of rows (the first on
    this one). `work` must compute each row alone and release the GIL (numba's nogil, numpy's
    ufuncs)."""
    if rows * columns < SHARED_FROM:  # (a decode step's row: asked first, it costs nothing more)
        work(0, rows)
        return
    threads = decode_pool.worker_count() + 1
    if (threads < 2 or rows < threads or not openblas.THREADS_SLEEP or helpers.inside_parts()
            or decode_pool.workers_spinning()):
        work(0, rows)
        return
    decode_pool.rest_workers()
    bounds = [rows * t // threads for t in range(threads + 1)]
    helpers.run_parts(_range, [(work, start, stop) for start, stop in zip(bounds[:-1], bounds[1:])])


def _range(part) -> None:
    work, start, stop = part
    work(start, stop)
