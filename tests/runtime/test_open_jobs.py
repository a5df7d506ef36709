"""Pool jobs left open (runnx/runtime/open_jobs.py): a kernel given leave returns while the workers
compute its output; the pool holds the job's arrays and its lock until the thread settles, and the
next post finishes the job before it reads anything. Results are bitwise those of finished jobs."""
import gc
import threading
import weakref

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import runnx
from runnx.ops.nibble_tiles import _nibble_tiles
from runnx.ops._kernels_linalg import row_times_matrix
from runnx.runtime import jobs, mailbox, opening, settle, slots
from runnx.runtime import pool as decode_pool
from runnx.runtime import open_jobs
from runnx.runtime.open_jobs import holding

RNG = np.random.default_rng(0)


@pytest.fixture
def pool():
    decode_pool.set_workers(1)
    yield decode_pool.pool()
    settle()
    opening.allowed = False
    decode_pool.set_workers(None)


@pytest.fixture
def leave():
    opening.allowed = True
    yield
    opening.allowed = False


def _free(pool) -> bool:
    """Whether another thread could take the pool now."""
    taken = []
    thread = threading.Thread(target=lambda: taken.append(pool._lock.acquire(blocking=False)))
    thread.start()
    thread.join()
    if taken[0]:
        pool._lock.release()
    return taken[0]


def test_a_job_left_open_keeps_its_arrays_and_the_pool_until_settled(pool, leave):
    matrix = RNG.standard_normal((256, 4 * slots.SUM_BLOCK)).astype(np.float32)  # a wide second phase
    row = RNG.standard_normal(256).astype(np.float32)
    expected = row_times_matrix(row, matrix)
    posted = row.copy()
    alive = weakref.ref(posted)
    left = pool.left_open
    (product,) = pool.products(posted, (matrix,), leave_open=True)
    del posted
    gc.collect()
    assert alive() is not None and holding.pool is pool and pool.left_open == left + 1
    assert not _free(pool)  # another thread computes alone meanwhile
    settle()
    np.testing.assert_array_equal(product, expected)
    assert holding.pool is None and pool._open is None and _free(pool)
    gc.collect()
    assert alive() is None


def _gated_down_arrays(width: int, inner: int) -> tuple:
    """A gated MLP's down step: gate, numpy's exp(-gate), up, the down weight, the residual, the
    norm's weight."""
    gate = RNG.standard_normal(inner).astype(np.float32)
    return (gate, np.exp(-gate), RNG.standard_normal(inner).astype(np.float32),
            RNG.standard_normal((inner, width)).astype(np.float32), RNG.standard_normal(width).astype(np.float32),
            RNG.standard_normal(width).astype(np.float32))


@pytest.mark.parametrize("skip", [False, True])
def test_a_jobs_tail_completes_its_outputs_before_anything_reads_them(pool, skip):
    """`DecodePool.open_call`: ResidualGatedMLP's down product left open, its residual add and norm
    (the tail) run by this thread once the job is finished: at `settle`, or first in its next post
    (which may read them); bitwise the finished kernel's (`gated_down`), the tail run once."""
    from runnx.ops import _decode_blocks
    from runnx.ops._kernels_linalg import chunk_count

    width, inner = 64, 4 * slots.SUM_BLOCK
    gate, decay, up, weight, residual, norm_weight = _gated_down_arrays(width, inner)
    summed, normed = decode_pool.shared_call(_decode_blocks.gated_down, gate, decay.copy(), up, weight,
                                             residual.copy(), 1e-5, 1.0, norm_weight, skip)
    matrix = RNG.standard_normal((width, 3 * slots.SUM_BLOCK)).astype(np.float32)
    for then in ("settle", "post"):
        product, got = np.empty(width, np.float32), np.empty(width, np.float32)
        activated = decay.copy()
        tail = (residual.copy(), product, 1e-5, 1.0, norm_weight, skip, got)
        assert pool.open_call(_open_gated_down, (gate, activated, up, weight, product),
                              (gate, activated, up, weight, product), _decode_blocks.add_norm_into, tail,
                              chunk_count(inner) * width)
        assert holding.pool is pool and pool._tail is not None and not _free(pool)
        if then == "settle":
            settle()
        else:  # a product of the norm the tail writes: the post runs the tail first
            (next_product,) = pool.products(got, (matrix,))
            np.testing.assert_array_equal(next_product, row_times_matrix(normed, matrix))
        assert holding.pool is None and pool._tail is None and _free(pool)
        np.testing.assert_array_equal(product, summed)
        np.testing.assert_array_equal(got, normed)


