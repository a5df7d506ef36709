"""A run's freed arrays kept for its next arrays of their size (numpy's memory handler, NEP 49).

A prompt's layers allocate the same large arrays one after the other (a 2,000-token prompt's gate
and up products are 12 MB each), and glibc's malloc hands such blocks back to the system when they
are freed and maps fresh pages for the next: each page's first touch is then a fault (microseconds
on a virtual machine), and with two threads an unmapping interrupts the other core as well.
onnxruntime keeps such memory in an arena of its own; `allocator.keep_freed` asks glibc to keep
it, but for the whole process, so runnx as a library does not by itself.

Here, while a model runs (`kept`, Options.arena), numpy allocates the calling thread's arrays
through a handler of runnx's: numpy keeps the handler in a context variable, so other threads, and
this one outside runs, keep theirs, and each array remembers the handler that allocated it. The
handler is libc's malloc, calloc, realloc and free (`arena_functions.py`, numba cfuncs: no GIL),
except that a block of KEPT_FROM bytes or more freed while any run is under way is kept (up to
KEPT_BYTES in all) and handed out again for the next request of exactly its size; when the last
run ends, every kept block goes back to libc. An array outliving its run is freed by libc as any
other. np.empty's contents are whatever they are, so a reused block changes no result; np.zeros
(calloc) never takes one.

The handler is made on a thread of its own the first time a model asks (`prepare`), its compiled
functions loaded from numba's cache (a tenth of a second): a run that starts before it is ready,
or while compiled kernels are off (`ops/_native.py`), allocates as numpy does by default; a process
that asked glibc to keep its freed memory (`allocator.keep_freed`) has no need of it.
"""
from __future__ import annotations

import ctypes
import os
import sys
import threading

from runnx.ops import _native
from runnx.runtime import allocator

KEPT_FROM = 1 << 20  # bytes: smaller blocks are malloc's own business (its heap reuses them)
KEPT_BYTES = 256 << 20  # at most this much kept at once

_handler = None  # (capsule, PyDataMem_SetHandler, state, arena_functions) once made; False where it cannot be
_handler_lock = threading.Lock()
_preparing: threading.Thread | None = None
_runs = 0  # runs under way in the process, under _handler_lock (the state's ACTIVE word too)
_depth = threading.local()  # this thread's nesting of `kept` (a subgraph's run inside a model's), and
# whether its outermost one set the handler (`holding`)


def supported() -> bool:
    """Whether this platform can have the handler: Linux with glibc's malloc family (numpy 2's C API)."""
    return sys.platform.startswith("linux")


def prepare() -> None:
    """Make the handler on a thread of its own, once per process (nothing where unsupported, nor
    while compiled kernels are off: its functions are numba's)."""
    global _preparing
    if _handler is not None or not _wanted():
        return
    with _handler_lock:
        if _preparing is None:
            _preparing = threading.Thread(target=_make_handler, name="runnx-arena", daemon=True)
            _preparing.start()


def _wanted() -> bool:
    """Whether runs should keep their arrays here: supported, compiled kernels on, and glibc not
    asked to keep freed memory for the whole process (`allocator.keep_freed`, the `runnx` command's
    and the benchmarks' setting: its heap then reuses any size, and exact-size slots beside it only
    hold memory it would have reused, a first 2,000-token prefill 4% slower)."""
    return supported() and _native.enabled and not allocator.kept()


def wait_prepared() -> bool:
    """Wait for the handler (`prepare` first); whether runs now keep their freed arrays."""
    prepare()
    if _preparing is not None:
        _preparing.join()
    return bool(_handler) and _wanted()


class kept:
    """A context in which this thread's numpy arrays come from the handler, once it is ready; the
    outermost one on a thread sets it and gives back numpy's previous one at its end."""

    __slots__ = ("_previous",)

    def __enter__(self):
        self._previous = None
        depth = getattr(_depth, "value", 0)
        _depth.value = depth + 1
        handler = _handler
        if depth or not handler or not _wanted():
            if handler is None:
                prepare()
            return self
        capsule, set_handler, state, functions = handler
        global _runs
        with _handler_lock:
            _runs += 1
            state[functions.ACTIVE] = _runs
        self._previous = set_handler(capsule)
        _depth.holding = True
        return self

    def __exit__(self, *exc):
        _depth.value -= 1
        previous = self._previous
        if previous is None:
            return False
        _, set_handler, state, functions = _handler
        set_handler(previous)  # (ctypes owns the references PyDataMem_SetHandler returns)
        _depth.holding = False
        global _runs
        with _handler_lock:
            _runs -= 1
            state[functions.ACTIVE] = _runs
            if not _runs:
                functions.release(state)
        return False


