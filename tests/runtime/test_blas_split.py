"""Parts of a job shared among Python threads, each with single-threaded BLAS: every part runs once,
on as many threads as BLAS had, BLAS's thread count comes back, a part's failure reaches the caller,
and an encoder's attention split by heads is bitwise the one-thread computation."""
from __future__ import annotations

import threading

import numba
import numpy as np
import pytest
import threadpoolctl

from runnx.ops import _attention_blocks, fused_layer_norm_blocks
from runnx.runtime import blas_split
from runnx.runtime import openblas


@pytest.fixture
def sleeping_blas(monkeypatch):
    """As after a load (`openblas.sleep_after_calls`): OpenBLAS's threads sleep after a call."""
    monkeypatch.setattr(openblas, "THREADS_SLEEP", True)
    with threadpoolctl.threadpool_limits(2, user_api="blas"):
        yield


def _blas_threads() -> list:
    return [c.num_threads for c in blas_split.blas_libraries()]


def test_every_part_runs_once_on_two_threads_with_blas_single_threaded_meanwhile(sleeping_blas):
    seen, lock = [], threading.Lock()

    def work(part):
        with lock:
            seen.append((part, threading.get_ident(), tuple(_blas_threads())))

    assert blas_split.split_among_threads(work, list(range(7)))
    assert sorted(part for part, _, _ in seen) == list(range(7))
    assert len({ident for _, ident, _ in seen}) == 2
    assert all(set(threads) == {1} for _, _, threads in seen)
    assert set(_blas_threads()) == {2}


def test_a_failing_part_raises_on_the_caller_and_blas_gets_its_threads_back(sleeping_blas):
    def work(part):
        if part == 3:
            raise ValueError("part 3 failed")

    with pytest.raises(ValueError, match="part 3 failed"):
        blas_split.split_among_threads(work, list(range(6)))
    assert set(_blas_threads()) == {2}
    assert blas_split.split_among_threads(lambda part: None, [0, 1])  # not left locked


def test_nothing_is_split_when_openblas_threads_spin_or_blas_has_one_thread(monkeypatch):
    ran = []
    monkeypatch.setattr(openblas, "THREADS_SLEEP", False)
    assert not blas_split.split_among_threads(ran.append, [0, 1])
    monkeypatch.setattr(openblas, "THREADS_SLEEP", True)
    with threadpoolctl.threadpool_limits(1, user_api="blas"):
        assert not blas_split.split_among_threads(ran.append, [0, 1])
    assert ran == []


def test_parts_that_call_no_blas_are_split_even_while_openblas_threads_spin(monkeypatch):
    """runnx's own products (`ops/_matmul.py`) leave OpenBLAS's spinning threads idle."""
    ran, lock = [], threading.Lock()
    monkeypatch.setattr(openblas, "THREADS_SLEEP", False)

    def work(part):
        with lock:
            ran.append((part, threading.get_ident()))

    with threadpoolctl.threadpool_limits(2, user_api="blas"):
        assert blas_split.split_among_threads(work, [0, 1, 2], calls_blas=False)
    assert sorted(part for part, _ in ran) == [0, 1, 2] and len({ident for _, ident in ran}) == 2


def test_encoder_attention_split_by_heads_is_bitwise_the_one_thread_result(sleeping_blas, monkeypatch):
    rng = np.random.default_rng(0)
    heads = rng.standard_normal((1, 6, 300, 16)).astype(np.float32)
    keys = rng.standard_normal((1, 6, 16, 300)).astype(np.float32)
    values = rng.standard_normal((1, 6, 300, 16)).astype(np.float32)
    bias = rng.standard_normal((1, 1, 1, 300)).astype(np.float32)
    monkeypatch.setattr(fused_layer_norm_blocks, "_BLOCK_SCORES", 64 * 300)  # blocks of 64 rows, the last short
    monkeypatch.setattr(_attention_blocks, "POOLED", False)  # BLAS's products, not the pool's job
    split = fused_layer_norm_blocks.attention_in_blocks(heads, keys, values, bias, np.nan)
    threads = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        with threadpoolctl.threadpool_limits(1, user_api="blas"):
            alone = fused_layer_norm_blocks.attention_in_blocks(heads, keys, values, bias, np.nan)
    finally:
        numba.set_num_threads(threads)
    assert split.tobytes() == alone.tobytes()
    scores = heads.astype(np.float64) @ keys + bias
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    want = (weights / weights.sum(-1, keepdims=True)) @ values
    np.testing.assert_allclose(split, want.transpose(0, 2, 1, 3), rtol=1e-4, atol=1e-5)


def test_a_part_splitting_again_runs_its_parts_itself_even_when_blas_threads_came_back(sleeping_blas):
    """Inside a part, BLAS set back to two threads by another thread (a model loading applies its
    thread count), a product's own split used to wait for the helper busy with its sibling, for
    ever (a server's transcription hung so). Now a part's parts run on the part's thread."""
    from runnx.runtime import helpers
    ran, where = [], []

    def inner(part):
        where.append((part, threading.current_thread().name))

    def outer(part):
        threadpoolctl.threadpool_limits(2, user_api="blas")  # as a model loading on another thread would
        helpers.run_parts(inner, [(part, 0), (part, 1)])
        ran.append(part)

    finished = threading.Event()
    worker = threading.Thread(target=lambda: (blas_split.split_among_threads(outer, [0, 1], calls_blas=False),
                                              finished.set()), daemon=True)
    worker.start()
    assert finished.wait(60), "a part's own split waited for busy helpers"
    assert sorted(ran) == [0, 1]
    by_part = {}
    for (part, _), thread in where:
        by_part.setdefault(part, set()).add(thread)
    assert all(len(threads) == 1 for threads in by_part.values())  # each part's parts on its own thread