def _open_gated_down(board, workers, gate, decay, up, weight, product, scratch):
    """ResidualGatedMLP's activation, then its down product opened (`open_products`), as a kernel's
    `open_call` job: 1 when a worker was idle, else 0."""
    from runnx.ops._kernels_fused import silu_mul_into

    return 1 if jobs.open_products(board, workers, silu_mul_into(gate, decay, up), (weight,), (product,), scratch, 0.0,
                                   1.0) else 0


def test_a_job_that_posts_nothing_is_not_left_open(pool):
    """A job whose arrays do not fit posts nothing (it returns -1): `open_call` returns False, the
    pool free and no tail kept (the kernel then computes it finished)."""
    ran = []
    assert not pool.open_call(lambda box, workers: -1, (), (), lambda: ran.append(1), ())
    assert holding.pool is None and pool._tail is None and _free(pool) and not ran


def test_without_leave_a_post_returns_finished(pool):
    matrix = RNG.standard_normal((64, 300)).astype(np.float32)
    row = RNG.standard_normal(64).astype(np.float32)
    left = pool.left_open
    (product,) = pool.products(row, (matrix,), leave_open=True)
    assert holding.pool is None and pool.left_open == left and _free(pool)
    assert pool.box[slots.COMPLETED] == pool.box[slots.UNITS]
    np.testing.assert_array_equal(product, row_times_matrix(row, matrix))


