"""Subgraph captures: moved (by value) when the parent owns them and the node is their last use,
lent by reference otherwise; Loop iterations never copy captures; loop-carried values grow in place."""
from __future__ import annotations

import numpy as np
from onnx import TensorProto as T
from onnx import helper
import onnxruntime

import runnx

OPSET = [helper.make_opsetid("", 18)]
# these models are one If on an input, which runnx otherwise runs as the chosen branch's own graph
# (interp/branches.py): here the If runs as a node, to test how its captures reach the branch
AS_NODE = {"specialize_branches": False}


def _onnxruntime(proto, feeds):
    """The reference result (onnx's ReferenceEvaluator mishandles a Loop without a condition)."""
    return onnxruntime.InferenceSession(proto.SerializeToString()).run(None, feeds)[0]


def _branch(op, name):
    one = helper.make_tensor("one_" + name, T.FLOAT, [], [1.0])
    return helper.make_graph([helper.make_node(op, ["x", "one_" + name], ["y_" + name])], name, [],
                             [helper.make_tensor_value_info("y_" + name, T.FLOAT, None)], [one])


def _if_model(extra_reader=False):
    """cond ? x + 1 : x - 1, reading the input x only through the If's capture."""
    nodes = [helper.make_node("If", ["cond"], ["y"], then_branch=_branch("Add", "then"),
                              else_branch=_branch("Sub", "else"))]
    outputs = [helper.make_tensor_value_info("y", T.FLOAT, None)]
    if extra_reader:  # x is still needed after the If: it must be lent, not moved
        nodes.append(helper.make_node("Neg", ["x"], ["negated"]))
        outputs.append(helper.make_tensor_value_info("negated", T.FLOAT, None))
    graph = helper.make_graph(nodes, "if", [helper.make_tensor_value_info("cond", T.BOOL, []),
                                            helper.make_tensor_value_info("x", T.FLOAT, [4])], outputs)
    return helper.make_model(graph, opset_imports=OPSET, ir_version=9)


def test_owned_capture_is_moved_into_the_branch_and_consumed_in_place():
    model = runnx.load(_if_model(), **AS_NODE)
    buffer = np.arange(4, dtype=np.float32)
    result, profile = model.run({"cond": np.array(True), "x": runnx.Owned(buffer)}, profile=True)
    assert profile.moves == 1
    assert profile.inplace["Add"] == 1
    assert np.shares_memory(result["y"], buffer)
    np.testing.assert_array_equal(result["y"], np.arange(4, dtype=np.float32) + 1)


def test_borrowed_capture_is_lent_and_the_callers_array_is_unchanged():
    model = runnx.load(_if_model(), **AS_NODE)
    x = np.arange(4, dtype=np.float32)
    result, profile = model.run({"cond": np.array(False), "x": x}, profile=True)
    assert profile.moves == 0 and profile.inplace_total == 0
    np.testing.assert_array_equal(x, np.arange(4, dtype=np.float32))
    np.testing.assert_array_equal(result["y"], x - 1)


def test_capture_still_needed_by_the_parent_is_lent_not_moved():
    model = runnx.load(_if_model(extra_reader=True), **AS_NODE)
    result, profile = model.run({"cond": np.array(True), "x": runnx.Owned(np.arange(4, dtype=np.float32))},
                                profile=True)
    assert profile.moves == 0
    np.testing.assert_array_equal(result["y"], np.arange(4, dtype=np.float32) + 1)
    np.testing.assert_array_equal(result["negated"], -np.arange(4, dtype=np.float32))


def _loop_concat_model():
    """acc = Concat(acc, row * i) for i in range(trips), with acc loop-carried."""
    body = helper.make_graph(
        [helper.make_node("Cast", ["i"], ["i_float"], to=T.FLOAT),
         helper.make_node("Mul", ["row", "i_float"], ["scaled"]),
         helper.make_node("Concat", ["acc_in", "scaled"], ["acc_out"], axis=0),
         helper.make_node("Identity", ["cond_in"], ["cond_out"])],
        "body",
        [helper.make_tensor_value_info("i", T.INT64, []), helper.make_tensor_value_info("cond_in", T.BOOL, []),
         helper.make_tensor_value_info("acc_in", T.FLOAT, None)],
        [helper.make_tensor_value_info("cond_out", T.BOOL, []), helper.make_tensor_value_info("acc_out", T.FLOAT, None)])
    graph = helper.make_graph(
        [helper.make_node("Loop", ["trips", "", "acc"], ["final"], body=body)], "loop",
        [helper.make_tensor_value_info("trips", T.INT64, []), helper.make_tensor_value_info("acc", T.FLOAT, [None, 3]),
         helper.make_tensor_value_info("row", T.FLOAT, [1, 3])],
        [helper.make_tensor_value_info("final", T.FLOAT, None)])
    return helper.make_model(graph, opset_imports=OPSET, ir_version=9)


def test_loop_carried_concat_grows_in_place():
    proto = _loop_concat_model()
    model = runnx.load(proto)
    row = np.array([[1, 2, 3]], dtype=np.float32)
    trips = 50
    feeds = {"trips": np.array(trips), "acc": np.zeros((1, 3), np.float32), "row": row}
    result, profile = model.run({**feeds, "acc": runnx.Owned(feeds["acc"].copy())}, profile=True)
    expected = _onnxruntime(proto, feeds)
    np.testing.assert_array_equal(result["final"], expected)
    # Amortised doubling: after a few regrowths every append lands in spare capacity. The first
    # Concat allocates exactly: the accumulator (1 row) is not yet longer than what it appends.
    regrown = profile.counters["Concat.regrown"]
    assert regrown <= 7
    assert profile.counters["Concat.appends_in_place"] == trips - 1 - regrown
    copied_rows = profile.counters["Concat.bytes_copied"] // row.nbytes
    assert copied_rows < 3 * trips  # O(n) rows copied in total, not O(n^2)