def _after_fork_in_child() -> None:
    """A forked child has only the forking thread: runs other threads had under way (and a lock one
    of them may have held) are not its own. Its count starts again from this thread's own runs, and
    what was kept goes back to libc when they end (at once, when there are none)."""
    global _runs, _handler_lock
    _handler_lock = threading.Lock()
    if not _handler:
        return
    state, functions = _handler[2], _handler[3]
    _runs = 1 if getattr(_depth, "holding", False) else 0
    state[functions.LOCK], state[functions.ACTIVE] = 0, _runs
    if not _runs:
        functions.release(state)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def kept_bytes() -> int:
    """Bytes kept for the runs under way (0 between runs)."""
    return int(_handler[2][_handler[3].KEPT]) if _handler else 0


def reused() -> int:
    """Blocks handed out again so far in this process."""
    return int(_handler[2][_handler[3].REUSED]) if _handler else 0


def _make_handler() -> None:
    global _handler
    from runnx.ops._jit_cache import switching_often  # (numba: its functions load from numba's cache)
    try:
        with switching_often():  # beside a model's load (kernel_loads.py)
            made = _build()
    except (AttributeError, OSError, ValueError, ImportError):
        made = False
    with _handler_lock:
        if _handler is None:
            _handler = made


def _build():
    """(capsule, PyDataMem_SetHandler, state, arena_functions). The state, the handler and the capsule's
    name live in memory never freed: an array made in a run may be freed at the interpreter's exit,
    after this module's objects."""
    import numpy as np

    from runnx.runtime import arena_functions as functions

    class Allocator(ctypes.Structure):
        _fields_ = [("ctx", ctypes.c_void_p), ("malloc", ctypes.c_void_p), ("calloc", ctypes.c_void_p),
                    ("realloc", ctypes.c_void_p), ("free", ctypes.c_void_p)]

    class Handler(ctypes.Structure):  # numpy's PyDataMem_Handler, version 1
        _fields_ = [("name", ctypes.c_char * 127), ("version", ctypes.c_uint8), ("allocator", Allocator)]

    libc = ctypes.CDLL(None)
    libc.calloc.argtypes, libc.calloc.restype = (ctypes.c_size_t, ctypes.c_size_t), ctypes.c_void_p
    words = functions.WORDS
    name = b"mem_handler\0"
    state_at = libc.calloc(8 * words + ctypes.sizeof(Handler) + len(name), 1)
    if not state_at:
        raise OSError("no memory for the arena's state")
    state = np.ctypeslib.as_array((ctypes.c_int64 * words).from_address(state_at))
    state[functions.MOST], state[functions.LEAST] = KEPT_BYTES, KEPT_FROM
    state[functions.HUGE_PAGES] = int(np._core.multiarray._get_madvise_hugepage())  # (as numpy's own does)
    functions.release(state)  # (loaded from numba's cache here, not at a run's end on the run's thread)
    handler = Handler.from_address(state_at + 8 * words)
    handler.name, handler.version = b"runnx_arena", 1
    handler.allocator = Allocator(state_at, *functions.addresses())
    name_at = state_at + 8 * words + ctypes.sizeof(Handler)
    ctypes.memmove(name_at, name, len(name))
    new_capsule = ctypes.pythonapi.PyCapsule_New
    new_capsule.argtypes, new_capsule.restype = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p), ctypes.py_object
    capsule = new_capsule(ctypes.addressof(handler), name_at, None)
    pointer = ctypes.pythonapi.PyCapsule_GetPointer
    pointer.argtypes, pointer.restype = (ctypes.py_object, ctypes.c_char_p), ctypes.c_void_p
    table = (ctypes.c_void_p * 307).from_address(pointer(np._core._multiarray_umath._ARRAY_API, None))
    set_handler = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.py_object)(table[304])  # PyDataMem_SetHandler
    return capsule, set_handler, state, functions
