"""The decode pool (runnx/runtime/pool.py): one-row products and attention shared with
spinning worker threads, bitwise what one thread computes, safe when the pool is busy or asleep."""
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import llvmlite.binding as llvm
import numpy as np
import pytest

from runnx.ops import _attention_blocks, _kernels_gemm as gemm, _matmul
from runnx.ops._kernels_attention_blocks import visible_ends
from runnx.ops._kernels_fused import ATTENTION_SPAN
from runnx.ops._kernels_linalg import ROW_CHUNKS, chunk_count, row_times_matrix
from runnx.ops.linalg import MatMul
from runnx.runtime import jobs, mailbox, prompt_jobs, slots
from runnx.runtime import pool as decode_pool, pool_start

RNG = np.random.default_rng(0)
needs_avx512 = pytest.mark.skipif(not gemm.AVAILABLE, reason="this CPU has neither AVX-512 nor AVX2 with FMA: numpy's BLAS multiplies")
_HOST_FMA = bool(llvm.get_host_cpu_features().get("fma"))
# (depth, width): fewer rows than chunks, rows not a multiple of four, wide rows (four per pass), an
# LM head's width (its partial rows added by the pool in blocks of columns, the last one short)
SHAPES = [(3, 5), (13, 7), (576, 192), (1537, 96), (64, 1100), (40, 5 * slots.SUM_BLOCK + 13)]


@pytest.fixture
def pool():
    decode_pool.set_workers(2)
    yield decode_pool.pool()
    decode_pool.set_workers(None)


def _some_awake(pool, workers: int) -> bool:
    """Whether one of `workers` is awake (spinning), waiting up to a second for a woken one to run."""
    deadline = time.monotonic() + 1
    while all(pool.box[slots.IDLE:slots.IDLE + workers]) and time.monotonic() < deadline:
        time.sleep(0.0001)
    return not all(pool.box[slots.IDLE:slots.IDLE + workers])


def _asleep(pool, workers: int) -> bool:
    """Whether all `workers` of `pool` are asleep (waiting up to 10 s for their patience to run out)."""
    deadline = time.monotonic() + 10
    while not all(pool.box[slots.IDLE:slots.IDLE + workers]) and time.monotonic() < deadline:
        time.sleep(0.001)
    return all(pool.box[slots.IDLE:slots.IDLE + workers])


def _chunked_sum(row, matrix):
    """The documented order: in each chunk of rows, rows k, k + q, k + 2q, k + 3q (q a quarter of
    the chunk) for k from the chunk's start, then the rows left over in order; chunk results added
    in order."""
    depth = matrix.shape[0]
    chunks = max(1, min(ROW_CHUNKS, depth))
    partials = []
    for index in range(chunks):
        start, stop = depth * index // chunks, depth * (index + 1) // chunks
        quarter = (stop - start) // 4
        order = [k + j * quarter for k in range(start, start + quarter) for j in range(4)]
        partial = np.zeros(matrix.shape[1], matrix.dtype)
        for k in order + list(range(start + 4 * quarter, stop)):
            partial = partial + row[k] * matrix[k]
        partials.append(partial)
    total = partials[0]
    for partial in partials[1:]:
        total = total + partial
    return total


def _exact_products(shape, dtype) -> np.ndarray:
    """Numbers of 7 significant bits over a wide range of exponents: their products are exact, so
    a fused multiply-add rounds as a product and a sum do, while their sums round, so their order
    shows in the result."""
    return (RNG.integers(-127, 128, shape) * np.exp2(RNG.integers(-12, 13, shape))).astype(dtype)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_loop_sums_chunks_of_rows_in_order(shape, dtype):
    row, matrix = _exact_products(shape[0], dtype), _exact_products(shape, dtype)
    np.testing.assert_array_equal(row_times_matrix(row, matrix), _chunked_sum(row, matrix))
    if shape[0] >= 64:  # the order shows: rows summed straight through round otherwise
        assert not np.array_equal(_chunked_sum(row, matrix), np.cumsum(row[:, None] * matrix, axis=0)[-1])


@pytest.mark.skipif(not _HOST_FMA, reason="this CPU has no fused multiply-add: LLVM keeps a product and a sum")
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_loop_rounds_each_row_once_as_a_fused_multiply_add(dtype):
    """Each row's product and sum rounded once (an FMA), as onnxruntime's kernels round them: the
    first chunk's two rows give -1 + (1 + e)(1 - e) = -e^2, which a rounded product (1) loses."""
    epsilon = np.finfo(dtype).eps
    row, matrix = np.zeros(16, dtype), np.zeros((16, 1), dtype)  # 8 chunks of two rows
    row[:2], matrix[:2, 0] = (1, 1 + epsilon), (-1, 1 - epsilon)
    assert row_times_matrix(row, matrix)[0] == -epsilon * epsilon


@pytest.mark.parametrize("shape", SHAPES)
def test_pool_is_bitwise_the_loop(pool, shape):
    matrix = RNG.standard_normal(shape).astype(np.float32)
    row = RNG.standard_normal(shape[0]).astype(np.float32)
    expected = row_times_matrix(row, matrix)
    for _ in range(20):  # the workers awake or asleep, taking some chunks or none
        np.testing.assert_array_equal(pool.products(row, (matrix,))[0], expected)
    strided = np.repeat(row, 2)[::2]  # a row view the workers must not read by address as it is
    np.testing.assert_array_equal(pool.products(strided, (matrix,))[0], expected)


@pytest.mark.parametrize("height, depth, width", [(1, 576, 3 * jobs.COLUMN_BLOCK + 7), (1, 17, 5), (3, 40, 1030),
                                                  (jobs.FEW_ROWS, 64, 2 * jobs.COLUMN_BLOCK)])
def test_products_by_a_matrixs_columns_are_bitwise_the_one_thread_loop(pool, height, depth, width):
    """A matrix given by its columns (N, K) (a tied LM head's embedding): its units are ranges of
    columns, each element summed alike by any thread, as `rows_times_columns` sums it; a job left
    open writes the same once settled."""
    from runnx.ops._kernels_linalg import rows_times_columns

    columns = RNG.standard_normal((width, depth)).astype(np.float32)
    rows = RNG.standard_normal((height, depth)).astype(np.float32)
    expected = rows_times_columns(rows, columns)
    row = rows[0] if height == 1 else rows
    for _ in range(10):  # the workers awake or asleep, taking some ranges or none
        np.testing.assert_array_equal(pool.column_products(row, columns).reshape(height, width), expected)
    opened = pool.column_products(row, columns, leave_open=True)
    decode_pool.settle()
    np.testing.assert_array_equal(opened.reshape(height, width), expected)
    np.testing.assert_allclose(expected, rows.astype(np.float64) @ columns.T.astype(np.float64), rtol=1e-4,
                               atol=1e-4)


@pytest.mark.parametrize("depth, widths", [
    (384, (384, 64, 1100, 7, 384, 96)),  # more than MAX_MATRICES: two jobs
    (96, (3 * slots.SUM_BLOCK + 5, 300, 2 * slots.SUM_BLOCK - 1)),  # partial rows added in many units
])
def test_one_job_takes_several_matrices_of_one_depth(pool, depth, widths):
    assert len(widths) > slots.MAX_MATRICES or sum(widths) >= 4 * slots.SUM_BLOCK
    row = RNG.standard_normal(depth).astype(np.float32)
    matrices = tuple(RNG.standard_normal((depth, width)).astype(np.float32) for width in widths)
    for _ in range(5):  # the workers awake or asleep
        got = pool.products(row, matrices)
        assert len(got) == len(matrices)
        for product, matrix in zip(got, matrices):
            np.testing.assert_array_equal(product, row_times_matrix(row, matrix))


