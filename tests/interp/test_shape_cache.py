"""Shape-computation caching: shape-derived nodes run once per shapes seen, results equal the
uncached run, nothing that reads a tensor's contents is ever cached."""
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import runnx
from runnx.interp import shape_cache

F, I64 = TensorProto.FLOAT, TensorProto.INT64


def _const(name, values):
    return numpy_helper.from_array(np.array(values, dtype=np.int64), name)


def _flatten_model():
    """out = Reshape(x, [dim0 * dim1, -1]) + Reshape(y, concat(dims of x)), shape = Shape(x)."""
    nodes = [
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("Gather", ["shape", "zero"], ["d0"], axis=0),
        helper.make_node("Gather", ["shape", "one"], ["d1"], axis=0),
        helper.make_node("Mul", ["d0", "d1"], ["rows"]),
        helper.make_node("Unsqueeze", ["rows", "axes"], ["rows1"]),
        helper.make_node("Concat", ["rows1", "minus_one"], ["target"], axis=0),
        helper.make_node("Reshape", ["x", "target"], ["flat"]),
        helper.make_node("Reshape", ["y", "target"], ["flat_y"]),
        helper.make_node("Add", ["flat", "flat_y"], ["out"]),
    ]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", F, None), helper.make_tensor_value_info("y", F, None)],
        [helper.make_tensor_value_info("out", F, None), helper.make_tensor_value_info("shape", I64, None)],
        [_const("zero", 0), _const("one", 1), _const("axes", [0]), _const("minus_one", [-1])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def test_shape_nodes_run_once_per_shape_and_results_match():
    cached, plain = runnx.load(_flatten_model()), runnx.load(_flatten_model(), shape_cache=False)
    assert cached.memoized == 6 and plain.memoized == 0
    assert len(cached.plan()) == 4 and len(plain.plan()) == 9
    profile = runnx.Profile()
    for shape in [(2, 3, 4), (2, 3, 4), (5, 1, 2), (2, 3, 4)]:
        x = np.random.rand(*shape).astype(np.float32)
        y = np.random.rand(*shape).astype(np.float32)
        got = cached.run({"x": x, "y": y}, profile=profile)
        want = plain.run({"x": x, "y": y})
        np.testing.assert_array_equal(got["out"], want["out"])
        np.testing.assert_array_equal(got["shape"], shape)
        got["shape"][0] = 99  # the caller gets its own copy of a kept result
    assert profile.counters["ShapeMemo.misses"] == 2 and profile.counters["ShapeMemo.hits"] == 2


def test_a_memo_programs_kernels_take_their_attributes_as_defaults():
    """A memo's members run through copies of their kernels whose defaults are their attributes
    (`registry.with_attributes`, as compiled plans call theirs): the Gathers' and the Concat's axis."""
    model = runnx.load(_flatten_model())
    x = np.ones((2, 3, 4), np.float32)
    model.run({"x": x, "y": x})
    (group,) = [node.kernel.fn for node in model.graph.nodes if isinstance(node.kernel.fn, shape_cache.ShapeGroup)]
    namespace = group._program.__globals__
    kernels = [namespace[f"f{i}"] for i in range(len(group.members))]
    with_axis = [(kernel, node) for kernel, node in zip(kernels, group.members)
                 if (kernel.__kwdefaults__ or {}).get("axis") == 0]
    assert sorted(node.op_type for _, node in with_axis) == ["Concat", "Gather", "Gather"]
    assert all(kernel is not node.kernel.fn for kernel, node in with_axis)
    assert not any(key.startswith("k") and key[1:].isdigit() for key in namespace)  # no **k attribute dicts


def test_values_read_from_tensor_contents_are_never_cached():
    """The reshape target comes from an input's values: same shapes, other values, other result."""
    nodes = [helper.make_node("Add", ["dims", "zero"], ["target"]),
             helper.make_node("Shape", ["target"], ["rank"]),
             helper.make_node("Concat", ["rank", "target"], ["both"], axis=0),
             helper.make_node("Reshape", ["x", "target"], ["out"])]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", F, None), helper.make_tensor_value_info("dims", I64, [2])],
        [helper.make_tensor_value_info("out", F, None), helper.make_tensor_value_info("both", I64, None)],
        [_const("zero", [0, 0])])
    model = runnx.load(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10))
    x = np.arange(12, dtype=np.float32)
    for dims in ([3, 4], [4, 3], [2, 6]):
        result = model.run({"x": x, "dims": np.array(dims)})
        assert result["out"].shape == tuple(dims)
        np.testing.assert_array_equal(result["both"], [2] + dims)


