"""OpenBLAS's thread timeout: its threads sleep right after each call instead of spinning.

OpenBLAS's threads spin for 2**28 cycles (~0.1 s) after each call, on the cores that the decode
pool's worker and runnx's own threads need: a decode step right after a prefill or an encoder ran
2-3x slower, an encoder's attention after its products 1.4x. 2**4 cycles: they sleep at once
(waking costs microseconds, next to a GEMM's milliseconds). OpenBLAS reads the variable when numpy
loads it, so `import runnx` sets it (unless the environment does) before numpy loads; a process
that imported numpy first gets the same from `sleep_after_calls` when it loads a model: OpenBLAS
reads its variables again (`openblas_read_env`) and stops its threads (`blas_thread_shutdown_`,
what its own fork handler calls), which its next threaded call starts anew with the timeout. An
explicit setting wins.
"""
import os
import sys
import threading

TIMEOUT = "4"
_given = os.environ.get("OPENBLAS_THREAD_TIMEOUT")
_loaded = "numpy" in sys.modules  # OpenBLAS has read the variable already
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", TIMEOUT)

# whether OpenBLAS's threads sleep right after a call in this process (when they spin, other
# threads running BLAS alongside them share the cores with them: `blas_split.py`)
THREADS_SLEEP = int(_given) <= 8 if _given and _given.strip().isdigit() else not _loaded
_lock = threading.Lock()


def sleep_after_calls() -> bool:
    """Whether OpenBLAS's threads sleep right after each call now: when OpenBLAS was loaded before
    runnx and the environment gave no timeout, its threads are restarted with runnx's (once per
    process, by `runnx.load`). Not while a thread that is not runnx's runs: it may be inside a BLAS
    call, which stopping the threads under it would hang."""
    global THREADS_SLEEP
    with _lock:
        if THREADS_SLEEP or _given is not None or os.environ.get("OPENBLAS_THREAD_TIMEOUT") != TIMEOUT:
            return THREADS_SLEEP
        current = threading.current_thread()
        if any(t is not current and not t.name.startswith("runnx-") for t in threading.enumerate()):
            _warn_spinning()
            return False
        libraries = _openblas_libraries()
        for library in libraries:
            library.openblas_read_env()
            library.blas_thread_shutdown_()
        THREADS_SLEEP = bool(libraries)
        return THREADS_SLEEP


def _warn_spinning() -> None:
    """Say once per process that OpenBLAS's threads keep spinning, when it runs more than one."""
    global _warned
    from runnx.runtime.blas_split import blas_threads
    if not _warned and _openblas_libraries() and blas_threads() > 1:
        _warned = True
        import warnings
        warnings.warn("runnx: numpy loaded OpenBLAS before runnx, and other threads are running, so OpenBLAS's "
                      "threads keep spinning ~0.1 s after each call on the cores runnx's threads need (multi-"
                      "threaded runs up to 1.5x slower); set OPENBLAS_THREAD_TIMEOUT=4 in the environment before "
                      "numpy is imported, or import runnx first", RuntimeWarning, stacklevel=4)


_warned = False


def _openblas_libraries() -> list:
    """The OpenBLAS libraries loaded (threadpoolctl finds them) that export the two functions
    `sleep_after_calls` calls; [] when any does not, or runs threads of another kind than its own
    (OpenMP's: the timeout is its own threads')."""
    import ctypes

    from runnx.runtime.blas_split import blas_libraries
    found = []
    for controller in blas_libraries():
        if controller.internal_api != "openblas":
            continue
        if getattr(controller, "threading_layer", "pthreads") != "pthreads":
            return []
        try:
            library = ctypes.CDLL(controller.filepath)
            library.openblas_read_env, library.blas_thread_shutdown_  # noqa: B018 (present?)
        except (OSError, AttributeError):
            return []
        found.append(library)
    return found