def test_loop_with_in_place_off_is_bitwise_identical():
    proto = _loop_concat_model()
    feeds = {"trips": np.array(20), "acc": np.ones((2, 3), np.float32), "row": np.full((1, 3), 0.1, np.float32)}
    on = runnx.load(proto).run({**feeds, "acc": runnx.Owned(feeds["acc"].copy())})["final"]
    off = runnx.load(proto, inplace=False).run({**feeds, "acc": runnx.Owned(feeds["acc"].copy())})["final"]
    assert on.tobytes() == off.tobytes()


def _nested_if_in_loop_model():
    """A Loop whose body holds an If that reads `scale`, a top-level input two levels up."""
    then_branch = helper.make_graph([helper.make_node("Mul", ["acc_in", "scale"], ["then_out"])], "then", [],
                                    [helper.make_tensor_value_info("then_out", T.FLOAT, None)])
    else_branch = helper.make_graph([helper.make_node("Add", ["acc_in", "scale"], ["else_out"])], "else", [],
                                    [helper.make_tensor_value_info("else_out", T.FLOAT, None)])
    two = helper.make_tensor("two", T.INT64, [], [2])
    zero = helper.make_tensor("zero", T.INT64, [], [0])
    body = helper.make_graph(
        [helper.make_node("Mod", ["i", "two"], ["parity"]),
         helper.make_node("Equal", ["parity", "zero"], ["even"]),
         helper.make_node("If", ["even"], ["acc_out"], then_branch=then_branch, else_branch=else_branch),
         helper.make_node("Identity", ["cond_in"], ["cond_out"])],
        "body",
        [helper.make_tensor_value_info("i", T.INT64, []), helper.make_tensor_value_info("cond_in", T.BOOL, []),
         helper.make_tensor_value_info("acc_in", T.FLOAT, None)],
        [helper.make_tensor_value_info("cond_out", T.BOOL, []), helper.make_tensor_value_info("acc_out", T.FLOAT, None)],
        [two, zero])
    graph = helper.make_graph(
        [helper.make_node("Loop", ["trips", "", "acc"], ["final"], body=body)], "nested",
        [helper.make_tensor_value_info("trips", T.INT64, []), helper.make_tensor_value_info("acc", T.FLOAT, [3]),
         helper.make_tensor_value_info("scale", T.FLOAT, [3])],
        [helper.make_tensor_value_info("final", T.FLOAT, None)])
    return helper.make_model(graph, opset_imports=OPSET, ir_version=9)


def test_if_in_loop_reads_a_value_two_levels_up_and_it_is_moved_into_the_loop():
    proto = _nested_if_in_loop_model()
    feeds = {"trips": np.array(5), "acc": np.array([1, 2, 3], np.float32),
             "scale": np.array([2, 3, 4], np.float32)}
    expected = _onnxruntime(proto, feeds)
    model = runnx.load(proto)
    scale = feeds["scale"].copy()
    result, moved = model.run({**feeds, "scale": runnx.Owned(scale)}, profile=True)
    np.testing.assert_array_equal(result["final"], expected)
    np.testing.assert_array_equal(scale, feeds["scale"])  # never written: iterations only read it
    result, lent = model.run(feeds, profile=True)
    np.testing.assert_array_equal(result["final"], expected)
    # The loop-carried acc_in (owned from iteration 1 on) moves into the If each iteration; `scale`
    # moves into the Loop's CaptureEnv exactly once when owned, and is lent to every iteration.
    assert lent.moves == feeds["trips"] - 1
    assert moved.moves == lent.moves + 1


def test_if_inside_if_moves_the_value_down_both_levels():
    inner = helper.make_graph([helper.make_node("Add", ["x", "x_one"], ["inner_y"])], "inner", [],
                              [helper.make_tensor_value_info("inner_y", T.FLOAT, None)],
                              [helper.make_tensor("x_one", T.FLOAT, [], [1.0])])
    inner_else = helper.make_graph([helper.make_node("Neg", ["x"], ["inner_n"])], "inner_else", [],
                                   [helper.make_tensor_value_info("inner_n", T.FLOAT, None)])
    outer_then = helper.make_graph(
        [helper.make_node("If", ["cond"], ["outer_y"], then_branch=inner, else_branch=inner_else)], "outer_then",
        [], [helper.make_tensor_value_info("outer_y", T.FLOAT, None)])
    outer_else = helper.make_graph([helper.make_node("Identity", ["x"], ["outer_i"])], "outer_else", [],
                                   [helper.make_tensor_value_info("outer_i", T.FLOAT, None)])
    graph = helper.make_graph(
        [helper.make_node("If", ["cond"], ["y"], then_branch=outer_then, else_branch=outer_else)], "nested_if",
        [helper.make_tensor_value_info("cond", T.BOOL, []), helper.make_tensor_value_info("x", T.FLOAT, [4])],
        [helper.make_tensor_value_info("y", T.FLOAT, None)])
    model = runnx.load(helper.make_model(graph, opset_imports=OPSET, ir_version=9), **AS_NODE)
    buffer = np.zeros(4, np.float32)
    result, profile = model.run({"cond": np.array(True), "x": runnx.Owned(buffer)}, profile=True)
    assert profile.moves == 2
    assert profile.inplace["Add"] == 1 and np.shares_memory(result["y"], buffer)
    np.testing.assert_array_equal(result["y"], np.ones(4, np.float32))