def _tiles(columns: int, depth: int):
    b = RNG.integers(0, 256, (columns, depth // 32, 16), dtype=np.uint8)
    return _nibble_tiles((), b, RNG.random(columns * depth // 32).astype(np.float32), None)


def test_a_post_finishes_the_open_job_whose_output_it_reads(pool, leave):
    """A chain of products, each reading the last one's output while that job may still be open:
    float and 4-bit, each job's second phase or last tile computed on either thread."""
    depth = 576
    first, second = RNG.standard_normal((depth, depth)).astype(np.float32), _tiles(depth, depth)
    row = RNG.standard_normal((1, depth)).astype(np.float32)
    expected = [row]
    for step in range(6):
        out = np.empty((1, depth), np.float32)
        if step % 2:
            decode_pool.alone(jobs.post_nbits, expected[-1], *second, out)
        else:
            out = row_times_matrix(expected[-1].reshape(-1), first).reshape(1, depth)
        expected.append(out / np.float32(32))
    for _ in range(20):
        got = row
        for step in range(6):
            if step % 2:
                out = np.empty((1, depth), np.float32)
                decode_pool.open_nbits_rows(got, *second, out)
            else:
                (out,) = pool.products(got, (first,), leave_open=True)
                out = out.reshape(1, depth)
            assert holding.pool is pool
            settle()  # (the scaling below reads it; the next post reads the scaled rows)
            got = out / np.float32(32)
            np.testing.assert_array_equal(got, expected[step + 1])


@pytest.mark.parametrize("shift", [63, mailbox.DEFAULT_CLAIM_SHIFT, 1])  # a unit a claim; an eighth; half
def test_a_second_phase_starts_after_the_first_is_complete(pool, shift):
    """A products job adds its partial rows in its second phase: no claim spans both phases, and a
    second-phase unit waits for every first-phase unit, whoever computes them."""
    matrix = RNG.standard_normal((1024, 6 * slots.SUM_BLOCK + 7)).astype(np.float32)
    row = RNG.standard_normal(1024).astype(np.float32)
    expected = row_times_matrix(row, matrix)
    pool.box[slots.CLAIM_SHIFT] = shift
    try:
        for _ in range(20):
            np.testing.assert_array_equal(pool.products(row, (matrix,))[0], expected)
            assert pool.box[slots.FIRST_PHASE] == 8 and pool.box[slots.UNITS] == 8 + 7
    finally:
        pool.box[slots.CLAIM_SHIFT] = mailbox.DEFAULT_CLAIM_SHIFT


def _chain_model(depth: int, width: int):
    """x @ w1 (wide: its job outlasts the plan's next steps), read by an Add; then two products in a
    row, the second reading the first; then a Relu of the last: every reader of an open job's (or a
    deferred call's) output."""
    rng = np.random.default_rng(1)
    weights = {"w1": rng.standard_normal((depth, width)).astype(np.float32) / 16,
               "w2": rng.standard_normal((width, depth)).astype(np.float32) / 16,
               "w3": rng.standard_normal((depth, depth)).astype(np.float32) / 16,
               "bias": rng.standard_normal(width).astype(np.float32)}
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["a"]),
             helper.make_node("Add", ["a", "bias"], ["b"]),
             helper.make_node("MatMul", ["b", "w2"], ["c"]),
             helper.make_node("MatMul", ["c", "w3"], ["d"]),
             helper.make_node("Relu", ["d"], ["y"])]
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, depth])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, depth])],
                              [numpy_helper.from_array(v, k) for k, v in weights.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def test_a_compiled_plan_settles_before_each_step_reading_an_open_jobs_output(pool):
    model = _chain_model(512, 8 * slots.SUM_BLOCK)
    overlapped, finished = runnx.load(model, fuse=False), runnx.load(model, fuse=False, overlap_jobs=False)
    x = RNG.standard_normal((1, 512)).astype(np.float32)
    expected = finished.run({"x": x})["y"]
    assert np.count_nonzero(expected) > 100
    overlaps = lambda: pool.left_open + open_jobs.deferred.count  # noqa: E731  (jobs left open, calls deferred)
    before = overlaps()
    runs = 10
    for _ in range(runs):  # interpreted, then compiled
        np.testing.assert_array_equal(overlapped.run({"x": x})["y"], expected)
        assert holding.pool is None and not opening.allowed and _free(pool) and open_jobs.deferred.calls is None
    compiled = runs - overlapped.options.compile_after + 1
    assert overlaps() - before == 3 * compiled  # the three products of each compiled run
    for _ in range(3):
        np.testing.assert_array_equal(finished.run({"x": x})["y"], expected)
    assert overlaps() - before == 3 * compiled


def test_a_failing_step_after_an_open_job_leaves_the_pool_settled(pool):
    model = _chain_model(512, 8 * slots.SUM_BLOCK)
    model.graph.node[1].input[1] = "short"
    model.graph.initializer.append(numpy_helper.from_array(np.ones(3, np.float32), "short"))
    runner = runnx.load(onnx.load_from_string(model.SerializeToString()), fold_constants=False)
    x = RNG.standard_normal((1, 512)).astype(np.float32)
    for _ in range(4):
        with pytest.raises(runnx.RunnxError):
            runner.run({"x": x})
        assert holding.pool is None and not opening.allowed and _free(pool)


def _greedy_logits(folder, overlap: bool, steps: int) -> list:
    """The logits of a prompt and `steps` greedy decode steps of the decoder in `folder`."""
    from runnx.generate.decoder import DecoderStep

    load = lambda path: runnx.load(path, check_symbolic_dims=False, last_position=("logits",),  # noqa: E731
                                   overlap_jobs=overlap)
    decoder = DecoderStep.from_folder(folder, capacity=64, load=load)
    logits = [decoder.step(np.array([[1, 4093, 314, 2362, 30, 216]], np.int64))]
    for _ in range(steps):
        logits.append(decoder.step(np.array([[int(logits[-1][0, -1].argmax())]], np.int64)))
    return logits


@pytest.mark.parametrize("workers", [0, 1], ids=["one thread", "two threads"])
@pytest.mark.parametrize("folder", ["smollm2_genai_int4_dir", "smollm2_genai_fp32_dir", "smollm2_dir"])
def test_real_decoders_give_the_same_bits_with_jobs_left_open(workers, folder, request):
    """onnxruntime-genai's folders (4-bit and float products, GroupQueryAttention and
    SkipSimplifiedLayerNormalization between them) and the Optimum export (its fused layers),
    decoded with jobs left open or calls deferred and with everything computed at once, with one
    thread and with two: bitwise the same logits."""
    path = request.getfixturevalue(folder)
    decode_pool.set_workers(workers)
    try:
        pool = decode_pool.pool()
        left, deferred = pool.left_open if pool else 0, open_jobs.deferred.count
        overlapped = _greedy_logits(path, True, 8)
        overlaps = (pool.left_open - left if pool else 0) + open_jobs.deferred.count - deferred
        assert overlaps >= 8 * 30
        for got, expected in zip(overlapped, _greedy_logits(path, False, 8)):
            np.testing.assert_array_equal(got, expected)
    finally:
        settle()
        decode_pool.set_workers(None)


@pytest.mark.parametrize("folder", ["smollm2_genai_fp32_dir", "smollm2_dir"])
def test_a_deferred_gated_mlp_is_one_native_call_with_the_bits_of_two(folder, request, monkeypatch):
    """Where numpy's exp loop is at hand, a decode step's gated MLP (ResidualGatedMLP: onnxruntime-genai's
    fp32 folder and Optimum's export) defers one native call (`projected_gate_down_into`) where it
    deferred two: a layer's call fewer each step, and bitwise the logits of the two calls."""
    from runnx.ops import fused_norms, fused_residual_blocks

    path = request.getfixturevalue(folder)
    decode_pool.set_workers(1)
    try:
        steps, before = 6, open_jobs.deferred.count
        merged = _greedy_logits(path, True, steps)
        merged_calls, before = open_jobs.deferred.count - before, open_jobs.deferred.count
        original = fused_norms.defer_gated_mlp
        monkeypatch.setattr(fused_residual_blocks, "defer_gated_mlp", lambda *arguments: original(*arguments[:8]))
        two = _greedy_logits(path, True, steps)
        fewer = open_jobs.deferred.count - before - merged_calls
        assert fewer >= 30 * (steps - 1) and fewer % 30 == 0
        for got, expected in zip(merged, two):
            np.testing.assert_array_equal(got, expected)
    finally:
        settle()
        decode_pool.set_workers(None)


def _prompt_logits(folder, overlap: bool, pool) -> tuple:
    """The logits of a 32-token prompt of the decoder in `folder`, and the jobs left open for it."""
    from runnx.generate.decoder import DecoderStep

    load = lambda path: runnx.load(path, check_symbolic_dims=False, last_position=("logits",),  # noqa: E731
                                   overlap_jobs=overlap)
    decoder = DecoderStep.from_folder(folder, capacity=64, load=load)
    left = pool.left_open
    logits = decoder.step(np.arange(1000, 1032, dtype=np.int64)[None])
    return logits, pool.left_open - left


@pytest.mark.parametrize("folder", ["smollm2_dir", "qwen2_dir", "phi3_dir"])
def test_a_short_prompt_leaves_its_layers_jobs_open_with_the_same_bits(folder, request):
    """A 32-token prompt of Optimum's exports (SmolLM2, its Qwen2 and Phi-3 builds) at two threads:
    each layer's q/k/v products, its attention and its down product are left open to the workers
    (the next node's Python runs while they compute), and the logits are bitwise those of
    everything computed at once."""
    path = request.getfixturevalue(folder)
    decode_pool.set_workers(1)
    try:
        pool = decode_pool.pool()
        opened, count = _prompt_logits(path, True, pool)
        assert count >= 3 * 30
        expected, none = _prompt_logits(path, False, pool)
        assert none == 0
        np.testing.assert_array_equal(opened, expected)
    finally:
        settle()
        decode_pool.set_workers(None)


def _whisper_logits(folder, features, overlap: bool, steps: int) -> list:
    """The decoder's logits over a window's greedy decoding (`steps` tokens) of Whisper in `folder`."""
    from runnx.generate.whisper import Whisper

    whisper = Whisper(folder, load=lambda path: runnx.load(path, check_symbolic_dims=False, overlap_jobs=overlap))
    logits, step = [], whisper.decoder.step
    whisper.decoder.step = lambda *a, **k: logits.append(step(*a, **k).copy()) or logits[-1]
    whisper.decode(whisper.encode(features), max_new_tokens=steps)
    return logits


@pytest.mark.parametrize("workers", [0, 1], ids=["one thread", "two threads"])
def test_whisper_decodes_the_same_bits_with_calls_deferred(workers, whisper_dir, audio_dir):
    """Whisper tiny.en's decoder (LayerNorm layers: ProjectedAppend, HeadsAttention,
    MatMulAddLayerNorm, ProjectedHeadsAttention, ResidualGeluMLP defer their calls) against
    everything computed at once: bitwise the same logits at every step, one thread and two."""
    from runnx.generate.audio import load_audio
    from runnx.generate.mel import window_features

    features = window_features(load_audio(audio_dir / "john.wav"))
    decode_pool.set_workers(workers)
    try:
        deferred = open_jobs.deferred.count
        overlapped = _whisper_logits(whisper_dir, features, True, 12)
        assert open_jobs.deferred.count - deferred >= 8 * 5 * 4  # (every layer's five ops, from the third step)
        expected = _whisper_logits(whisper_dir, features, False, 12)
        assert len(overlapped) == len(expected) > 8
        for got, want in zip(overlapped, expected):
            np.testing.assert_array_equal(got, want)
    finally:
        settle()
        decode_pool.set_workers(None)


def test_a_job_left_open_on_a_replaced_pool_is_finished_by_the_next_post(leave):
    """set_workers replaces the pool: the thread's next post, on the new pool, finishes the job it
    left open on the old one (whose output it may read) and releases the old pool."""
    matrix = RNG.standard_normal((256, 4 * slots.SUM_BLOCK)).astype(np.float32)
    second = RNG.standard_normal((4 * slots.SUM_BLOCK, 64)).astype(np.float32)
    row = RNG.standard_normal(256).astype(np.float32)
    decode_pool.set_workers(1)
    try:
        old = decode_pool.pool()
        (product,) = old.products(row, (matrix,), leave_open=True)
        assert holding.pool is old
        decode_pool.set_workers(1 if old._workers == 2 else 2)  # a pool of another size replaces it
        new = decode_pool.pool()
        assert new is not old
        (got,) = new.products(product, (second,))
        assert old._open is None and _free(old) and holding.pool is None
        expected = row_times_matrix(row_times_matrix(row, matrix), second)
        np.testing.assert_array_equal(got, expected)
    finally:
        settle()
        decode_pool.set_workers(None)
