"""Helper threads that share one kernel call's independent parts with the calling thread.

A prompt's product is split by rows (or columns) among as many threads as runnx has
(`ops/_matmul.py`), an encoder's attention by heads (`blas_split.py`); the parts run native code
that releases the GIL. The helpers are started once and kept (a thread
started per product would cost a tenth of a millisecond), and idle helpers sleep.
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

_lock = threading.Lock()
_executor: ThreadPoolExecutor | None = None
_size = 0


def _helpers(count: int) -> ThreadPoolExecutor:
    global _executor, _size
    with _lock:
        if _executor is None or _size < count:
            if _executor is not None:
                _executor.shutdown(wait=False)
            _executor = ThreadPoolExecutor(max_workers=count, thread_name_prefix="runnx-helper")
            _size = count
        return _executor


def run_parts(work, parts: list) -> None:
    """work(part) for every part: the first on this thread, each other on a helper, returning when
    all are done (the first failure is raised, after every part has ended). Inside a part (on
    whichever thread runs it) every part runs on that thread, in order: a part's own products split
    again would wait for helpers busy with its siblings, and would wait forever (the split's BLAS
    setting is the process's, which a model loading on another thread may raise meanwhile)."""
    if len(parts) < 2 or inside_parts():
        for part in parts:
            work(part)
        return
    futures = [_helpers(len(parts) - 1).submit(_as_part, work, part) for part in parts[1:]]
    try:
        _as_part(work, parts[0])
    finally:
        for future in futures:
            future.exception()  # waits; an arrays' user must not return while a helper reads them
    for future in futures:
        if (error := future.exception()) is not None:
            raise error


_running = threading.local()  # .part: whether this thread runs a part now


def inside_parts() -> bool:
    """Whether this thread is running a part of `run_parts`."""
    return getattr(_running, "part", False)


def _as_part(work, part) -> None:
    _running.part = True
    try:
        work(part)
    finally:
        _running.part = False
