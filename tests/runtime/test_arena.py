"""runnx/runtime/arena.py: while a model runs, numpy's arrays on the running thread come from runnx's
handler, which keeps freed blocks of KEPT_FROM bytes or more for the run's next request of their
size and gives them back when the last run ends; everywhere else numpy's own allocator holds. On or
off, a run's results are the same bits."""
import os
import threading

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import runnx
from runnx.runtime import arena

pytestmark = pytest.mark.skipif(not arena.supported(), reason="numpy's memory handler over libc: Linux only")
LARGE = arena.KEPT_FROM // 4 + 1024  # float32 elements of a block the arena keeps


@pytest.fixture(autouse=True, scope="module")
def handler():
    assert arena.wait_prepared(), "the arena's handler could not be made"


def _handler_name(array=None) -> str:
    return np._core.multiarray.get_handler_name(array) if array is not None else \
        np._core.multiarray.get_handler_name()


def test_a_freed_large_block_is_handed_out_again_for_the_same_size():
    with arena.kept():
        first = np.empty(LARGE, np.float32)
        first[:] = 7
        address = first.ctypes.data
        del first
        assert arena.kept_bytes() == LARGE * 4
        reused = arena.reused()
        second = np.empty(LARGE, np.float32)
        assert second.ctypes.data == address and arena.reused() == reused + 1
        assert arena.kept_bytes() == 0
        other = np.empty(LARGE + 16, np.float32)  # another size takes a block of its own
        assert other.ctypes.data != address
        small = np.empty(1000, np.float32)
        del small
        assert arena.kept_bytes() == 0  # (small blocks are malloc's)
        del second, other
        assert arena.kept_bytes() == 2 * LARGE * 4 + 64
    assert arena.kept_bytes() == 0  # the last run's end gives everything back


def test_the_handler_holds_on_the_running_thread_only_and_within_runs():
    assert _handler_name() == "default_allocator"
    seen = []
    with arena.kept():
        assert _handler_name() == "runnx_arena"
        inside = np.empty(LARGE, np.float32)
        thread = threading.Thread(target=lambda: seen.append(_handler_name(np.empty(LARGE, np.float32))))
        thread.start()
        thread.join()
        with arena.kept():  # a nested run (a subgraph's) leaves it to the outermost
            pass
        assert _handler_name() == "runnx_arena"
    assert _handler_name() == "default_allocator" and seen == ["default_allocator"]
    assert _handler_name(inside) == "runnx_arena"
    inside[:] = 1  # an array outliving its run stays usable, and goes back to libc when freed
    assert inside.sum() == LARGE
    del inside
    assert arena.kept_bytes() == 0


def test_a_process_keeping_freed_memory_in_glibc_has_no_arena(monkeypatch):
    """`runnx.keep_freed()` (the `runnx` command's, the benchmarks'): glibc's heap keeps freed memory
    of any size, and runs allocate as numpy does."""
    from runnx.runtime import allocator
    monkeypatch.setattr(allocator, "_kept", True)
    assert not arena.wait_prepared()
    with arena.kept():
        assert _handler_name() == "default_allocator"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
def test_a_forked_child_counts_only_its_own_runs():
    """Another thread's run under way at a fork is not the child's: the child keeps nothing between
    its own runs, and its own runs keep and give back as the parent's do."""
    entered, leave = threading.Event(), threading.Event()

    def another_run():
        with arena.kept():
            entered.set()
            leave.wait()

    thread = threading.Thread(target=another_run)
    thread.start()
    entered.wait()
    try:
        child = os.fork()
        if child == 0:  # the child: only this thread
            failed = 1
            try:
                outside = np.empty(LARGE, np.float32)
                del outside  # no run of its own under way: back to libc
                with arena.kept():
                    kept_outside = arena.kept_bytes()
                    first = np.empty(LARGE, np.float32)
                    address = first.ctypes.data
                    del first
                    again = np.empty(LARGE, np.float32).ctypes.data == address
                failed = int(not (kept_outside == 0 and again and arena.kept_bytes() == 0))
            finally:
                os._exit(failed)
        _, status = os.waitpid(child, 0)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    finally:
        leave.set()
        thread.join()
    assert arena.kept_bytes() == 0


def test_zeros_resizing_and_contents_are_numpys():
    with arena.kept():
        dirty = np.full(LARGE, 3.0, np.float32)
        del dirty  # kept, its contents left as they were
        zeros = np.zeros(LARGE, np.float32)  # calloc: never a kept block
        assert not zeros.any()
        grown = np.arange(LARGE, dtype=np.float32)
        grown.resize(2 * LARGE, refcheck=False)  # realloc
        assert np.array_equal(grown[:LARGE], np.arange(LARGE, dtype=np.float32)) and not grown[LARGE:].any()
        grown.resize(10, refcheck=False)
        assert np.array_equal(grown, np.arange(10, dtype=np.float32))
        empty = np.empty(0, np.float32)
        assert empty.size == 0


def _chain_model(width: int, depth: int):
    """x (rows, width) through `depth` MatMul + Relu layers: every value a large array."""
    rng = np.random.default_rng(0)
    nodes, inits, last = [], [], "x"
    for i in range(depth):
        inits.append(numpy_helper.from_array((rng.standard_normal((width, width)) / width ** 0.5).astype(np.float32),
                                             f"w{i}"))
        nodes += [helper.make_node("MatMul", [last, f"w{i}"], [f"m{i}"]),
                  helper.make_node("Relu", [f"m{i}"], [f"r{i}"])]
        last = f"r{i}"
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", width])],
                              [helper.make_tensor_value_info(last, TensorProto.FLOAT, ["n", width])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_a_model_gives_the_same_bits_with_the_arena_on_and_off():
    """The switch (Options.arena) on and off over runs whose values are all blocks the arena keeps:
    blocks are handed out again with it on, never with it off, and the outputs are equal."""
    model = _chain_model(512, 6)
    x = np.random.default_rng(1).standard_normal((1024, 512)).astype(np.float32)
    outputs = {}
    for on in (True, False):
        runner = runnx.load(model, arena=on)
        before = arena.reused()
        outputs[on] = [runner.run({"x": x})["r5"] for _ in range(3)]
        assert (arena.reused() > before) == on
        assert arena.kept_bytes() == 0
    for got, expected in zip(outputs[True], outputs[False]):
        np.testing.assert_array_equal(got, expected)
    assert not runnx.load(model, optimization_level="disabled").options.arena


def test_a_real_decoders_long_prompt_gives_the_same_logits_with_the_arena(smollm2_dir):
    """SmolLM2's prefill of 300 tokens and a few greedy steps, the arena on and off: the same
    logits, bit for bit, and the prefill's blocks handed out again."""
    from runnx.generate.decoder import DecoderStep

    prompt = np.random.default_rng(2).integers(3, 40000, (1, 300)).astype(np.int64)
    logits = {}
    for on in (True, False):
        def load(path, on=on):
            return runnx.load(path, check_symbolic_dims=False, last_position=("logits",), arena=on)

        decoder = DecoderStep.from_folder(smollm2_dir, capacity=320, load=load)
        before = arena.reused()
        steps = [decoder.step(prompt)]
        assert (arena.reused() > before) == on
        for _ in range(3):
            steps.append(decoder.step(np.array([[int(steps[-1][0, -1].argmax())]], np.int64)))
        logits[on] = steps
    for got, expected in zip(logits[True], logits[False]):
        np.testing.assert_array_equal(got, expected)