def test_groups_with_equal_structure_share_results():
    """Two copies of the same bookkeeping on equally shaped tensors: the second one hits."""
    model = runnx.load(_two_layers())
    x = np.random.rand(2, 3, 4).astype(np.float32)
    _, profile = model.run({"x": x}, profile=True)
    assert profile.counters["ShapeMemo.misses"] == 1 and profile.counters["ShapeMemo.hits"] == 1


def _two_layers():
    nodes = []
    for layer, (source, result) in enumerate([("x", "h"), ("h", "out")]):
        nodes += [helper.make_node("Shape", [source], [f"s{layer}"]),
                  helper.make_node("Gather", [f"s{layer}", "zero"], [f"d{layer}"], axis=0),
                  helper.make_node("Unsqueeze", [f"d{layer}", "axes"], [f"u{layer}"]),
                  helper.make_node("Concat", [f"u{layer}", "minus_one"], [f"t{layer}"], axis=0),
                  helper.make_node("Reshape", [source, f"t{layer}"], [f"r{layer}"]),
                  helper.make_node("Reshape", [f"r{layer}", f"s{layer}"], [f"b{layer}"]),
                  helper.make_node("Neg", [f"b{layer}"], [result])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, None)],
                              [helper.make_tensor_value_info("out", F, None)],
                              [_const("zero", 0), _const("axes", [0]), _const("minus_one", [-1])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def _two_head_shapes(second_width: int):
    """Each of two layers reads the shape of split heads a fused node would compute (a
    SplitHeadsShape stand-in, as fusion leaves it), its own projection weight read for its shape
    alone."""
    nodes, constants = [], [numpy_helper.from_array(np.array([1, 3, 2, -1], np.int64), "target")]
    for layer, width in enumerate((4, second_width)):
        nodes += [helper.make_node("SplitHeadsShape", [f"x{layer}", f"w{layer}", "target", ""], [f"n{layer}"],
                                   domain="runnx.fused"),
                  helper.make_node("Shape", [f"n{layer}"], [f"s{layer}"]),
                  helper.make_node("Gather", [f"s{layer}", "two"], [f"d{layer}"], axis=0)]
        constants.append(numpy_helper.from_array(np.linspace(layer, 2, 4 * width).astype(np.float32).reshape(4, width),
                                                 f"w{layer}"))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(f"x{i}", F, None) for i in range(2)],
                              [helper.make_tensor_value_info(f"d{i}", I64, None) for i in range(2)],
                              constants + [_const("two", 2)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("runnx.fused", 1)],
                             ir_version=10)


@pytest.mark.parametrize("second_width, misses", [(4, 1), (2, 2)])
def test_a_constant_read_only_for_its_shape_does_not_set_groups_apart(second_width, misses):
    """Layers whose shape stand-ins read their own weights (of one shape: their projections')
    compute the same bookkeeping: the second layer's memo finds the first one's
    result (a first prompt computes it once, not once a layer); weights of another shape do not."""
    model = runnx.load(_two_head_shapes(second_width))
    assert model.memoized == 6
    x = np.zeros((3, 4), np.float32)
    result, profile = model.run({"x0": x, "x1": x}, profile=True)
    assert profile.counters["ShapeMemo.misses"] == misses
    assert profile.counters.get("ShapeMemo.hits", 0) == 2 - misses
    assert int(result["d0"]) == int(result["d1"]) == 3


