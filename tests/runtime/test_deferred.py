"""Calls deferred by kernels given leave (runnx/runtime/open_jobs.py: `defer`): they run in order
when the thread settles, or first in any post that computes now; a compiled plan settles before a
step that may read pending data (any other step, or one declaring it in `reads_data`); a failed run
drops them. Results are bitwise those of the calls run at once."""
import threading

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import runnx
from runnx.ops import registry
from runnx.ops._kernels_linalg import chunk_count, row_times_matrix
from runnx.runtime import defer, jobs, open_jobs, opening, settle, take_leave
from runnx.runtime import pool as decode_pool
from runnx.runtime.open_jobs import deferred, holding

RNG = np.random.default_rng(3)
F = TensorProto.FLOAT


@pytest.fixture(params=[0, 1], ids=["alone", "pool"])
def workers(request):
    """No decode pool (one thread: calls run on this thread's board) or a pool of one worker."""
    decode_pool.set_workers(request.param)
    yield decode_pool.pool()
    settle()
    opening.allowed = False
    decode_pool.set_workers(None)


def _products_into(row, matrix, out):
    """row @ matrix into out, deferred as a pool job (`jobs.post_products`)."""
    scratch = np.empty(chunk_count(row.size) * out.size, np.float32)
    defer(jobs.post_products, (row, (matrix,), (out,), scratch, 0.0, 1.0), job=True)


def test_deferred_calls_run_in_order_when_the_thread_settles(workers):
    matrix = RNG.standard_normal((64, 96)).astype(np.float32)
    second = RNG.standard_normal((96, 64)).astype(np.float32)
    row = RNG.standard_normal(64).astype(np.float32)
    first, out = np.full(96, np.nan, np.float32), np.full(64, np.nan, np.float32)
    count = deferred.count
    _products_into(row, matrix, first)
    _products_into(first, second, out)  # reads what the first writes
    assert np.isnan(out).all() and deferred.count == count + 2 and len(deferred.calls) == 2
    settle()
    assert deferred.calls is None
    np.testing.assert_array_equal(out, row_times_matrix(row_times_matrix(row, matrix), second))


@pytest.fixture
def pool():
    decode_pool.set_workers(1)
    yield decode_pool.pool()
    settle()
    decode_pool.set_workers(None)


def test_a_post_runs_the_deferred_calls_before_its_own(pool):
    """Nothing overtakes a deferred call: a product posted now (here, of the deferred one's output)
    runs after it, and calls a deferred call defers run in the same settle."""
    matrix = RNG.standard_normal((64, 96)).astype(np.float32)
    second = RNG.standard_normal((96, 32)).astype(np.float32)
    row = RNG.standard_normal(64).astype(np.float32)
    first, later = np.full(96, np.nan, np.float32), np.full(32, np.nan, np.float32)
    _products_into(row, matrix, first)
    defer(_products_into, (first, second, later))  # a call deferring another
    (got,) = pool.products(first, (second,))
    expected = row_times_matrix(row_times_matrix(row, matrix), second)
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(later, expected)
    assert deferred.calls is None and holding.pool is None


def test_deferred_calls_are_this_threads_own(workers):
    row = RNG.standard_normal(64).astype(np.float32)
    matrix = RNG.standard_normal((64, 8)).astype(np.float32)
    out = np.full(8, np.nan, np.float32)
    _products_into(row, matrix, out)
    seen = []
    thread = threading.Thread(target=lambda: (seen.append(deferred.calls), settle()))
    thread.start()
    thread.join()
    assert seen == [None] and np.isnan(out).all()
    settle()
    np.testing.assert_array_equal(out, row_times_matrix(row, matrix))


NEGATED = []  # one entry per LazyNeg call run


def _negate(x, out):
    np.negative(x, out=out)
    NEGATED.append(1)


@pytest.fixture
def lazy_kernels():
    """runnx.test kernels: LazyNeg (-x, its call deferred given leave, the output NaN till then);
    two that read a second input's data from Python, SumOf declaring it (`reads_data`), SumOfBlind
    not; and Checked (x, raising RunnxError for a leading dim of 7; m read for nothing but order)."""
    def LazyNeg(x):
        out = np.full(x.shape, np.nan, x.dtype)
        if take_leave():
            defer(_negate, (x, out))
        else:
            _negate(x, out)
        return out

    def SumOf(x, m):
        take_leave()
        return x + np.float32(m.sum())

    def Checked(x, m):
        take_leave()
        if x.shape[0] == 7:
            raise runnx.RunnxError("Checked refuses a leading dim of 7")
        return x

    registry.register("LazyNeg", since=1, domain="runnx.test", overlaps_jobs=True)(LazyNeg)
    registry.register("SumOf", since=1, domain="runnx.test", overlaps_jobs=True, reads_data=(1,))(SumOf)
    registry.register("SumOfBlind", since=1, domain="runnx.test", overlaps_jobs=True)(SumOf)
    registry.register("Checked", since=1, domain="runnx.test", overlaps_jobs=True)(Checked)
    yield
    for op in ("LazyNeg", "SumOf", "SumOfBlind", "Checked"):
        registry._REGISTRY.pop(("runnx.test", op))


