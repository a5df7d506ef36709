"""Planner: backwards selection of needed nodes, forward order (readers before in-place
consumers), plan caching, and the errors for missing inputs and cycles."""
import numpy as np
import pytest
from onnx import TensorProto, helper

import runnx

F = TensorProto.FLOAT


def _model(nodes, inputs, outputs, initializers=()):
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info(n, F, None) for n in inputs],
        [helper.make_tensor_value_info(n, F, None) for n in outputs], list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _shape_and_add():
    # x is produced (owned); in model order the in-place-capable Add comes before Shape(x).
    return _model([
        helper.make_node("Neg", ["a"], ["x"], name="neg"),
        helper.make_node("Add", ["x", "b"], ["z"], name="add"),
        helper.make_node("Shape", ["x"], ["s"], name="shape"),
    ], ["a", "b"], ["z", "s"])


def test_shape_runs_before_the_in_place_consumer_which_then_runs_in_place():
    model = runnx.load(_shape_and_add())
    assert [n.name for n in model.plan()] == ["neg", "shape", "add"]
    a, b = np.arange(6, dtype=np.float32).reshape(2, 3), np.ones((2, 3), np.float32)
    out, profile = model.run({"a": a, "b": b}, profile=True)
    assert profile.inplace["Add"] == 1
    np.testing.assert_array_equal(out["z"], -a + b)
    np.testing.assert_array_equal(out["s"], [2, 3])


def test_a_live_view_of_x_prevents_in_place_use_of_x():
    model = runnx.load(_model([
        helper.make_node("Neg", ["a"], ["x"], name="neg"),
        helper.make_node("Reshape", ["x", "flat"], ["r"], name="reshape"),
        helper.make_node("Add", ["x", "b"], ["z"], name="add"),  # x dies here, but r still views it
        helper.make_node("Mul", ["r", "c"], ["w"], name="mul"),  # r dies here, sole holder: in place
    ], ["a", "b", "c"], ["z", "w"], [helper.make_tensor("flat", TensorProto.INT64, [1], [-1])]))
    assert [n.name for n in model.plan()] == ["neg", "reshape", "add", "mul"]
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    b, c = np.full((2, 3), 10, np.float32), np.full(6, 2, np.float32)
    out, profile = model.run({"a": a, "b": b, "c": c}, profile=True)
    assert profile.inplace["Add"] == 0
    assert profile.inplace["Mul"] == 1
    np.testing.assert_array_equal(out["z"], -a + b)
    np.testing.assert_array_equal(out["w"], (-a).reshape(-1) * c)


def test_only_the_nodes_needed_for_the_requested_outputs_run():
    model = runnx.load(_shape_and_add())
    assert [n.name for n in model.plan(["s"])] == ["neg", "shape"]
    out, profile = model.run({"a": np.ones(3, np.float32), "b": np.ones(3, np.float32)}, ["s"], profile=True)
    assert list(out) == ["s"] and dict(profile.op_calls) == {"Neg": 1, "Shape": 1}
    # b is not needed for s: it may be left out entirely
    assert list(model.run({"a": np.ones(3, np.float32)}, ["s"])) == ["s"]


def test_plans_are_cached_per_inputs_and_outputs():
    model = runnx.load(_shape_and_add())
    feeds = {"a": np.ones(2, np.float32), "b": np.ones(2, np.float32)}
    model.run(feeds)
    model.run(feeds)
    assert len(model._plans) == 1
    model.run(feeds, ["s"])
    model.run({"a": feeds["a"]}, ["s"])
    assert len(model._plans) == 3
    assert model.plan(["s"]) == model.plan(["s"], inputs=["a", "b"])
    assert len(model._plans) == 3  # plan() reuses the cached (inputs, outputs) plan


def test_missing_input_error_names_the_value_and_the_node():
    model = runnx.load(_shape_and_add())
    with pytest.raises(runnx.MissingInputError, match=r"'b'.*Add node 'add'"):
        model.run({"a": np.ones(2, np.float32)})


def test_a_cycle_is_reported_naming_a_node_on_it():
    # Nodes out of topological order are allowed; a real cycle is not.
    model = runnx.load(_model([
        helper.make_node("Add", ["x", "q"], ["p"], name="first"),
        helper.make_node("Neg", ["p"], ["q"], name="second"),
    ], ["x"], ["p"]))
    with pytest.raises(runnx.CycleError, match=r"node '(first|second)'"):
        model.run({"x": np.ones(2, np.float32)})


def test_nodes_out_of_topological_order_are_planned():
    model = runnx.load(_model([
        helper.make_node("Add", ["y", "x"], ["z"], name="late"),
        helper.make_node("Neg", ["x"], ["y"], name="early"),
    ], ["x"], ["z"]))
    assert [n.name for n in model.plan()] == ["early", "late"]
    np.testing.assert_array_equal(model.run({"x": np.ones(2, np.float32)})["z"], [0, 0])


def test_a_shape_read_after_the_in_place_consumer_does_not_hold_it_back():
    """x is read for its shape by a memo node that also needs z's shape, so it runs after the Add
    consuming x: reading only shapes, it must not keep x's data alive (Add still runs in place)."""
    two = helper.make_tensor("two", TensorProto.INT64, [], [2])
    model = runnx.load(_model([
        helper.make_node("Neg", ["a"], ["x"], name="neg"),
        helper.make_node("Add", ["x", "b"], ["z"], name="add"),
        helper.make_node("Shape", ["x"], ["sx"], name="shape_x"),
        helper.make_node("Shape", ["z"], ["sz"], name="shape_z"),
        helper.make_node("Add", ["sx", "sz"], ["sum"], name="sum"),
        helper.make_node("Mul", ["sum", "two"], ["s"], name="scaled"),
    ], ["a", "b"], ["z", "s"], [two]))
    # Add and Mul of the shapes: one memo node reading x and z for their shapes (and each Shape, a
    # lone node that memo reads, a memo of its own)
    assert model.memoized == 4
    order = [n.name for n in model.plan()]
    assert order.index("ShapeMemo(sum, 2 nodes)") > order.index("add")  # the memo reads z, made by the Add
    a, b = np.arange(6, dtype=np.float32).reshape(2, 3), np.ones((2, 3), np.float32)
    out, profile = model.run({"a": a, "b": b}, profile=True)
    assert profile.inplace["Add"] == 1
    np.testing.assert_array_equal(out["z"], 1 - a)
    np.testing.assert_array_equal(out["s"], [8, 12])


def test_the_data_reads_of_each_node_are_those_reads_shape_only_does_not_exclude(fixtures_dir):
    """The planner finds which values a node reads for their data in one pass over its inputs:
    the same answer `Node.reads_shape_only` gives one value at a time, on a loaded decoder (shape
    memos read many values for their shapes only)."""
    from runnx.interp.planner import _data_reads, _reads

    model = runnx.load(fixtures_dir / "tiny-llama/model.onnx")
    checked = 0
    for node in model.graph.nodes:
        shape_only = getattr(node.kernel, "shape_only", ())
        if not shape_only:
            continue
        expected = {vid for vid in _reads(node) if not node.reads_shape_only(vid)}
        assert _data_reads(node, shape_only) == expected, node.describe()
        checked += any(node.reads_shape_only(vid) for vid in _reads(node))
    assert checked  # some node read a value for its shape only
