"""glibc's malloc keeps a run's freed temporaries mapped for the next run (imported by runnx/__init__.py).

By default glibc returns the top of its heap to the system once more than about twice its largest
recent allocation is free there: a Whisper encoder window's ~33 MB of temporaries were handed back
at the end of every window and faulted in again by the next one, 4,300 page faults a window (~7
ms on this project's machines; its first Conv 4.8 ms with its pages kept against 6.2), as a
process's decode steps after a prefill. Here the heap keeps up to TRIM_BYTES free at its top, and
serves arrays up to MMAP_BYTES (glibc's ceiling for it) from the heap instead of fresh mappings.
onnxruntime and PyTorch keep their freed memory the same way, in arenas of their own.

The process's peak memory is unchanged (the memory was in use at the peak); what stays mapped
after a run is at most TRIM_BYTES. Settings the user made win: glibc's own variables
(MALLOC_TRIM_THRESHOLD_, MALLOC_MMAP_THRESHOLD_, read when the process started) leave both alone,
and so does RUNNX_KEEP_FREED=0. Other C libraries, and other systems, are left alone.
"""
import ctypes
import os
import sys

TRIM_BYTES = 128 << 20
MMAP_BYTES = 32 << 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h


def _keep_freed() -> bool:
    """Set glibc's thresholds (True when set)."""
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
    # the mmap threshold first: setting either one stops glibc's own adjustment of both
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_BYTES)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_BYTES))


KEEPS_FREED = _keep_freed()