def _lazy_model(reader: str, tail: str = "Relu"):
    """m = LazyNeg(x); y = <reader>(x, m); out = <tail>(y)."""
    nodes = [helper.make_node("LazyNeg", ["x"], ["m"], domain="runnx.test"),
             helper.make_node(reader, ["x", "m"], ["y"], domain="runnx.test"),
             helper.make_node(tail, ["y"], ["out"])]
    graph = helper.make_graph(nodes, "lazy", [helper.make_tensor_value_info("x", F, [2, 3])],
                              [helper.make_tensor_value_info("out", F, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("runnx.test", 1)],
                             ir_version=10)


def test_a_plan_settles_before_a_step_reading_pending_data_it_declares(workers, lazy_kernels):
    """The compiled plan gives LazyNeg leave (its call deferred); SumOf reads m from Python, declared:
    the plan settles before it. SumOfBlind reads it undeclared, so it reads the NaNs of a call not
    yet run: what the rule prevents, and proof that the call was deferred."""
    x = RNG.standard_normal((2, 3)).astype(np.float32)
    expected = np.maximum(x + np.float32((-x).sum()), 0)
    declared, blind = runnx.load(_lazy_model("SumOf")), runnx.load(_lazy_model("SumOfBlind"))
    count = deferred.count
    for run in range(declared.options.compile_after + 2):  # interpreted runs, then compiled ones
        np.testing.assert_array_equal(declared.run({"x": x})["out"], expected)
        assert deferred.calls is None and not opening.allowed
    assert deferred.count > count
    for run in range(blind.options.compile_after + 2):
        got = blind.run({"x": x})["out"]
    assert np.isnan(got).all()  # (Relu of NaN)


def test_without_leave_nothing_is_deferred(workers, lazy_kernels):
    x = RNG.standard_normal((2, 3)).astype(np.float32)
    blind = runnx.load(_lazy_model("SumOfBlind"), overlap_jobs=False)
    count = deferred.count
    for _ in range(blind.options.compile_after + 2):
        np.testing.assert_array_equal(blind.run({"x": x})["out"], np.maximum(x + np.float32((-x).sum()), 0))
    assert deferred.count == count


def test_a_failing_run_drops_its_deferred_calls(workers, lazy_kernels):
    """A step failing while a call is deferred: the run raises that step's error, the call is dropped
    (it would write only the failed run's outputs), the thread holds no pool and no leave."""
    nodes = [helper.make_node("LazyNeg", ["x"], ["m"], domain="runnx.test"),
             helper.make_node("Checked", ["z", "m"], ["c"], domain="runnx.test"),
             helper.make_node("Add", ["m", "c"], ["out"])]
    graph = helper.make_graph(nodes, "failing", [helper.make_tensor_value_info("x", F, [None, 3]),
                                                 helper.make_tensor_value_info("z", F, [None, 3])],
                              [helper.make_tensor_value_info("out", F, None)])
    runner = runnx.load(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18),
                                                                helper.make_opsetid("runnx.test", 1)], ir_version=10))
    x, z = RNG.standard_normal((2, 3)).astype(np.float32), np.ones((1, 3), np.float32)
    for _ in range(runner.options.compile_after + 2):  # interpreted runs, then compiled ones
        np.testing.assert_array_equal(runner.run({"x": x, "z": z})["out"], -x + z)
        count, ran = deferred.count, len(NEGATED)
        with pytest.raises(runnx.RunnxError, match="leading dim of 7"):
            runner.run({"x": x, "z": np.ones((7, 3), np.float32)})
        assert len(NEGATED) == ran + (deferred.count == count)  # run at once, or deferred and dropped
        assert deferred.calls is None and holding.pool is None and not opening.allowed
    assert deferred.count > count


def test_a_plan_does_not_settle_before_last_position(workers, lazy_kernels):
    """LastPosition (a decode step's LM head input) makes a view and reads no data, so a compiled
    plan leaves calls pending across it: a decode step's LM head joins its layers' queued calls.
    SumOfBlind after it reads the NaNs of a call not yet run (nothing settled before either);
    SumOf, declaring the read, gets the values."""
    def model(reader: str):
        nodes = [helper.make_node("LazyNeg", ["x"], ["m"], domain="runnx.test"),
                 helper.make_node("LastPosition", ["m"], ["last"], domain="runnx.fused"),
                 helper.make_node(reader, ["last", "last"], ["y"], domain="runnx.test"),
                 helper.make_node("Relu", ["y"], ["out"])]
        graph = helper.make_graph(nodes, "last", [helper.make_tensor_value_info("x", F, [1, 2, 3])],
                                  [helper.make_tensor_value_info("out", F, None)])
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("runnx.test", 1),
                                                       helper.make_opsetid("runnx.fused", 1)], ir_version=10)

    x = RNG.standard_normal((1, 2, 3)).astype(np.float32)
    last = -x[:, -1:]
    expected = np.maximum(last + np.float32(last.sum()), 0)
    declared, blind = runnx.load(model("SumOf")), runnx.load(model("SumOfBlind"))
    for _ in range(declared.options.compile_after + 2):  # interpreted runs, then compiled ones
        np.testing.assert_array_equal(declared.run({"x": x})["out"], expected)
        assert deferred.calls is None
    got = [blind.run({"x": x})["out"] for _ in range(blind.options.compile_after + 2)]
    np.testing.assert_array_equal(got[0], expected)  # (interpreted: nothing deferred)
    assert np.isnan(got[-1]).all()