@pytest.mark.parametrize("height", [2, 3, jobs.FEW_ROWS])
def test_few_rows_in_one_job_are_each_bitwise_the_one_row_loop(pool, height):
    # a short prompt's rows: one pass over each matrix for all of them; the wide product's partial
    # rows (all rows' columns) added by the pool; each row as the one-row loop computes it alone
    depth, widths = 96, (300, 2 * slots.SUM_BLOCK + 5)
    rows = RNG.standard_normal((height, depth)).astype(np.float32)
    matrices = tuple(RNG.standard_normal((depth, width)).astype(np.float32) for width in widths)
    for _ in range(5):  # the workers awake or asleep
        got = pool.products(rows, matrices)
        for product, matrix in zip(got, matrices):
            assert product.shape == (height, matrix.shape[1])
            np.testing.assert_array_equal(product, np.stack([row_times_matrix(row, matrix) for row in rows]))
    with pool._lock:  # busy (another caller's job): computed on this thread, the same
        got = pool.products(rows, matrices)
    np.testing.assert_array_equal(got[1], np.stack([row_times_matrix(row, matrices[1]) for row in rows]))


@pytest.mark.parametrize("size", [70, 2 * ATTENTION_SPAN + 37])  # one span of the cache; three
@pytest.mark.parametrize("bias", [False, True])
def test_attention_by_kv_heads_is_bitwise_the_one_thread_job(pool, bias, size):
    # grouped-query heads over a KV cache viewed in a larger buffer (strided), as decoding has it
    query = RNG.standard_normal((2, 6, 1, 16)).astype(np.float32)
    key = RNG.standard_normal((2, 3, size + 20, 16)).astype(np.float32)[:, :, :size]
    value = RNG.standard_normal((2, 3, size + 20, 8)).astype(np.float32)[:, :, :size]
    mask = np.where(RNG.random((2, 1, 1, size)) < 0.2, -np.inf, 0).astype(np.float32) if bias else None
    expected = _attention_alone(query, key, value, mask)
    for _ in range(20):
        np.testing.assert_array_equal(pool.attention(query, key, value, mask, 0.25, np.nan), expected)
    scores = np.einsum("bhqd,bhkd->bhqk", query * 0.25, np.repeat(key, 2, axis=1))
    if bias:
        scores = scores + mask
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    np.testing.assert_allclose(expected, weights @ np.repeat(value, 2, axis=1), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["serve", "rest", "post_attention", "post_products", "post_nbits", "post_vnni"])
def test_every_thread_computes_units_through_one_compiled_copy(name):
    """The workers' loop and the callers' jobs call the unit loop through the board's first-class
    function (`mailbox._units`) instead of inlining it: inlined copies of a reassociating kernel may
    round apart (a unit's result would depend on the thread that took it). Compiled afresh here,
    since numba shows no code for cached functions."""
    import re
    import warnings

    import numba
    board, _ = mailbox.make_board()
    row, matrix = np.ones(4, np.float32), np.ones((4, 3), np.float32)
    query, key = np.ones((1, 2, 1, 4), np.float32), np.ones((1, 1, 3, 4), np.float32)
    arguments = {"serve": (board, 0), "rest": (board,),
                 "post_attention": (board, 1, query, key, key, None, 0.5, np.nan, np.empty((1, 2, 1, 4), np.float32)),
                 "post_products": (board, 1, row, (matrix,), (np.empty(3, np.float32),),
                                   np.empty(3 * 8, np.float32), 0.0, 1.0),
                 "post_nbits": (board, 1, np.ones((1, 32), np.float32),
                                np.ones((1, 1, 16, 16), np.uint8), np.ones((1, 1, 16), np.float32),
                                np.ones((1, 1, 16), np.float32), np.empty((1, 3), np.float32)),
                 "post_vnni": (board, 1, np.ones((1, 8), np.uint8), False, np.ones((1, 2, 16, 4), np.uint8),
                               np.ones(3, np.int32), np.zeros(1, np.int32), np.zeros(3, np.int32),
                               np.empty((1, 3), np.int32))}[name]
    function = getattr(mailbox, name, None) or getattr(jobs, name)
    fresh = numba.njit(nogil=True, error_model="numpy")(function.py_func)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", numba.NumbaExperimentalFeatureWarning)
        fresh.compile(tuple(numba.typeof(argument) for argument in arguments))
    code = next(iter(fresh.inspect_llvm().values()))
    units = (r"\d(?:_work|compute_unit|_attention_span|attention_span|_product_chunk|softmax_rows_float32|gelu_rows_float32"
             r"|_nbits_block|tile_rows|_vnni_block|tile_sums_into)(?![a-z_])")
    assert not re.search(units, code)  # (mangled names: the name after its length)


def _attention_alone(query, key, value, bias):
    return decode_pool.attention_job(query, key, value, bias, 0.25, np.nan)


def test_workers_take_chunks_and_sleep_when_idle(pool):
    matrix = RNG.standard_normal((1024, 512)).astype(np.float32)
    row = RNG.standard_normal(1024).astype(np.float32)
    expected = row_times_matrix(row, matrix)
    deadline = time.monotonic() + 10
    while pool.shared_units == 0 and time.monotonic() < deadline:
        np.testing.assert_array_equal(pool.products(row, (matrix,))[0], expected)
    assert pool.shared_units > 0  # the workers computed part of some product
    assert _asleep(pool, 2)  # asleep after their patience ran out
    np.testing.assert_array_equal(pool.products(row, (matrix,))[0], expected)  # woken, or done alone


def test_a_decode_steps_jobs_linger_past_the_python_between_two_steps(pool):
    """A decode step's jobs (one-row products, the decode attention) keep the workers spinning for
    STEP_PATIENCE polls, longer than a prompt's (PATIENCE): a worker that stops spinning waits for
    the GIL to sleep, and while it waits every GIL release of the caller's Python between two steps
    is a futex wake (mailbox.py)."""
    assert mailbox.STEP_PATIENCE >= 4 * mailbox.PATIENCE
    row, matrix = np.ones(64, np.float32), np.ones((64, 32), np.float32)
    pool.products(row, (matrix,))
    assert pool.box[slots.KIND] == slots.PRODUCTS and pool.box[slots.LINGER] == mailbox.STEP_PATIENCE
    pool.attention(np.ones((1, 2, 1, 8), np.float32), np.ones((1, 2, 5, 8), np.float32),
                   np.ones((1, 2, 5, 8), np.float32), None, 0.5, 0.0)
    assert pool.box[slots.KIND] == slots.ATTENTION and pool.box[slots.LINGER] == mailbox.STEP_PATIENCE


def test_a_product_as_large_as_an_lm_head_wakes_sleeping_workers_before_its_job(pool):
    # woken after it (as smaller jobs wake them), the workers would sleep through the whole product
    depth, width = 1024, decode_pool._WAKE_FIRST // 1024
    matrix = RNG.standard_normal((depth, width)).astype(np.float32)
    row = RNG.standard_normal(depth).astype(np.float32)
    expected = row_times_matrix(row, matrix)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # a woken worker joins once its core is free (the suite runs two processes)
        assert _asleep(pool, 2)
        before = pool.shared_units
        np.testing.assert_array_equal(pool.products(row, (matrix,))[0], expected)
        if pool.shared_units > before:
            break
    assert pool.shared_units > before  # a worker took units of the job it was woken for


@pytest.fixture
def blas_products():
    """float32 products on numpy's BLAS, not runnx's own kernels (`ops/_matmul.py`)."""
    _matmul.set_own_kernels(False)
    yield
    _matmul.set_own_kernels(None)


@pytest.fixture
def own_products():
    _matmul.set_own_kernels(True)
    yield
    _matmul.set_own_kernels(None)


