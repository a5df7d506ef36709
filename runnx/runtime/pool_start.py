"""The decode pool's start on a thread of its own beside a decoder's load (`start_in_background`),
and the compiled code it loads ahead from numba's cache: the workers' loop, the jobs every decoder
calls first and a prompt's products' kernels, each slow on a process's first call."""
from __future__ import annotations

import threading

import numpy as np

from runnx.ops import _native
from runnx.ops._jit_cache import switching_often
from runnx.ops._kernels_linalg import chunk_count
from runnx.runtime import pool as decode_pool
from runnx.runtime.jobs import open_products, post_gelu, post_products, post_softmax
from runnx.runtime.mailbox import finish_and_release, make_board

_starting: threading.Thread | None = None
_products_loaded = False  # `_load_products` has run in this process


def start_in_background(load_jobs: bool = True) -> None:
    """Start the pool on a thread of its own while the caller loads a decoder: its start loads the
    workers' loop from numba's cache, the first numba code of a process (with numba's own start,
    a noticeable part of a first transcription), then the jobs every decoder calls (`_load_jobs`)
    and the products' kernels of a prompt (with no workers, the unit loop and those kernels alone);
    not those with `load_jobs` False: a model's record of its kernels loads what it calls, and only
    that (a 4-bit model's prompt calls no float32 product kernel: loading them would only contend
    with its first token).
    Not a daemon thread: a process ending while numba loads aborts inside LLVM, so the interpreter
    waits for it at exit."""
    global _starting
    if not _native.enabled or (_starting is not None and _starting.is_alive()):
        return
    if decode_pool._pool is None and decode_pool.worker_count() > 0:
        _starting = threading.Thread(target=_start_and_load, args=(load_jobs,), name="runnx-decode-start")
    elif not _products_loaded:
        _starting = threading.Thread(target=_load_alone, args=(load_jobs,), name="runnx-products-load")
    else:
        return
    _starting.start()


def _start_and_load(load_jobs: bool) -> None:
    with switching_often():  # beside a model's load (kernel_loads.py)
        _import_for_numba_typing()
        _find_blas()
        decode_pool.pool()
        if load_jobs:
            _load_jobs()
            _load_products()


def _load_alone(load_products: bool) -> None:
    """With no workers: the unit loop that jobs run alone call (`pool.alone`: a decoder's attention, a
    prompt's softmax), then the products' kernels unless a model's record loads what it calls."""
    with switching_often():
        _import_for_numba_typing()
        _find_blas()
        make_board()
        if load_products:
            _load_products()


def _import_for_numba_typing() -> None:
    """numpy.ma, which numba's typing of an array argument imports on a process's first call of a
    kernel from Python (8-24 ms, in the first prompt's first kernel call otherwise)."""
    import numpy.ma  # noqa: F401


def _find_blas() -> None:
    """Which BLAS numpy loaded, and so which kernels take a prompt's products (`ops/_matmul.py`):
    threadpoolctl looks through every library the process loaded (6-9 ms, in a first prompt's first
    product otherwise)."""
    from runnx.ops._matmul import own_product
    own_product(1, True)


def _load_products() -> None:
    """A prompt's products' kernel (`ops/_matmul.py`), loaded from numba's cache: with one thread
    too, where there is no pool to start."""
    global _products_loaded
    from runnx.ops._matmul import load_kernels
    load_kernels()
    _products_loaded = True


def _load_jobs() -> None:
    """The jobs a decoder calls first, loaded from numba's cache (or compiled) for the types its
    calls give them, each slow on a first call: one row and a few (a prompt's) times one read-only
    matrix (an LM head), two (a gated MLP's gate and up) and three (a layer's projections), a rows'
    softmax and GELU (an encoder's, its bias read-only or not), and the same products left open
    (`open_products`, then `finish`). Computed alone, on zeros."""
    matrix = np.zeros((4, 4), np.float32)
    matrix.flags.writeable = False
    board, _ = make_board()
    for row in (np.zeros(4, np.float32), np.zeros((2, 4), np.float32)):
        for count in (1, 2, 3):
            outs = tuple([np.empty(row.size, np.float32) for _ in range(count)])
            scratch = np.empty(chunk_count(4) * row.size * count, np.float32)
            decode_pool.alone(post_products, row, (matrix,) * count, outs, scratch, 0.0, 1.0)
            open_products(board, 0, row, (matrix,) * count, outs, scratch, 0.0, 1.0)
            finish_and_release(board)
    rows = np.zeros((2, 4), np.float32)
    decode_pool.alone(post_softmax, rows, 0.0)
    for bias in (np.zeros(4, np.float32), matrix[0]):
        decode_pool.alone(post_gelu, rows, bias, 1.0, 1.0, 0.5, np.empty_like(rows))