def test_a_value_inside_a_group_can_still_be_requested():
    model = runnx.load(_flatten_model())
    x = np.zeros((2, 3, 4), np.float32)
    result = model.run({"x": x, "y": x}, outputs=["rows1", "out"])
    np.testing.assert_array_equal(result["rows1"], [6])
    assert result["out"].shape == (6, 4)


def test_a_kept_result_never_aliases_a_value_that_is_later_overwritten():
    # kept = Identity(Reshape(a, [Size(y) / 2])) is a memo group whose result would be a view of
    # a = Shape(x), which Add (reading k's contents) also reads: the group keeps a copy instead (a
    # alone is a memo too, since another group reads it: its kept result read-only, Add writes a
    # new array)
    nodes = [
        helper.make_node("Shape", ["x"], ["a"]),
        helper.make_node("Size", ["y"], ["n"]),
        helper.make_node("Div", ["n", "two"], ["h"]),
        helper.make_node("Unsqueeze", ["h", "axes"], ["target"]),
        helper.make_node("Reshape", ["a", "target"], ["r"]),
        helper.make_node("Identity", ["r"], ["kept"]),
        helper.make_node("Add", ["a", "k"], ["bumped"]),
    ]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info(n, t, None) for n, t in (("x", F), ("y", F), ("k", I64))],
        [helper.make_tensor_value_info("kept", I64, None), helper.make_tensor_value_info("bumped", I64, None)],
        [_const("two", 2), _const("axes", [0])])
    model = runnx.load(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10))
    assert model.memoized == 6
    for shape in [(2, 3), (2, 3), (4, 5), (4, 5), (6, 7)]:  # interpreted, then compiled (new shapes: misses)
        got = model.run({"x": np.zeros(shape, np.float32), "y": np.zeros(4, np.float32), "k": np.array([1])})
        np.testing.assert_array_equal(got["kept"], shape)
        np.testing.assert_array_equal(got["bumped"], np.add(shape, 1))


def test_kept_results_are_bounded_by_count_and_bytes(monkeypatch):
    """Every shape seen is kept (a decode step's length comes back with the next generation),
    oldest dropped first once the count or the bytes reach their bounds."""
    monkeypatch.setattr(shape_cache, "KEPT_RESULTS", 3)
    model = runnx.load(_flatten_model(), memo_read_ahead=False)  # growing lengths: no keys but these
    results = next(n.kernel.fn.results for n in model.graph.nodes if n.op_type == "ShapeMemo")
    profile = runnx.Profile()
    lengths = [1, 2, 3, 1, 4, 5, 1]  # 1 hits while kept, is dropped as the oldest by 4, then missed
    for length in lengths:
        x = np.ones((2, length), np.float32)
        model.run({"x": x, "y": x}, profile=profile)
    assert [key[0][1] for key in results] == [4, 5, 1]
    assert profile.counters["ShapeMemo.hits"] == 1 and profile.counters["ShapeMemo.misses"] == 6
    assert results.nbytes == sum(v.nbytes for result in results.values() for v in result)
    monkeypatch.setattr(shape_cache, "KEPT_BYTES", results.nbytes)  # full: the next one drops the oldest
    model.run({"x": np.ones((2, 6), np.float32), "y": np.ones((2, 6), np.float32)})
    assert [key[0][1] for key in results] == [5, 1, 6] and results.nbytes <= shape_cache.KEPT_BYTES