def test_products_worth_blas_threads_let_spinning_workers_sleep(pool, blas_products):
    # Whisper's first decoder step runs OpenBLAS products of 1500 rows between pool jobs: workers
    # spinning after a job would hold the cores OpenBLAS's threads need. A product too small for
    # them (the rotary MatMul of every SmolLM2 step) must leave the workers spinning.
    matrix = RNG.standard_normal((512, 256)).astype(np.float32)
    row = RNG.standard_normal(512).astype(np.float32)
    rows = RNG.standard_normal((64, 512)).astype(np.float32)
    frequencies, positions = RNG.standard_normal((1, 32, 1)).astype(np.float32), np.ones((1, 1, 1), np.float32)
    deadline = time.monotonic() + 60  # a loaded machine may give the woken workers no core for a while
    rested = False
    while not rested and time.monotonic() < deadline:  # (unless the workers fell asleep before the product)
        pool.products(row, (matrix,))
        _some_awake(pool, 2)
        posted = pool.box[slots.POSTED]
        np.testing.assert_array_equal(MatMul(frequencies, positions), frequencies @ positions)
        assert pool.box[slots.POSTED] == posted  # no job
        np.testing.assert_allclose(MatMul(rows, matrix), rows @ matrix, rtol=1e-5, atol=1e-4)
        rested = pool.box[slots.POSTED] == posted + 1  # an empty job...
    assert rested and pool.box[slots.LINGER] == 0  # ...after which workers sleep at once
    assert _asleep(pool, 2)
    np.testing.assert_array_equal(pool.products(row, (matrix,))[0], row_times_matrix(row, matrix))


def test_a_worker_woken_but_not_yet_running_is_put_to_rest_before_a_blas_product(pool, blas_products):
    # A job small enough to finish alone wakes the sleeping workers: a worker whose thread has not
    # run yet still reads as idle. Left alone, it would run during the next BLAS product, find the
    # job it came too late for and spin after it beside OpenBLAS's threads (a 32-token prompt's
    # attention, then its output projection: 8x slower). rest() posts its empty job for such a
    # worker too: where workers sleep in native code, a wake-up leaves no trace, so always.
    assert _asleep(pool, 2)
    rows = RNG.standard_normal((64, 512)).astype(np.float32)
    matrix = RNG.standard_normal((512, 256)).astype(np.float32)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(10.0)  # the woken workers cannot take the GIL to return from their wait
    try:
        pool._wake()
        assert all(pool.box[slots.IDLE:slots.IDLE + 2])
        posted = pool.box[slots.POSTED]
        product = MatMul(rows, matrix)
        assert pool.box[slots.POSTED] == posted + 1 and pool.box[slots.LINGER] == 0
    finally:
        sys.setswitchinterval(interval)
    np.testing.assert_allclose(product, rows @ matrix, rtol=1e-5, atol=1e-4)
    assert _asleep(pool, 2)


@needs_avx512
def test_a_short_prompts_product_on_runnxs_kernels_is_a_pool_job_not_a_rest(pool, own_products):
    """runnx's own kernels share a short prompt's product with the spinning workers (a job of column
    blocks), where a BLAS product would have put them to sleep first: woken again for the next
    job, they would miss its start."""
    matrix = RNG.standard_normal((512, 256)).astype(np.float32)
    rows = RNG.standard_normal((64, 512)).astype(np.float32)
    expected = np.empty((64, 256), np.float32)
    _matmul._product((rows, matrix, expected, 0, 256, False))  # one thread, one call
    posted = pool.box[slots.POSTED]
    assert np.array_equal(MatMul(rows, matrix), expected)
    assert pool.box[slots.POSTED] == posted + 1 and pool.box[slots.KIND] == slots.GEMM
    assert pool.box[slots.LINGER] == mailbox.PATIENCE


@needs_avx512
@pytest.mark.parametrize("rows", [13, 17, 32, 239, 240])
@pytest.mark.parametrize("widths", [(576, 192, 192), (1536, 1536), (100, 20000)])
def test_a_short_prompts_products_of_one_input_are_one_pool_job_with_each_matmuls_bits(pool, own_products, rows,
                                                                                       widths):
    """SharedInputMatMul of a short prompt's rows (more than MatMul's products loop takes, fewer than
    OpenBLAS's) posts one products job for all its weights, not one a weight, each output the bits
    of its MatMul; rows that MatMul would give another kernel for any weight take MatMul's path."""
    from runnx.ops.fused_products import SharedInputMatMul
    x = RNG.standard_normal((1, rows, 576)).astype(np.float32)
    weights = [RNG.standard_normal((576, n)).astype(np.float32) for n in widths]
    for w in weights:
        w.flags.writeable = False
    expected = [MatMul(x, w) for w in weights]
    decode_pool.settle()
    posted = pool.box[slots.POSTED]
    got = SharedInputMatMul(x, *weights)
    if 16 < rows < 240:  # (MatMul's products loop: up to 16 rows by a narrow weight; OpenBLAS from 240)
        assert pool.box[slots.POSTED] == posted + 1 and pool.box[slots.KIND] == slots.GEMM
        assert pool.box[slots.GEMM_COUNT] == len(weights)
    for product, value in zip(got, expected):
        assert product.shape == value.shape and np.array_equal(product.view(np.int32), value.view(np.int32))


@pytest.mark.skipif(not mailbox.NATIVE_SLEEP, reason="workers sleep on Python Events here (no futex)")
def test_a_job_posted_from_native_code_wakes_sleeping_workers_without_python(pool):
    """Idle workers sleep in the kernel, never in Python: the post itself wakes them (`wake_idle` in
    `open_job`), no Event, no GIL. A job posted on the pool's board straight from its numba posting
    function, with nothing done in Python beforehand, gets units computed by a worker that was
    asleep (sleeping on an Event, it would have slept through every one of these jobs)."""
    from runnx.runtime.jobs import post_products
    matrix = RNG.standard_normal((1024, 8192)).astype(np.float32)  # 8 chunks of 4 MB: the worker arrives in time
    row = RNG.standard_normal(1024).astype(np.float32)
    out = np.empty(8192, np.float32)
    scratch = np.empty(chunk_count(1024) * 8192, np.float32)
    expected = row_times_matrix(row, matrix)
    before = pool.shared_units
    deadline = time.monotonic() + 10  # a woken worker joins once its core is free (the suite runs two processes)
    with pool._lock:  # (the pool is this test's: no other post can wake them)
        while pool.shared_units == before and time.monotonic() < deadline:
            assert _asleep(pool, 2)
            post_products(pool.board, 2, row, (matrix,), (out,), scratch, 0.0, 1.0)
            np.testing.assert_array_equal(out, expected)
    assert pool.shared_units > before


def test_a_pool_of_sleeping_workers_closes():
    # close() wakes every sleeping worker (in native code, or where each sleeps on its own Event:
    # a shared one, cleared by the first worker woken, once left another asleep and close() waiting
    # for it forever)
    pool = decode_pool.DecodePool(3)
    matrix = RNG.standard_normal((512, 256)).astype(np.float32)
    pool.products(RNG.standard_normal(512).astype(np.float32), (matrix,))
    _asleep(pool, 3)
    closing = threading.Thread(target=pool.close, daemon=True)
    closing.start()
    closing.join(timeout=10)
    assert not closing.is_alive() and not any(thread.is_alive() for thread in pool._threads)


def test_callers_on_many_threads_get_their_own_products(pool):
    matrices = [RNG.standard_normal((384, 256)).astype(np.float32) for _ in range(4)]
    rows = [RNG.standard_normal(384).astype(np.float32) for _ in range(4)]
    failures = []

    def call(index):
        expected = row_times_matrix(rows[index], matrices[index])
        for _ in range(200):
            if not np.array_equal(pool.products(rows[index], (matrices[index],))[0], expected):
                failures.append(index)

    with ThreadPoolExecutor(4) as callers:
        list(callers.map(call, range(4)))
    assert failures == []


