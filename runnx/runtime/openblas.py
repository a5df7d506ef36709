"""OpenBLAS's thread timeout: its threads sleep right after each call instead of spinning.

OpenBLAS's threads spin for 2**28 cycles (~0.1 s) after each call, on the cores that the decode
pool's worker and runnx's own threads need: a decode step right after a prefill or an encoder ran
2-3x slower, an encoder's attention after its products 1.4x. With OPENBLAS_THREAD_TIMEOUT=4 (2**4
cycles) they sleep at once; waking costs microseconds, next to a GEMM's milliseconds.

OpenBLAS reads the variable when numpy loads it, and importing runnx changes nothing in the process.
So `sleep_after_calls` (called by `runnx.load`, and by the `runnx` command, whose process it is)
asks each OpenBLAS what it read (`openblas_thread_timeout`). A quick timeout read, or a slow one the
user set, is left as it is. Otherwise OpenBLAS reads its variables again (`openblas_read_env`): the
user's quick timeout set after numpy loaded it, or runnx's, set for that call only. Then its
threads are stopped (`blas_thread_shutdown_`, what its own fork handler calls), and its next
threaded call starts them anew with the timeout. Not while a thread that is not runnx's runs: it may
be inside a BLAS call, which stopping the threads under it would hang; a warning then says to set
the variable before numpy is imported.

THREADS_SLEEP says whether they sleep, for the code that runs BLAS on several threads of runnx's
(`blas_split.py`, `rows.py`). It is False until `sleep_after_calls` decides, and when no OpenBLAS
with threads of its own is loaded: another BLAS, or OpenBLAS on OpenMP's threads, waits in a way
runnx neither sees nor sets, so runnx keeps its own threads off the cores BLAS's may still hold.
"""
from __future__ import annotations

import os
import threading

VARIABLE = "OPENBLAS_THREAD_TIMEOUT"
TIMEOUT = "4"
QUICK = range(1, 9)  # timeouts read that sleep at once (OpenBLAS raises 1-3 to 4, spins 2**value cycles)

THREADS_SLEEP = False  # whether OpenBLAS's threads sleep right after a call in this process (above)
_decided = False
_warned = False
_lock = threading.Lock()


def sleep_after_calls() -> bool:
    """Whether OpenBLAS's threads sleep right after each call now, having them do so when nobody
    chose otherwise (decided once per process; tried again while another thread ran)."""
    global THREADS_SLEEP, _decided
    with _lock:
        if not _decided:
            sleeping = _decide()
            if sleeping is not None:
                THREADS_SLEEP, _decided = sleeping, True
        return THREADS_SLEEP


def _decide() -> bool | None:
    """Whether OpenBLAS's threads sleep after their calls, restarting them with TIMEOUT when the
    environment leaves it unset; None when a thread that is not runnx's runs (nothing restarted)."""
    libraries = _openblas_libraries()
    spinning = [library for library in libraries if library.openblas_thread_timeout() not in QUICK]
    if not libraries or not spinning:
        return bool(libraries)
    given = os.environ.get(VARIABLE)
    if given is not None and not _quick(given):  # the user's choice: their threads spin
        return False
    if _other_threads_running():
        _warn_spinning()
        return None
    for library in spinning:  # (a quick timeout the user set after numpy loaded OpenBLAS is read now)
        _read_timeout(library, given)
        library.blas_thread_shutdown_()
    return True


def _quick(value: str) -> bool:
    """Whether OpenBLAS would read `value` as a timeout that sleeps at once (it reads it by atoi)."""
    return value.strip().isdigit() and int(value) in QUICK


def _read_timeout(library, given: str | None) -> None:
    """OpenBLAS reads its variables, with TIMEOUT set unless the user gave one, the environment as
    it was afterwards."""
    if given is not None:
        library.openblas_read_env()
        return
    os.environ[VARIABLE] = TIMEOUT
    try:
        library.openblas_read_env()
    finally:
        del os.environ[VARIABLE]


def _other_threads_running() -> bool:
    current = threading.current_thread()
    return any(t is not current and not t.name.startswith("runnx-") for t in threading.enumerate())


def _warn_spinning() -> None:
    """Say once per process that OpenBLAS's threads keep spinning, when it runs more than one."""
    global _warned
    from runnx.runtime.blas_split import blas_threads
    if not _warned and blas_threads() > 1:
        _warned = True
        import warnings
        warnings.warn("runnx: other threads are running, so OpenBLAS's threads keep spinning ~0.1 s after each "
                      "call on the cores runnx's threads need (multi-threaded runs up to 1.5x slower); set "
                      f"{VARIABLE}={TIMEOUT} in the environment before numpy is imported", RuntimeWarning,
                      stacklevel=5)


def _openblas_libraries() -> list:
    """The OpenBLAS libraries loaded (threadpoolctl finds them) that export the functions
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
            library.openblas_thread_timeout, library.openblas_read_env, library.blas_thread_shutdown_  # noqa: B018
        except (OSError, AttributeError):
            return []
        found.append(library)
    return found