def _grouped_attention_with_a_length():
    """Attention over k, v (1, 2, 5, 8) repeated to 4 heads, and length = Shape(repeated k)[2] + 1,
    a shape computation reading the repeated cache that fusion removes."""
    def repeated(name):
        return [helper.make_node("Unsqueeze", [name, "axis2"], [f"{name}5"]),
                helper.make_node("Expand", [f"{name}5", "expand"], [f"{name}x"]),
                helper.make_node("Reshape", [f"{name}x", "target"], [f"{name}r"])]
    nodes = repeated("k") + repeated("v") + [
        helper.make_node("Transpose", ["kr"], ["kt"], perm=[0, 1, 3, 2]),
        helper.make_node("Mul", ["kt", "scale"], ["ks"]), helper.make_node("Mul", ["q", "scale"], ["qs"]),
        helper.make_node("MatMul", ["qs", "ks"], ["scores"]), helper.make_node("Add", ["scores", "bias"], ["biased"]),
        helper.make_node("Softmax", ["biased"], ["p"], axis=-1), helper.make_node("IsNaN", ["p"], ["nan"]),
        helper.make_node("Where", ["nan", "zero", "p"], ["pz"]), helper.make_node("MatMul", ["pz", "vr"], ["y"]),
        helper.make_node("Shape", ["kr"], ["kshape"]), helper.make_node("Gather", ["kshape", "two"], ["kept"], axis=0),
        helper.make_node("Add", ["kept", "one"], ["length"])]
    constants = [_const("axis2", [2]), _const("expand", [1, 2, 2, 5, 8]), _const("target", [1, 4, 5, 8]),
                 _const("two", 2), _const("one", 1), numpy_helper.from_array(np.float32(0.5), "scale"),
                 numpy_helper.from_array(np.float32(0), "zero")]
    inputs = [helper.make_tensor_value_info(n, F, shape) for n, shape in
              (("q", [1, 4, 1, 8]), ("k", [1, 2, 5, 8]), ("v", [1, 2, 5, 8]), ("bias", [1, 1, 1, 5]))]
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("y", F, None),
                                                   helper.make_tensor_value_info("length", I64, None)], constants)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def test_fused_shape_stand_ins_join_the_memos_around_them():
    """After fusion the model memoizes again: the repeated cache's shape stand-in and the memo
    reading its shape become one memo node."""
    model = _grouped_attention_with_a_length()
    memoized, unmemoized = runnx.load(model), runnx.load(model, shape_cache=False)
    assert "RepeatedKVShape" in [n.op_type for n in unmemoized.plan()]
    assert "RepeatedKVShape" not in [n.op_type for n in memoized.plan()]
    assert "Expand" not in [n.op_type for n in memoized.plan()]
    rng = np.random.default_rng(3)
    feeds = {"q": rng.standard_normal((1, 4, 1, 8)).astype(np.float32),
             **{n: rng.standard_normal((1, 2, 5, 8)).astype(np.float32) for n in "kv"},
             "bias": np.zeros((1, 1, 1, 5), np.float32)}
    profile = runnx.Profile()
    for _ in range(2):
        got, want = memoized.run(feeds, profile=profile), unmemoized.run(feeds)
        for name in want:
            np.testing.assert_array_equal(got[name], want[name])
    assert got["length"] == 6 and profile.counters["ShapeMemo.hits"] > 0


def _dims_product_model():
    """s = (dim0(x) + dim0(y)) * dim0(x): a memo of roots {x, y} reading the memos of {x} and {y}."""
    nodes = [helper.make_node("Shape", ["x"], ["sx"]), helper.make_node("Gather", ["sx", "zero"], ["dx"], axis=0),
             helper.make_node("Shape", ["y"], ["sy"]), helper.make_node("Gather", ["sy", "zero"], ["dy"], axis=0),
             helper.make_node("Add", ["dx", "dy"], ["both"]), helper.make_node("Mul", ["both", "dx"], ["s"])]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", F, None), helper.make_tensor_value_info("y", F, None)],
        [helper.make_tensor_value_info("s", I64, None)], [_const("zero", 0)])
    return runnx.load(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10))