def test_worker_count_follows_the_setting():
    try:
        decode_pool.set_workers(0)
        assert decode_pool.pool() is None and decode_pool.worker_count() == 0
        decode_pool.set_workers(100)
        most = min(decode_pool.MAX_WORKERS, ROW_CHUNKS - 1)  # the idle flags' line; a chunk each
        assert decode_pool.worker_count() == most
        first = decode_pool.pool()
        assert len(first._threads) == most and decode_pool.pool() is first
        decode_pool.set_workers(1)
        assert all(not thread.is_alive() for thread in first._threads)  # the old pool's workers stopped
        assert len(decode_pool.pool()._threads) == 1
    finally:
        decode_pool.set_workers(None)


def test_a_decoder_with_a_record_of_its_kernels_starts_the_pool_without_the_jobs_loads(monkeypatch, tmp_path):
    """A model whose runs recorded their kernels (`ops/kernel_loads.py`) loads those itself: the
    pool's start then skips the jobs every decoder calls and the products' kernels, which would only
    contend with the load (and with a first token that calls none of them)."""
    import json
    import runnx.runtime as runtime
    from runnx.ops import kernel_loads
    started = []
    monkeypatch.setattr(pool_start, "start_in_background", lambda load_jobs=True: started.append(load_jobs))
    model = tmp_path / "model.onnx"
    model.write_bytes(b"weights")
    runtime.start_pool_in_background(model)
    record = kernel_loads.record_path(model)
    record.parent.mkdir(parents=True, exist_ok=True)
    try:
        record.write_text(json.dumps([["runnx.runtime.jobs", "post_products", "()"]]))
        runtime.start_pool_in_background(model)
        runtime.start_pool_in_background()
    finally:
        record.unlink()
    assert started == [True, False, True]
    loaded = []
    monkeypatch.setattr(decode_pool, "pool", lambda: None)
    monkeypatch.setattr(pool_start, "_load_jobs", lambda: loaded.append("jobs"))
    monkeypatch.setattr(pool_start, "_load_products", lambda: loaded.append("products"))
    pool_start._start_and_load(False)
    pool_start._start_and_load(True)
    assert loaded == ["jobs", "products"]
    pool_start._load_alone(False)
    pool_start._load_alone(True)
    assert loaded == ["jobs", "products", "products"]


def test_a_pool_started_in_the_background_is_the_one_every_caller_gets():
    """`start_in_background` (a decoder's load) makes the pool on a thread of its own; callers on
    other threads meanwhile wait for that pool rather than make another; with no workers it only
    loads the products' kernel (`ops/_matmul.py`), once."""
    try:
        decode_pool.set_workers(0)
        pool_start.start_in_background()
        if pool_start._starting is not None and pool_start._starting.is_alive():
            assert pool_start._starting.name == "runnx-products-load"
            pool_start._starting.join(timeout=600)
        assert pool_start._products_loaded and decode_pool._pool is None
        decode_pool.set_workers(1)
        assert decode_pool._pool is None
        pool_start.start_in_background()
        starting = pool_start._starting
        assert starting.name == "runnx-decode-start"
        with ThreadPoolExecutor(4) as callers:
            pools = list(callers.map(lambda _: decode_pool.pool(), range(8)))
        starting.join(timeout=600)
        assert not starting.is_alive()
        assert all(p is decode_pool._pool for p in pools) and len(decode_pool._pool._threads) == 1
        pool_start.start_in_background()  # started: nothing more
        assert pool_start._starting is starting
    finally:
        decode_pool.set_workers(None)


def test_the_unit_loop_is_compiled_or_loaded_once_whichever_threads_ask_at_once(monkeypatch):
    """A first prompt's first job asks for the unit loop while the pool's background start loads it:
    the prompt waits for that load rather than make its own beside it (0.1-0.4 s of a first token)."""
    from runnx.runtime import mailbox

    made = []

    compiled = object()

    def cfunc(signature, **options):
        def compile_(function):
            made.append(function)
            time.sleep(0.2)
            return compiled
        return compile_

    monkeypatch.setattr(mailbox, "_units_compiled", None)
    monkeypatch.setattr(mailbox.numba, "cfunc", cfunc)
    with ThreadPoolExecutor(3) as callers:
        loops = list(callers.map(lambda _: mailbox._units(), range(3)))
    assert loops == [compiled] * 3 and made == [mailbox._units_entry]


@pytest.mark.parametrize("workers", [0, 1])
def test_the_background_start_finds_which_kernels_take_a_prompts_products(workers):
    """The start (with workers or without) asks which BLAS numpy loaded, so that a first prompt's
    first product does not look through the process's libraries (a fresh process: nothing asked
    before), and the answer is the one asked anew."""
    code = f"""
from runnx.ops import _matmul
from runnx.runtime import pool as d, pool_start
d.set_workers({workers})
assert _matmul._enabled is None and _matmul._short is None
pool_start.start_in_background(load_jobs=False)
pool_start._starting.join()
found = _matmul._enabled if _matmul._enabled else _matmul._short
assert found is not None
decided = _matmul.own_product(1, True)
_matmul.set_own_kernels(None)
assert decided == _matmul.own_product(1, True)
print("decided")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.split() == ["decided"], done.stderr


def test_the_background_start_loads_the_jobs_a_decoder_calls_first():
    """After `start_in_background`, the products of a read-only matrix (one to three at a time,
    one row and two) and the rows' softmax and GELU find their compiled code: their first calls
    add no overload (a fresh process, so that nothing else called them before)."""
    code = """
import numpy as np
from runnx.runtime import pool as d, pool_start
d.set_workers(1)
pool_start.start_in_background()
pool_start._starting.join()
jobs = (d.post_products, d.post_softmax, d.post_gelu)
before = [len(job.overloads) for job in jobs]
matrix = np.ones((64, 32), np.float32)
matrix.flags.writeable = False
for row in (np.ones(64, np.float32), np.ones((2, 64), np.float32)):
    for count in (1, 2, 3):
        d.pool().products(row, (matrix,) * count)
rows = np.ones((40, 8), np.float32)
d.softmax_rows(rows, float("nan"))
for bias in (np.zeros(8, np.float32), matrix[0, :8]):
    d.gelu_rows(rows, bias, 1.4, 1.0, 0.5, np.empty_like(rows))
print(before == [len(job.overloads) for job in jobs], min(before) > 0)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "True"]


