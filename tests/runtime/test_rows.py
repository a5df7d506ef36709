"""A prompt's row kernels shared among threads (runnx/runtime/rows.py): every row computed once, on
as many threads as runnx has, only where it pays; and each kernel that shares its rows gives the
same bits as one call on one thread."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import runnx

from runnx.ops import (_attention_blocks, contrib_group_query_attention, contrib_normalization, contrib_quantized,
                       fused_layer_norm_blocks, fused_norms, fused_rotary, normalization)
from runnx.runtime import openblas, rows
from runnx.runtime import pool as decode_pool


@pytest.fixture
def threads(monkeypatch):
    """Set runnx's thread count (the decode pool's workers + 1) for `share_rows`, OpenBLAS's
    threads sleeping after their calls as after a load (`openblas.sleep_after_calls`) and the pool's
    workers taken as asleep (a prompt attention's pool job leaves them spinning a while)."""
    monkeypatch.setattr(openblas, "THREADS_SLEEP", True)
    monkeypatch.setattr(decode_pool, "workers_spinning", lambda: False)

    def count(n: int) -> None:
        monkeypatch.setattr(decode_pool, "worker_count", lambda: n - 1)

    return count


def _ranges(row_count: int, columns: int) -> list:
    seen, lock = [], threading.Lock()

    def work(start, stop):
        with lock:
            seen.append((start, stop, threading.get_ident()))

    rows.share_rows(work, row_count, columns)
    return sorted(seen)


def test_a_prompts_rows_are_cut_into_one_range_a_thread_covering_each_row_once(threads):
    threads(2)
    seen = _ranges(301, 512)
    assert [(start, stop) for start, stop, _ in seen] == [(0, 150), (150, 301)]
    assert len({ident for _, _, ident in seen}) == 2
    threads(3)
    assert [(start, stop) for start, stop, _ in _ranges(301, 512)] == [(0, 100), (100, 200), (200, 301)]


def test_rows_stay_on_the_calling_thread_where_sharing_would_not_pay_or_could_not_run(threads, monkeypatch):
    here = threading.get_ident()
    threads(2)
    assert _ranges(1, 576) == [(0, 1, here)]  # a decode step's row
    assert _ranges(rows.SHARED_FROM // 512 - 1, 512) == [(0, rows.SHARED_FROM // 512 - 1, here)]
    threads(1)
    assert _ranges(301, 512) == [(0, 301, here)]
    threads(2)
    monkeypatch.setattr(openblas, "THREADS_SLEEP", False)  # OpenBLAS's threads would spin beside the helpers
    assert _ranges(301, 512) == [(0, 301, here)]


def test_a_ranges_failure_reaches_the_caller(threads):
    threads(2)

    def work(start, stop):
        if start:
            raise ValueError("the second range failed")

    with pytest.raises(ValueError, match="the second range failed"):
        rows.share_rows(work, 301, 512)


def _cases(rng):
    """(name, call) pairs of the kernels that share their rows, on 3 x 97 rows of 700 (rows uneven
    among threads, a row not a multiple of a vector), gates reaching exp's overflow; a prompt's
    attention under a causal mask of 300 positions."""
    x = rng.standard_normal((3, 97, 700)).astype(np.float32)
    y = rng.standard_normal((3, 97, 700)).astype(np.float32)
    gate = (rng.standard_normal((3, 97, 700)) * 40).astype(np.float32)
    weight = rng.standard_normal(700).astype(np.float32)
    bias = rng.standard_normal(700).astype(np.float32)
    epsilon, one = np.array(1e-5, np.float32), np.array(1.0, np.float32)
    query = rng.standard_normal((1, 4, 300, 32)).astype(np.float32)
    keys, values = (rng.standard_normal((1, 2, 300, 32)).astype(np.float32) for _ in range(2))
    causal = np.triu(np.full((300, 300), -np.inf, np.float32), 1)[None, None]  # each row's visible keys found alone
    positions = 301  # a prompt's rotary embedding and cache growth, after 3 positions, in the caches' buffers
    rotated_query = rng.standard_normal((1, positions, 4, 64)).astype(np.float32).transpose(0, 2, 1, 3)
    new_key, new_value = (rng.standard_normal((1, 2, positions, 64)).astype(np.float32) for _ in range(2))
    caches = [runnx.with_capacity(rng.standard_normal((1, 2, 3, 64)).astype(np.float32), 2, positions + 8).array
              for _ in range(2)]
    cos, sin = (rng.standard_normal((1, 1, positions, 64)).astype(np.float32) for _ in range(2))
    half = np.array([32], np.int64)
    rope = (rotated_query, new_key, new_value, *caches, cos, sin, half, half, cos, sin, half, half)
    packed = rng.standard_normal((1, positions, 8, 64)).astype(np.float32)  # a packed QKV: 4 query heads, 2 KV heads
    angles = [rng.standard_normal((positions + 10, 32)).astype(np.float32) for _ in range(2)]
    group_query_rows = (packed[:, :, :4], packed[:, :, 4:6], packed[:, :, 6:], None, None,
                        np.arange(3, 3 + positions)[None], np.zeros(1, np.int64), positions, *angles)
    return [
        ("GroupQueryAttention's rotary and append", lambda: contrib_group_query_attention._rotate_and_append(
            *group_query_rows, False, (), None)),
        ("4-bit products' rows in lanes order", lambda: contrib_quantized.lanes_order(x.reshape(-1, 700))),
        ("SkipSimplifiedLayerNormalization", lambda: contrib_normalization.SkipSimplifiedLayerNormalization(
            x, y, weight, bias, output_count=4)),
        ("SkipLayerNormalization", lambda: contrib_normalization.SkipLayerNormalization(
            x, y, weight, bias, bias, output_count=4)),
        ("RopeAppend", lambda: fused_rotary.RopeAppend(*rope, key_cache_axis=2, value_cache_axis=2, overwrite=(3, 4))),
        ("attend_blocks", lambda: _attention_blocks.attend_blocks(query, keys, values, causal, 0.0)),
        ("RMSNorm", lambda: fused_norms.RMSNorm(x, weight, epsilon=epsilon, one=one)),
        ("AddRMSNorm", lambda: fused_norms.AddRMSNorm(x, y, weight, epsilon=epsilon, one=one)),
        ("SiluMul", lambda: fused_norms.SiluMul(gate, y)),
        ("AddLayerNorm", lambda: fused_layer_norm_blocks.AddLayerNorm(x, y, weight, bias)),
        ("LayerNormalization", lambda: normalization.LayerNormalization(x, weight, bias)),
    ]


def _bits(result):
    results = result if isinstance(result, (tuple, list)) else (result,)
    return [r.view(np.uint32).copy() for r in results]


def test_each_kernel_sharing_its_rows_gives_the_one_thread_bits(threads, monkeypatch):
    shared, parts = {}, []
    run_parts = rows.helpers.run_parts
    monkeypatch.setattr(rows.helpers, "run_parts",
                        lambda work, ranges: parts.append(len(ranges)) or run_parts(work, ranges))
    for count in (2, 3):
        threads(count)
        with np.errstate(over="ignore"):
            shared[count] = {}
            for name, call in _cases(np.random.default_rng(0)):
                parts.clear()
                shared[count][name] = _bits(call())
                assert parts == [count], (name, count)  # its rows went to `count` threads
    threads(2)
    monkeypatch.setattr(rows, "SHARED_FROM", 1 << 40)  # every call on one thread
    with np.errstate(over="ignore"):
        alone = {name: _bits(call()) for name, call in _cases(np.random.default_rng(0))}
    for name, bits in alone.items():
        for count in (2, 3):
            assert all(np.array_equal(a, b) for a, b in zip(bits, shared[count][name])), (name, count)


def test_rows_stay_on_the_caller_while_the_pools_workers_spin_after_a_job(monkeypatch):
    # a short prompt's products are pool jobs: resting the workers for the rows, then waking them
    # for the next product, cost more than sharing the rows gained
    monkeypatch.setattr(openblas, "THREADS_SLEEP", True)
    decode_pool.set_workers(1)
    try:
        workers = decode_pool.pool()
        matrix = np.ones((1024, 512), np.float32)
        here, stayed = threading.get_ident(), False
        deadline = time.monotonic() + 10
        while not stayed and time.monotonic() < deadline:  # (a job the caller finished alone wakes no one)
            workers.products(np.ones(1024, np.float32), (matrix,))  # the worker spins a while after it
            stayed = decode_pool.workers_spinning() and _ranges(301, 512) == [(0, 301, here)]
        assert stayed
        decode_pool.rest_workers()
        deadline = time.monotonic() + 10
        while decode_pool.workers_spinning() and time.monotonic() < deadline:
            time.sleep(0.001)
        assert not decode_pool.workers_spinning()
        assert len({ident for _, _, ident in _ranges(301, 512)}) == 2
    finally:
        decode_pool.set_workers(None)


def test_a_prompts_rotary_embedding_shared_among_threads_is_the_unfused_arithmetic(threads):
    threads(2)
    rng = np.random.default_rng(3)
    query = rng.standard_normal((1, 301, 4, 64)).astype(np.float32).transpose(0, 2, 1, 3)  # split heads: a view
    key, value, past_key, past_value = (rng.standard_normal((1, 2, n, 64)).astype(np.float32) for n in (301, 301, 3, 3))
    caches = [runnx.with_capacity(past, 2, 320).array for past in (past_key, past_value)]
    cos, sin = (rng.standard_normal((1, 1, 301, 64)).astype(np.float32) for _ in range(2))
    half = np.array([32], np.int64)
    rotated, keys, values = fused_rotary.RopeAppend(query, key, value, *caches, cos, sin, half, half, cos, sin, half, half,
                                             key_cache_axis=2, value_cache_axis=2, overwrite=(3, 4))
    rotate = lambda x: x * cos + np.concatenate([-x[..., 32:], x[..., :32]], axis=-1) * sin  # noqa: E731
    np.testing.assert_array_equal(rotated, rotate(query))
    np.testing.assert_array_equal(keys, np.concatenate([past_key, rotate(key)], 2))
    np.testing.assert_array_equal(values, np.concatenate([past_value, value], 2))
    assert keys.base is caches[0].base and values.base is caches[1].base  # grown in their buffers
