"""glibc's malloc keeps a run's freed temporaries mapped for the next run, when the user asks:
`runnx.keep_freed()`, RUNNX_KEEP_FREED=1 (read by `runnx.load`), or running the `runnx` command
(its own process: `runnx/cli.py` asks unless RUNNX_KEEP_FREED=0). A library changes a process's
allocator only when told to.

By default glibc returns the top of its heap to the system once more than about twice its largest
recent allocation is free there, and serves arrays above its mmap threshold from fresh mappings: a
Whisper encoder window's temporaries were handed back at the end of every window and faulted in
again by the next one (4,300 page faults a window, ~7 ms; an AddLayerNorm of 1500 x 384 rows 1.14
ms with its output's 430 faults, 0.78 without), as were a process's decode steps after a prefill.
Here the heap keeps up to TRIM_BYTES free at its top, and serves arrays up to MMAP_BYTES (glibc's
ceiling for it) from the heap. onnxruntime and PyTorch keep their freed memory the same way, in
arenas of their own. And every thread allocates from the one heap (ARENAS): glibc gives each thread
that allocates an arena of its own (up to eight a core), and what a thread frees is kept in its
arena for that thread alone, so the decode pool's workers, the helpers and the loading threads each
kept their own high-water mark beside the main thread's (Whisper tiny.en, three clips: peak RSS 369
-> 362 MiB with one thread, 377 -> 368 with two; no change in speed: runnx's threads allocate a few
scratch arrays a job, and small requests come from each thread's cache without the heap's lock).
Asked before runnx starts its threads (`runnx.load`, `runtime.start_pool_in_background`).

The settings are the process's, so a process that did not ask keeps glibc's defaults (set for
every process that imported runnx, they raised some processes' peak memory by 14-29%). What stays
mapped after a run is at most TRIM_BYTES. Settings the user made win: glibc's own variables
(MALLOC_TRIM_THRESHOLD_, MALLOC_MMAP_THRESHOLD_, read when the process started) leave all three
alone, MALLOC_ARENA_MAX the arenas, and RUNNX_KEEP_FREED=0 everything. Threads that allocated before
the call keep the arenas they have. Other C libraries, and other systems, are left alone.
"""
from __future__ import annotations

import ctypes
import os
import sys

TRIM_BYTES = 128 << 20
MMAP_BYTES = 32 << 20
ARENAS = 1
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8  # glibc's malloc.h

_kept: bool | None = None  # None: not tried yet in this process


def keep_freed() -> bool:
    """Ask glibc's malloc to keep a run's freed temporaries mapped for the next run, for this whole
    process (a trim threshold of TRIM_BYTES, arrays up to MMAP_BYTES from the heap): worth it in a
    process that runs models many times (a transcription's encoder windows would otherwise fault
    their arrays in again every window). Once per process; whether they are set (not on other C
    libraries, nor when RUNNX_KEEP_FREED=0 or glibc's own variables are set)."""
    global _kept
    if _kept is None:
        _kept = _set_thresholds()
    return _kept


def kept() -> bool:
    """Whether glibc keeps freed memory for this process (`keep_freed` asked, and set)."""
    return bool(_kept)


def keep_freed_if_asked() -> bool:
    """`keep_freed` when RUNNX_KEEP_FREED asks for it (1, true, yes, on); what `runnx.load` calls."""
    value = os.environ.get("RUNNX_KEEP_FREED", "").strip().lower()
    return keep_freed() if value in ("1", "true", "yes", "on") else False


def _set_thresholds() -> bool:
    if not sys.platform.startswith("linux") or os.environ.get("RUNNX_KEEP_FREED") == "0":
        return False
    if any(name in os.environ for name in ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_")):
        return False
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # glibc only: musl's mallopt does nothing, others lack it
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    if "MALLOC_ARENA_MAX" not in os.environ:
        mallopt(_M_ARENA_MAX, ARENAS)
    # the mmap threshold first: setting either one stops glibc's own adjustment of both
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_BYTES)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_BYTES))