@pytest.mark.parametrize("workers", [1, 0])
def test_the_background_start_imports_what_numbas_first_typing_of_an_array_would(workers):
    """numba's first typing of an array argument imports numpy.ma: the background start does it,
    with workers or without, so a first prompt's first kernel call does not (a fresh process:
    importing runnx and loading nothing leaves numpy.ma out)."""
    code = f"""
import sys
import runnx
from runnx.runtime import pool as d, pool_start
print("numpy.ma" in sys.modules)
d.set_workers({workers})
pool_start.start_in_background()
pool_start._starting.join()
print("numpy.ma" in sys.modules)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "True"]


def test_a_pool_of_as_many_workers_as_idle_flags_closes_and_no_more_is_made():
    full = decode_pool.DecodePool(decode_pool.MAX_WORKERS)  # the last worker's flag ends the line
    rng = np.random.default_rng(8)
    row = rng.standard_normal(64).astype(np.float32)
    matrix = rng.standard_normal((64, 1100)).astype(np.float32)
    np.testing.assert_array_equal(full.products(row, (matrix,))[0], row_times_matrix(row, matrix))
    closing = threading.Thread(target=full.close, daemon=True)  # a flag past the line was the stop flag:
    closing.start()  # a worker cleared it and never stopped, so close() waited for good
    closing.join(timeout=30)
    assert not closing.is_alive() and not any(thread.is_alive() for thread in full._threads)
    with pytest.raises(ValueError, match="workers"):
        decode_pool.DecodePool(decode_pool.MAX_WORKERS + 1)


def test_the_workers_loop_is_compiled_before_any_worker_starts():
    """A process that ended while a worker compiled its loop aborted inside LLVM and never wrote
    numba's cache; now the pool compiles (or loads) it on the thread that starts the pool. So it
    does `rest`, which a multi-threaded BLAS product first calls while workers spin: loading it
    then cost a Whisper window's first step 20 ms."""
    code = ("from runnx.runtime import pool as d; d.set_workers(1); d.pool(); "
            "print(len(d.serve.signatures), len(d.rest.signatures))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["1", "1"]


def _one_threads(kernel, *arguments):
    """kernel(*arguments) with no decode pool: what one thread computes (the pool's setting restored)."""
    workers = decode_pool.worker_count()
    decode_pool.set_workers(0)
    try:
        kernel(*arguments)
    finally:
        decode_pool.set_workers(workers)


@pytest.mark.parametrize("shape", [(100, 37), (5, 1500), (1, 3), (0, 4)])
def test_pool_softmax_rows_are_bitwise_one_threads(pool, shape):
    """Blocks of rows shared with the workers (woken first, asleep right after): the same compiled
    code as without workers, so the same bits, NaN rows to the fill included."""
    scores = (RNG.standard_normal(shape) * 20).astype(np.float32)
    if shape[0] > 3:
        scores[1] = -np.inf
        scores[2, 1] = np.nan
    alone = scores.copy()
    _one_threads(decode_pool.softmax_rows, alone, -1.0)
    for _ in range(5):
        shared = scores.copy()
        decode_pool.softmax_rows(shared, -1.0)
        np.testing.assert_array_equal(shared, alone)
    if shape[0] > 3:
        np.testing.assert_array_equal(alone[[1, 2]], -1.0)
        fine = np.delete(scores, [1, 2], axis=0).astype(np.float64)
        want = np.exp(fine - fine.max(axis=1, keepdims=True))
        np.testing.assert_allclose(np.delete(alone, [1, 2], axis=0), want / want.sum(axis=1, keepdims=True),
                                   rtol=2e-6, atol=1e-12)


def test_a_rows_softmax_and_gelu_do_not_depend_on_the_rows_computed_with_it():
    """Fewer rows than two blocks run the job's code alone, not a direct call of the row kernel,
    which numba compiled apart: in a process that ran the job first, the direct call rounded rows
    1 ulp differently (every one of 30 random 64 x 1500 score arrays cut into 4-row calls differed
    from the 64-row call here; 8 of 60 in a fresh clone's CI)."""
    code = """
import numpy as np
from runnx.runtime import pool as d, pool_start
d.set_workers(0)
rng = np.random.default_rng(3)
differing = 0
for _ in range(30):
    scores = (rng.standard_normal((64, 1500)) * 4).astype(np.float32)
    whole, parts = scores.copy(), scores.copy()
    d.softmax_rows(whole, -1.0)
    for start in range(0, 64, 4):
        d.softmax_rows(parts[start:start + 4], -1.0)
    differing += not np.array_equal(whole, parts)
x = (rng.standard_normal((64, 1536)) * 3).astype(np.float32)
bias = rng.standard_normal(1536).astype(np.float32)
constants = (np.float32(2 ** 0.5), np.float32(1), np.float32(0.5))
whole, parts = np.empty_like(x), np.empty_like(x)
d.gelu_rows(x, bias, *constants, whole)
for start in range(0, 64, 4):
    d.gelu_rows(x[start:start + 4], bias, *constants, parts[start:start + 4])
print(differing, np.array_equal(whole, parts))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0", "True"]


@pytest.mark.parametrize("rows, with_bias", [(100, True), (100, False), (3, True)])
def test_pool_gelu_rows_are_bitwise_one_threads(pool, rows, with_bias):
    x = RNG.standard_normal((rows, 70)).astype(np.float32) * 3
    bias = RNG.standard_normal(70).astype(np.float32) if with_bias else np.zeros(0, np.float32)
    constants = np.float32(np.sqrt(2)), np.float32(1), np.float32(0.5)
    alone = np.empty_like(x)
    _one_threads(decode_pool.gelu_rows, x, bias, *constants, alone)
    for _ in range(5):
        shared = np.full_like(x, np.nan)
        decode_pool.gelu_rows(x, bias, *constants, shared)
        np.testing.assert_array_equal(shared, alone)
    v = x.astype(np.float64) + (bias if with_bias else 0)
    from math import erf
    want = v * (np.vectorize(erf)(v / np.sqrt(2)) + 1) * 0.5
    np.testing.assert_allclose(alone, want, rtol=1e-5, atol=1e-6)


def test_a_native_block_wakes_sleeping_workers_and_computes_alone_when_the_pool_is_busy(pool):
    """`shared_call` wakes sleeping workers before a native block (whose posts wake them too where
    they sleep in native code: `mailbox.NATIVE_SLEEP`). A pool held by another caller is BUSY; the
    block then runs alone, to the same bits."""
    from runnx.ops._decode_blocks import gated_down

    rng = np.random.default_rng(12)
    gate, up, residual, norm = (rng.standard_normal(n).astype(np.float32) for n in (512, 512, 384, 384))
    weight = rng.standard_normal((512, 384)).astype(np.float32)
    kept = residual.copy()

    def block():
        return decode_pool.shared_call(gated_down, gate, np.exp(-gate), up, weight, residual, 1e-5, 1.0, norm, False)

    alone = decode_pool.alone(gated_down, gate, np.exp(-gate), up, weight, residual, 1e-5, 1.0, norm, False)
    assert _asleep(pool, 2)
    shared_before = pool.shared_units
    deadline = time.monotonic() + 10  # a woken worker joins once its core is free (the suite runs two processes)
    while pool.shared_units == shared_before and time.monotonic() < deadline:
        for mine, expected in zip(block(), alone):
            np.testing.assert_array_equal(mine, expected)
    assert pool.shared_units > shared_before  # woken, the workers took units of the block's jobs
    with pool._lock:  # another caller has the pool
        busy = pool.call(gated_down, gate, np.exp(-gate), up, weight, residual, 1e-5, 1.0, norm, False)
        assert busy is decode_pool.BUSY
        for mine, expected in zip(block(), alone):
            np.testing.assert_array_equal(mine, expected)
    np.testing.assert_array_equal(residual, kept)  # the block sums into its own arrays


def test_a_job_is_complete_when_its_poster_returns(pool):
    """The workers read a job's arrays by address: memory safety rests on the poster, which holds
    them as its arguments, returning only when no unit is left to compute or being computed."""
    matrix = RNG.standard_normal((64, 4 * slots.SUM_BLOCK)).astype(np.float32)  # its sums in 4 units
    row = RNG.standard_normal(64).astype(np.float32)
    query = RNG.standard_normal((1, 4, 1, 16)).astype(np.float32)
    cache = RNG.standard_normal((1, 2, 3 * ATTENTION_SPAN, 16)).astype(np.float32)
    for _ in range(50):
        for job in (lambda: pool.products(row, (matrix,)), lambda: pool.attention(query, cache, cache, None, 1.0, 0.0)):
            job()
            units = pool.box[slots.UNITS]
            assert units > 0 and pool.box[slots.COMPLETED] == units
            assert pool.box[slots.CLAIM] & slots.NOTHING_TO_CLAIM >= units  # nothing left to claim


@pytest.mark.parametrize("columns", [16, 9 * 64 + 5, 768 * 64])  # one unit; a layer's; an LM head's
def test_claims_of_several_units_give_the_bits_of_claims_of_one(pool, columns):
    """A thread claims an eighth of the units left at once (at least one): each unit is still
    computed whole, once, by one thread, so the columns come out as one unit a claim gives them,
    and as one thread gives them."""
    from runnx.ops.nibble_tiles import _nibble_tiles

    depth = 576
    b = RNG.integers(0, 256, (columns, depth // 32, 16), dtype=np.uint8)
    scales = RNG.random(columns * depth // 32).astype(np.float32)
    tiles = _nibble_tiles((), b, scales, None)
    rows = RNG.standard_normal((1, depth)).astype(np.float32)
    alone = np.full((1, columns), np.nan, np.float32)
    decode_pool.alone(jobs.post_nbits, rows, *tiles, alone)
    for shift in (63, mailbox.DEFAULT_CLAIM_SHIFT, 1):  # a unit a claim; an eighth; half
        pool.box[slots.CLAIM_SHIFT] = shift
        try:
            for _ in range(3):
                out = np.full((1, columns), np.nan, np.float32)
                decode_pool.nbits_rows(rows, *tiles, out)
                np.testing.assert_array_equal(out, alone)
                assert pool.box[slots.COMPLETED] == pool.box[slots.UNITS] == -(-columns // 64)
        finally:
            pool.box[slots.CLAIM_SHIFT] = mailbox.DEFAULT_CLAIM_SHIFT


def test_a_products_job_writes_no_slot_past_its_fields():
    """Every field of a products job of MAX_MATRICES matrices (8-bit ones with their zero point and
    scale too) lies in its own words, below the claim size and the list counters."""
    board, box = mailbox.make_board()
    first = slots.MATRICES + slots.PER_MATRIX * slots.MAX_MATRICES
    box[first:slots.CLAIM_SHIFT] = -7
    kept = box[slots.CLAIM_SHIFT:].copy()
    for matrix in (np.ones((8, 6), np.float32), np.ones((8, 6), np.uint8)):
        outs = tuple(np.empty(6, np.float32) for _ in range(slots.MAX_MATRICES))
        jobs.post_products(board, 0, np.ones(8, np.float32), (matrix,) * slots.MAX_MATRICES, outs,
                           np.empty(chunk_count(8) * 6 * slots.MAX_MATRICES, np.float32), 3.0, 0.5)
        expected = 8.0 if matrix.dtype == np.float32 else 8 * (1 - 3.0) * 0.5
        assert all(np.array_equal(out, np.full(6, expected, np.float32)) for out in outs)
        assert (box[first:slots.CLAIM_SHIFT] == -7).all() and np.array_equal(box[slots.CLAIM_SHIFT:], kept)


def _products_arguments(height=1, depth=8, width=6):
    return (np.ones(height * depth, np.float32), (np.ones((depth, width), np.float32),),
            (np.empty(height * width, np.float32),), np.empty(chunk_count(depth) * height * width, np.float32))


@pytest.mark.parametrize("change", ["depth", "short output", "short scratch", "an output missing", "transposed matrix"])
def test_a_products_job_refuses_arrays_it_cannot_read_before_posting(change):
    """Each poster checks the arrays its units read: a wrong array raises, nothing posted
    (unchecked, a short output was written past its end, a transposed matrix read as C-ordered)."""
    row, matrices, outs, scratch = _products_arguments()
    if change == "depth":
        row = np.ones(7, np.float32)
    elif change == "short output":
        outs = (np.empty(5, np.float32),)
    elif change == "short scratch":
        scratch = scratch[:-1]
    elif change == "an output missing":
        matrices = matrices * 2
    else:
        matrices = (np.ones((6, 8), np.float32).T,)
    board, box = mailbox.make_board()
    with pytest.raises(ValueError, match="a products job"):
        jobs.post_products(board, 0, row, matrices, outs, scratch, 0.0, 1.0)
    assert box[slots.POSTED] == 0 and box[slots.KIND] == 0


def test_attention_and_rows_jobs_refuse_arrays_that_do_not_fit_before_posting():
    query, key = np.ones((1, 2, 1, 4), np.float32), np.ones((1, 1, 3, 4), np.float32)
    board, box = mailbox.make_board()
    with pytest.raises(ValueError, match="an attention job"):  # out's last axis is not value's
        jobs.post_attention(board, 0, query, key, key, None, 0.5, np.nan, np.empty((1, 2, 1, 3), np.float32))
    with pytest.raises(ValueError, match="H a multiple of G"):  # 2 query heads over 3 KV heads
        three = np.ones((1, 3, 3, 4), np.float32)
        jobs.post_attention(board, 0, query, three, three, None, 0.5, np.nan, np.empty((1, 2, 1, 4), np.float32))
    rows = np.ones((4, 8), np.float32)
    with pytest.raises(ValueError, match="a rows job"):
        jobs.post_gelu(board, 0, rows, np.empty(0, np.float32), 1.0, 1.0, 0.5, np.empty((3, 8), np.float32))
    with pytest.raises(ValueError, match="bias"):
        jobs.post_gelu(board, 0, rows, np.ones(7, np.float32), 1.0, 1.0, 0.5, np.empty_like(rows))
    assert box[slots.POSTED] == 0


@pytest.mark.parametrize("change", ["long rows", "few tiles", "few scales", "float64 out", "strided tiles",
                                    "float tiles", "few zero points", "int16 zero points", "strided zero points"])
def test_a_4_bit_products_job_refuses_arrays_it_cannot_read_before_posting(change):
    arrays = dict(rows=np.ones((2, 64), np.float32), tiles=np.ones((2, 2, 16, 16), np.uint8),
                  scales=np.ones((2, 2, 16), np.float32), zeros=np.ones((2, 2, 16), np.uint8),
                  out=np.empty((2, 17), np.float32))
    changed = {"long rows": ("rows", np.ones((2, 65), np.float32)),
               "few tiles": ("tiles", np.ones((1, 2, 16, 16), np.uint8)),
               "few scales": ("scales", np.ones((2, 1, 16), np.float32)),
               "float64 out": ("out", np.empty((2, 17))),
               "strided tiles": ("tiles", np.ones((2, 2, 16, 32), np.uint8)[..., ::2]),
               "float tiles": ("tiles", np.ones((2, 2, 16, 16), np.float32)),
               "few zero points": ("zeros", np.ones((2, 1, 16), np.uint8)),
               "int16 zero points": ("zeros", np.ones((2, 2, 16), np.int16)),
               "strided zero points": ("zeros", np.ones((2, 2, 32), np.float32)[..., ::2])}[change]
    arrays[changed[0]] = changed[1]
    board, box = mailbox.make_board()
    with pytest.raises(ValueError, match="a 4-bit products job"):
        jobs.post_nbits(board, 0, *arrays.values())
    assert box[slots.POSTED] == 0


def test_no_pool_module_makes_a_pointer_from_an_integer():
    """The pool's jobs hold their arrays (`board.py`): no runtime module takes an array's address or
    casts an integer to a pointer (but the arena's: an allocator, whose pointers are libc's blocks,
    never an array's), and every posting function checks its arrays before it holds any
    (`_check_*` first)."""
    import ast
    from pathlib import Path

    import runnx
    package = Path(runnx.__file__).parent
    for path in set((package / "runtime").glob("*.py")) - {package / "runtime" / "arena_functions.py",
                                                            package / "runtime" / "arena.py"}:
        text = path.read_text()
        assert "inttoptr" not in text and "ctypes.data" not in text and "carray(" not in text, path.name
    source = (package / "runtime" / "jobs.py").read_text()
    functions = {node.name: node for node in ast.walk(ast.parse(source)) if isinstance(node, ast.FunctionDef)}
    holding = {name for name, node in functions.items()
               if "hold_" in ast.get_source_segment(source, node).split(":", 1)[1]}  # (after its signature)
    assert {"open_products", "open_column_products", "open_attention", "open_nbits", "post_vnni", "_begin_rows",
            "post_gelu", "open_gemms", "post_attention_blocks"} <= holding
    for name in holding - {"_hold_entries_compiled", "_hold_zeros_compiled"}:
        first_call = next(node for node in functions[name].body
                          if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call))
        assert first_call.value.func.id.startswith("_check_"), name  # before anything is held


@pytest.mark.parametrize("change", ["short output", "strided columns", "float64 row", "other depth"])
def test_a_products_job_by_columns_refuses_arrays_it_cannot_read_before_posting(change):
    arrays = dict(row=np.ones(8, np.float32), columns=np.ones((5, 8), np.float32), out=np.empty(5, np.float32))
    name, value = {"short output": ("out", np.empty(4, np.float32)),
                   "strided columns": ("columns", np.ones((5, 16), np.float32)[:, ::2]),
                   "float64 row": ("row", np.ones(8)), "other depth": ("row", np.ones(7, np.float32))}[change]
    arrays[name] = value
    board, box = mailbox.make_board()
    with pytest.raises(ValueError, match="a products job by a matrix's columns"):
        jobs.post_column_products(board, 0, *arrays.values())
    assert box[slots.POSTED] == 0


@pytest.mark.parametrize("change", ["long rows", "few tiles", "wide tiles", "few column sums", "strided tiles"])
def test_an_8_bit_products_job_refuses_arrays_it_cannot_read_before_posting(change):
    arrays = dict(a=np.ones((2, 8), np.uint8), flip=False, tiles=np.ones((2, 2, 16, 4), np.uint8),
                  column_sums=np.ones(17, np.int32), a_zero=np.zeros(2, np.int32), b_zero=np.zeros(17, np.int32),
                  out=np.empty((2, 17), np.int32))
    changed = {"long rows": ("a", np.ones((2, 9), np.uint8)),
               "few tiles": ("tiles", np.ones((1, 2, 16, 4), np.uint8)),
               "wide tiles": ("tiles", np.ones((2, 2, 16, 8), np.uint8)),
               "few column sums": ("column_sums", np.ones(16, np.int32)),
               "strided tiles": ("tiles", np.ones((2, 2, 16, 8), np.uint8)[..., ::2])}[change]
    arrays[changed[0]] = changed[1]
    board, box = mailbox.make_board()
    with pytest.raises(ValueError, match="an 8-bit products job"):
        jobs.post_vnni(board, 0, *arrays.values())
    assert box[slots.POSTED] == 0


def _slow_dispatches(calls) -> list:
    """The compiled functions that `calls()` reached through numba's `_compile_for_args`: the types of
    their arguments resolved in Python (tens of microseconds a call) instead of by the fast dispatch."""
    from numba.core import dispatcher

    slow = []
    original = dispatcher._DispatcherBase._compile_for_args

    def counted(self, *args, **kwargs):
        slow.append(self.py_func.__name__)
        return original(self, *args, **kwargs)

    dispatcher._DispatcherBase._compile_for_args = counted
    try:
        calls()
    finally:
        dispatcher._DispatcherBase._compile_for_args = original
    return slow


def test_pool_products_take_numbas_fast_dispatch(pool):
    """A float product posted to the pool from Python (a decode step's MatMul) is one fast dispatch:
    the products job's zero point and scale, which only 8-bit matrices read, were once left out for
    float32 ones, and every product of a two-thread step resolved them in Python."""
    matrix = RNG.standard_normal((256, 512)).astype(np.float32)  # at least _POOLED_ELEMENTS
    row = RNG.standard_normal((1, 256)).astype(np.float32)
    posted = pool.box[slots.POSTED]
    expected, _ = MatMul(row, matrix), pool.products(row[0], (matrix, matrix))  # (first calls: loaded)
    assert pool.box[slots.POSTED] > posted  # the MatMul was a pool job
    assert _slow_dispatches(lambda: [MatMul(row, matrix) for _ in range(5)]) == []
    assert _slow_dispatches(lambda: [pool.products(row[0], (matrix, matrix)) for _ in range(5)]) == []
    np.testing.assert_array_equal(pool.products(row[0], (matrix,))[0], expected[0])


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2", "tiny-llama-merged"])
@pytest.mark.parametrize("level", ["basic", "all"])
def test_steady_decode_steps_take_numbas_fast_dispatch(pool, fixtures_dir, name, level):
    """Every compiled kernel a steady decode step calls from Python, with the decode pool on, takes
    numba's fast dispatch (`_slow_dispatches`), in unfused graphs (`basic`) and fused ones."""
    import runnx
    from runnx.generate.decoder import DecoderStep, load_decoder

    def load(path):
        return load_decoder(path) if level == "all" else runnx.load(path, optimization_level=level)

    decoder = DecoderStep.from_folder(fixtures_dir / name, capacity=64, load=load)
    decoder.step(np.array([[1, 2, 3, 4]]))
    for token in range(5, 9):  # the kernels of every shape a step meets, loaded or compiled
        decoder.step(np.array([[token]]))
    assert _slow_dispatches(lambda: [decoder.step(np.array([[token]])) for token in range(9, 13)]) == []


# (rows, depth, columns, columns given, unit): one unit and many, a last unit short of a panel, the
# columns-given packing across KC, a unit of one panel (a's rows read in place), rows past a block
_GEMM_CASES = [(3, 7, 5, False, 32), (32, 576, 960, False, 64), (17, 300, 1000, True, 96),
               (40, 600, 70, True, 32), (13, 257, 545, False, 512), (250, 64, 200, False, 32)]


@needs_avx512
@pytest.mark.parametrize("rows, depth, columns, given, unit", _GEMM_CASES)
def test_a_prompts_product_job_is_bitwise_the_one_thread_product(pool, rows, depth, columns, given, unit):
    """A prompt's product cut into units of columns, claimed by any thread in claims of any size,
    into an output whose rows lie apart (a view of a wider buffer), is the one-thread product's
    bits, and writes nothing outside its output."""
    a = RNG.standard_normal((rows, depth)).astype(np.float32)
    b = RNG.standard_normal((columns, depth) if given else (depth, columns)).astype(np.float32)
    expected = np.empty((rows, columns), np.float32)
    _matmul._product((a, b, expected, 0, columns, given))
    try:
        for shift in (0, 3, 30):  # a claim takes one unit (shift 30) or an eighth of those left
            pool.box[slots.CLAIM_SHIFT] = shift
            wide = np.full((rows, columns + 9), np.nan, np.float32)
            out = wide[:, 4:4 + columns]
            jobs.post_gemm(pool.board, 2, a, b, out, given, unit)
            assert np.array_equal(out, expected)
            assert np.isnan(wide[:, :4]).all() and np.isnan(wide[:, 4 + columns:]).all()
            assert pool.box[slots.COMPLETED] == pool.box[slots.UNITS] == -(-columns // unit)
    finally:
        pool.box[slots.CLAIM_SHIFT] = mailbox.DEFAULT_CLAIM_SHIFT


@pytest.mark.parametrize("change", ["depth", "short out", "transposed a", "columns of b", "unit", "float64 out",
                                    "strided out"])
def test_a_prompts_product_job_refuses_arrays_it_cannot_read_before_posting(change):
    arrays = dict(a=np.ones((4, 8), np.float32), b=np.ones((8, 6), np.float32), out=np.empty((4, 6), np.float32),
                  given=False, unit=32)
    changed = {"depth": ("b", np.ones((7, 6), np.float32)),
               "short out": ("out", np.empty((3, 6), np.float32)),
               "transposed a": ("a", np.ones((8, 4), np.float32).T),
               "columns of b": ("given", True),
               "unit": ("unit", 20),
               "float64 out": ("out", np.empty((4, 6))),
               "strided out": ("out", np.empty((4, 12), np.float32)[:, ::2])}[change]
    arrays[changed[0]] = changed[1]
    board, box = mailbox.make_board()
    with pytest.raises(ValueError, match="a prompt's products job"):
        jobs.post_gemm(board, 0, *arrays.values())
    assert box[slots.POSTED] == 0


# (rows, depth, columns of each product, unit): one product and up to MAX_GEMM_PARTS, units crossing
# no product's end (each product's units its own), a product of one short unit, rows past a block
_GEMMS_CASES = [(20, 576, (576, 192, 192), 480), (20, 576, (576, 192, 192), 288), (32, 64, (1536, 1536), 1536), (17, 300, (5,), 32),
                (250, 40, (33, 64, 7, 100), 64), (13, 257, (545, 31), 96)]


@needs_avx512
@pytest.mark.parametrize("rows, depth, widths, unit", _GEMMS_CASES)
def test_the_products_of_one_input_as_one_job_are_each_the_one_thread_products_bits(pool, rows, depth, widths, unit):
    """A prompt's products of one input (a layer's q, k and v projections) as one job, each product's
    units after the one before's, claimed by any thread in claims of any size: each output the bits of
    its product alone, nothing written outside it."""
    a = RNG.standard_normal((rows, depth)).astype(np.float32)
    weights = tuple([RNG.standard_normal((depth, n)).astype(np.float32) for n in widths])
    expected = []
    for w in weights:
        expected.append(np.empty((rows, w.shape[1]), np.float32))
        _matmul._product((a, w, expected[-1], 0, w.shape[1], False))
    try:
        for shift in (0, 3, 30):
            pool.box[slots.CLAIM_SHIFT] = shift
            wide = [np.full((rows, n + 9), np.nan, np.float32) for n in widths]
            outs = tuple([buffer[:, 4:4 + n] for buffer, n in zip(wide, widths)])
            jobs.post_gemms(pool.board, 2, a, weights, outs, False, unit)
            for out, buffer, value in zip(outs, wide, expected):
                assert np.array_equal(out.view(np.int32), value.view(np.int32))
                assert np.isnan(buffer[:, :4]).all() and np.isnan(buffer[:, -5:]).all()
            assert pool.box[slots.COMPLETED] == pool.box[slots.UNITS] == sum(-(-n // unit) for n in widths)
    finally:
        pool.box[slots.CLAIM_SHIFT] = mailbox.DEFAULT_CLAIM_SHIFT


@pytest.mark.parametrize("change", ["too many", "one output short", "a weight's depth", "unit"])
def test_the_products_of_one_input_job_refuses_what_it_cannot_read_before_posting(change):
    a, weight = np.ones((4, 8), np.float32), np.ones((8, 6), np.float32)
    weights, outs, unit = (weight, weight), (np.empty((4, 6), np.float32),) * 2, 32
    if change == "too many":
        weights, outs = (weight,) * (slots.MAX_GEMM_PARTS + 1), outs[:1] * (slots.MAX_GEMM_PARTS + 1)
    elif change == "one output short":
        outs = (outs[0], np.empty((3, 6), np.float32))
    elif change == "a weight's depth":
        weights = (weight, np.ones((7, 6), np.float32))
    else:
        unit = 20
    board, box = mailbox.make_board()
    with pytest.raises(ValueError, match="a prompt's products job"):
        jobs.post_gemms(board, 0, a, weights, outs, False, unit)
    assert box[slots.POSTED] == 0


def _prompt_attention(batch, heads, groups, length, size):
    scaled = (RNG.standard_normal((batch, heads, length, 16)) * 0.3).astype(np.float32)
    key = RNG.standard_normal((batch, groups, size, 16)).astype(np.float32)
    value = RNG.standard_normal((batch, groups, size, 8)).astype(np.float32)
    keys = np.arange(size)
    bias = np.where(keys[None, :] <= size - length + np.arange(length)[:, None], 0, -np.inf).astype(np.float32)
    ends = np.empty((1, 1, length), np.int64)
    visible_ends(bias[None, None], ends)
    return scaled, key, value, bias[None, None], ends


@needs_avx512
@pytest.mark.parametrize("batch, heads, groups, length, size, positions",
                         [(1, 9, 3, 130, 130, 64), (2, 6, 6, 70, 90, 16), (1, 4, 2, 5, 300, 12),
                          (2, 2, 1, 33, 33, 40)])
def test_a_prompts_attention_job_is_the_same_bits_on_any_thread(pool, batch, heads, groups, length, size, positions):
    """Blocks of a prompt's attention claimed by any thread in claims of any size, into an output
    whose rows lie apart (a view of a wider buffer), are the bits of the job run alone, each block
    against the keys its rows see; nothing is written outside the output."""
    scaled, key, value, bias, ends = _prompt_attention(batch, heads, groups, length, size)
    key_panels = _attention_blocks._key_panels(key)
    expected = np.empty((batch, heads, length, 8), np.float32)
    decode_pool.alone(jobs.post_attention_blocks, scaled, key_panels, value, bias, ends, 0.0, positions, expected)
    per = heads // groups
    keys = np.repeat(key, per, axis=1).astype(np.float64)
    scores = scaled.astype(np.float64) @ keys.swapaxes(2, 3) + bias
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    reference = (weights / weights.sum(-1, keepdims=True)) @ np.repeat(value, per, axis=1)
    np.testing.assert_allclose(expected, reference, rtol=2e-5, atol=2e-6)
    try:
        for shift in (0, 3, 30):
            pool.box[slots.CLAIM_SHIFT] = shift
            wide = np.full((batch, heads, length, 8 + 5), np.nan, np.float32)
            out = wide[..., 2:10]
            jobs.post_attention_blocks(pool.board, 2, scaled, key_panels, value, bias, ends, 0.0, positions, out)
            assert np.array_equal(out, expected)
            assert np.isnan(wide[..., :2]).all() and np.isnan(wide[..., 10:]).all()
            assert pool.box[slots.COMPLETED] == pool.box[slots.UNITS] == batch * groups * -(-length // positions)
    finally:
        pool.box[slots.CLAIM_SHIFT] = mailbox.DEFAULT_CLAIM_SHIFT


@pytest.mark.parametrize("change", ["strided keys", "short panels", "keys by their columns", "no keys",
                                    "float64 values", "positions", "ends", "zero end", "heads"])
def test_a_prompts_attention_job_refuses_arrays_it_cannot_read_before_posting(change):
    scaled, key, value, bias, ends = _prompt_attention(1, 4, 2, 6, 10)
    key_panels = _attention_blocks._key_panels(key)
    arrays = dict(scaled=scaled, key=key_panels, value=value, bias=bias, ends=ends, fill=0.0, positions=4,
                  out=np.empty((1, 4, 6, 8), np.float32))
    changed = {"strided keys": ("key", np.ascontiguousarray(key_panels.swapaxes(0, 1)).swapaxes(0, 1)[..., ::-1]),
               "short panels": ("key", key_panels[:, :, 1:]),
               "keys by their columns": ("key", np.ascontiguousarray(key.swapaxes(2, 3))),
               "no keys": ("key", key_panels[:, :, :0]),
               "float64 values": ("value", value.astype(np.float64)),
               "positions": ("positions", 0),
               "ends": ("ends", np.ones((1, 1, 5), np.int64)),
               "zero end": ("ends", np.where(np.arange(6) == 2, 0, ends)),
               "heads": ("scaled", scaled[:, :3])}[change]
    arrays[changed[0]] = changed[1]
    if change == "no keys":
        arrays["value"], arrays["bias"] = value[:, :, :0], None
    board, box = mailbox.make_board()
    with pytest.raises(ValueError, match="attention job"):
        jobs.post_attention_blocks(board, 0, *arrays.values())
    assert box[slots.POSTED] == 0



@pytest.mark.parametrize("widths, workers, unit", [((576, 192, 192), 1, 288), ((960,), 1, 480), ((1536, 1536), 1, 1536),
                                                   ((576,), 1, 288), ((576, 192, 192), 0, 960), ((100, 30), 1, 96)])
def test_a_products_jobs_units_leave_no_product_a_sliver_short_of_a_streamed_range(widths, workers, unit):
    """A job's unit splits its columns evenly among the threads (one thread: the whole job, one unit),
    except that a product whose last unit would be narrower than `gemm.STREAMED_FROM` columns (and
    so not streamed) is cut into equal units instead: q, k and v of 576, 192, 192 in units of 288,
    not 480 and 96; a product too narrow for units of that width keeps the even split (100 and 30
    columns: units of 96)."""
    assert prompt_jobs.unit_columns(workers, sum(widths), widths) == unit