def test_a_memo_reading_another_memos_results_knows_them_by_identity(monkeypatch):
    """s = (dim0(x) + dim0(y)) * dim0(x) is a memo of roots {x, y} reading the memos of {x} and {y}
    (their kept, read-only results): when those are the same arrays as before, its result comes
    without hashing their bytes; other values still give other results."""
    model = _dims_product_model()
    groups = [n.kernel.fn for n in model.graph.nodes if isinstance(n.kernel.fn, shape_cache.ShapeGroup)]
    assert sorted(len(g.external) for g in groups) == [0, 0, 2]
    hashed = []
    value_key = shape_cache.value_key
    monkeypatch.setattr(shape_cache, "value_key", lambda v: hashed.append(v) or value_key(v))
    for rows, want_hashed in ((2, 2), (2, 0), (5, 2), (2, 0)):
        before = len(hashed)
        got = model.run({"x": np.zeros((rows, 1), np.float32), "y": np.zeros((3, 1), np.float32)})["s"]
        assert got == (rows + 3) * rows
        assert len(hashed) - before == want_hashed


def test_a_lone_shape_node_another_memo_reads_is_a_memo_too(monkeypatch):
    """s = (dim0(x) + size(y)) * dim0(x): Size(y) alone is the group of roots {y}, which the memo of
    {x, y} reads, so it becomes a memo of one node, its result kept read-only: a repeated run finds
    the reading memo's result by identity, without hashing a fresh array's bytes; Shape(z), a lone
    node that no other group reads, stays a plain node."""
    nodes = [helper.make_node("Size", ["y"], ["ny"]),
             helper.make_node("Shape", ["x"], ["sx"]), helper.make_node("Gather", ["sx", "zero"], ["dx"], axis=0),
             helper.make_node("Add", ["dx", "ny"], ["both"]), helper.make_node("Mul", ["both", "dx"], ["s"]),
             helper.make_node("Shape", ["z"], ["sz"])]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info(name, F, None) for name in ("x", "y", "z")],
        [helper.make_tensor_value_info("s", I64, None), helper.make_tensor_value_info("sz", I64, None)],
        [_const("zero", 0)])
    model = runnx.load(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10))
    groups = [n.kernel.fn for n in model.graph.nodes if isinstance(n.kernel.fn, shape_cache.ShapeGroup)]
    assert sorted(len(g.members) for g in groups) == [1, 2, 2]
    assert [g.members[0].op_type for g in groups if len(g.members) == 1] == ["Size"]
    assert [n.op_type for n in model.graph.nodes if not isinstance(n.kernel.fn, shape_cache.ShapeGroup)] == ["Shape"]
    hashed = []
    value_key = shape_cache.value_key
    monkeypatch.setattr(shape_cache, "value_key", lambda v: hashed.append(v) or value_key(v))
    for rows, want_hashed in ((2, 2), (2, 0), (5, 2), (5, 0)):
        before = len(hashed)
        feeds = {"x": np.zeros((rows, 1), np.float32), "y": np.zeros((3, 2), np.float32), "z": np.zeros(4, np.float32)}
        got = model.run(feeds)
        assert got["s"] == (rows + 6) * rows and list(got["sz"]) == [4]
        assert len(hashed) - before == want_hashed


def test_a_compiled_plan_finds_a_memos_kept_result_by_its_externals_identity_without_calling_it(monkeypatch):
    """Once the plan of `_dims_product_model` runs compiled, the memo reading the other two memos'
    results is called only when its roots' shapes or those results are new: a repeated step finds
    its result inline (every memo's), and the result is the same."""
    model = _dims_product_model()
    reading = [n.kernel.fn for n in model.graph.nodes
               if isinstance(n.kernel.fn, shape_cache.ShapeGroup) and n.kernel.fn.external]
    calls = []
    call = shape_cache.ShapeGroup.__call__
    monkeypatch.setattr(shape_cache.ShapeGroup, "__call__", lambda self, *a, ctx: calls.append(self) or call(
        self, *a, ctx=ctx))
    for rows, want_called in ((2, 1), (2, 0), (5, 1), (5, 0), (2, 0)):  # compiled from the second run
        before = len(calls)
        got = model.run({"x": np.zeros((rows, 1), np.float32), "y": np.zeros((3, 1), np.float32)})["s"]
        assert got == (rows + 3) * rows
        assert sum(group is reading[0] for group in calls[before:]) == want_called

def test_a_memos_sequence_holds_kept_arrays_that_no_step_overwrites():
    """seq = SequenceConstruct(Shape(x), Shape(x)) is a memo's output, uncounted in a compiled plan:
    its arrays are read-only, so Add, reading the one SequenceAt picks as its dying input, computes
    into a new array and the sequence keeps its values, run after run."""
    nodes = [helper.make_node("Shape", ["x"], ["s"]), helper.make_node("SequenceConstruct", ["s", "s"], ["seq"]),
             helper.make_node("SequenceAt", ["seq", "index"], ["picked"]),
             helper.make_node("Add", ["picked", "k"], ["bumped"])]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", F, None), helper.make_tensor_value_info("index", I64, []),
                     helper.make_tensor_value_info("k", I64, [1])],
        [helper.make_tensor_value_info("bumped", I64, None),
         helper.make_tensor_value_info("seq", TensorProto.UNDEFINED, None)])
    graph.output[1].type.sequence_type.elem_type.tensor_type.elem_type = I64
    model = runnx.load(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10))
    assert model.memoized == 2
    for shape in [(2, 3), (2, 3), (2, 3), (4, 5), (4, 5)]:  # interpreted, then compiled; hits and misses
        got = model.run({"x": np.zeros(shape, np.float32), "index": np.array(0), "k": np.array([10])})
        np.testing.assert_array_equal(got["bumped"], np.add(shape, 10))
        assert [list(v) for v in got["seq"]] == [list(shape)] * 2
        got["seq"][0][0] = -1  # the caller's own arrays


def _split_dims_model():
    """out = ConstantOfShape(Concat(last dim of x - 3, first dim of x)): a group with a two-output
    Split member whose first output is omitted, for the memo program's outputs and its errors."""
    nodes = [helper.make_node("Shape", ["x"], ["shape"]),
             helper.make_node("Split", ["shape", "halves"], ["", "rest"], axis=0),
             helper.make_node("Sub", ["rest", "three"], ["smaller"]),
             helper.make_node("Slice", ["shape", "zero1", "one1"], ["first"]),
             helper.make_node("Concat", ["smaller", "first"], ["dims"], axis=0),
             helper.make_node("ConstantOfShape", ["dims"], ["out"], name="make_zeros")]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", F, None)], [helper.make_tensor_value_info("out", F, None)],
        [_const("halves", [1, 1]), _const("three", [3]), _const("zero1", [0]), _const("one1", [1])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def test_a_memo_program_runs_multi_output_members_and_names_a_failing_member():
    cached, plain = runnx.load(_split_dims_model()), runnx.load(_split_dims_model(), shape_cache=False)
    assert cached.memoized == 6 and len(cached.plan()) == 1
    for shape in [(2, 7), (4, 5), (2, 7)]:
        x = np.zeros(shape, np.float32)
        got, want = cached.run({"x": x})["out"], plain.run({"x": x})["out"]
        assert got.shape == want.shape == (shape[1] - 3, shape[0])
    with pytest.raises(runnx.RunnxError, match=r"ConstantOfShape.*make_zeros.*negative dimension") as failed:
        cached.run({"x": np.zeros((2, 1), np.float32)})
    with pytest.raises(runnx.RunnxError) as unmemoized:
        plain.run({"x": np.zeros((2, 1), np.float32)})
    assert str(failed.value) == str(unmemoized.value)  # worded as the node's own failure: its inputs named
