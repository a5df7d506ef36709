"""A product cut into pieces by Slices or a Split of its last axis becomes one product per piece
(split_products.py), bitwise equal to the whole product's columns for one row and close for many; a
product read any other way, cut into overlapping or strided pieces, or by a computed weight, stays."""
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import runnx
from runnx.interp import model_file
from runnx.interp.fusion.split_products import split_products

F, I64 = TensorProto.FLOAT, TensorProto.INT64
K, N = 16, 24


def _model(nodes, inputs, outputs, constants, opset=18, shapes=None):
    shapes = shapes or {}
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info(n, t, shapes.get(n)) for n, t in inputs],
        [helper.make_tensor_value_info(n, F, None) for n in outputs],
        [numpy_helper.from_array(np.asarray(v), k) for k, v in constants.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)


def _weights(seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((K, N)).astype(np.float32), rng.standard_normal(N).astype(np.float32)


def _sliced(bounds, axis=-1, step=1, bias=False, extra_reader=False, weight_input=False):
    """MatMul(x, W) [+ b] cut by one Slice per (start, end) of `bounds`, each piece then doubled."""
    w, b = _weights()
    constants = {} if weight_input else {"W": w}
    nodes = [helper.make_node("MatMul", ["x", "W"], ["p"])]
    value = "p"
    if bias:
        constants["b"] = b
        nodes.append(helper.make_node("Add", ["p", "b"], ["pb"]))
        value = "pb"
    outputs = []
    for i, (start, end) in enumerate(bounds):
        constants.update({f"s{i}": np.array([start]), f"e{i}": np.array([end]), f"a{i}": np.array([axis]),
                          f"t{i}": np.array([step])})
        nodes += [helper.make_node("Slice", [value, f"s{i}", f"e{i}", f"a{i}", f"t{i}"], [f"c{i}"]),
                  helper.make_node("Add", [f"c{i}", f"c{i}"], [f"y{i}"])]
        outputs.append(f"y{i}")
    if extra_reader:
        nodes.append(helper.make_node("Neg", [value], ["other"]))
        outputs.append("other")
    inputs = [("x", F)] + ([("W", F)] if weight_input else [])
    return _model(nodes, inputs, outputs, constants, shapes={"x": [1, "s", K]})


def _gate_up():
    """Optimum's gate/up cut: Slice bounds computed from the product's own shape (Shape, Gather(-1),
    (n + 1) / 2, then that times 1 and times 2), the halves read by SiLU(gate) * up."""
    w, _ = _weights()
    nodes = [helper.make_node("MatMul", ["x", "W"], ["p"]),
             helper.make_node("Shape", ["p"], ["shape"]),
             helper.make_node("Gather", ["shape", "last"], ["n"], axis=0),
             helper.make_node("Add", ["n", "one"], ["n1"]),
             helper.make_node("Div", ["n1", "two"], ["half"]),
             helper.make_node("Mul", ["half", "one"], ["mid"]),
             helper.make_node("Mul", ["half", "two"], ["end"]),
             helper.make_node("Slice", ["p", "zero", "mid", "last"], ["gate"]),
             helper.make_node("Slice", ["p", "mid", "end", "last"], ["up"]),
             helper.make_node("Sigmoid", ["gate"], ["sig"]),
             helper.make_node("Mul", ["gate", "sig"], ["silu"]),
             helper.make_node("Mul", ["up", "silu"], ["y"])]
    return _model(nodes, [("x", F)], ["y"], {"W": w, "last": np.array([-1]), "one": np.array([1]),
                                              "two": np.array([2]), "zero": np.array([0])},
                  shapes={"x": [1, "s", K]})


def _split(sizes=(8, 8, 8), axis=-1):
    w, _ = _weights()
    nodes = [helper.make_node("MatMul", ["x", "W"], ["p"]),
             helper.make_node("Split", ["p", "sizes"], ["q", "k", "v"], axis=axis),
             helper.make_node("Concat", ["v", "k", "q"], ["y"], axis=-1)]
    return _model(nodes, [("x", F)], ["y"], {"W": w, "sizes": np.array(sizes)}, shapes={"x": [1, "s", K]})


def _x(rows, seed=1):
    return np.random.default_rng(seed).standard_normal((1, rows, K)).astype(np.float32)


def _compare(model, feeds, bitwise):
    plain = runnx.load(model, optimization_level="disabled").run(feeds)
    fused = runnx.load(model, optimization_level="all").run(feeds)
    assert plain.keys() == fused.keys()
    for name in plain:
        if bitwise:
            np.testing.assert_array_equal(fused[name], plain[name], err_msg=name)
        else:
            np.testing.assert_allclose(fused[name], plain[name], rtol=1e-5, atol=1e-5, err_msg=name)


def _products(model):
    """The loaded model and the widths of the [K, n] weights its nodes read (plain or fused products)."""
    loaded = runnx.load(model, optimization_level="all")
    constants = loaded.graph.constants
    return loaded, sorted(constants[v].shape[1] for n in loaded.graph.nodes for v in n.inputs
                          if v in constants and constants[v].ndim == 2 and constants[v].shape[0] == K)


@pytest.mark.parametrize("bias", [False, True])
def test_slices_become_one_product_each(bias):
    model = _sliced([(0, 8), (8, 16), (16, 2 ** 63 - 1)], bias=bias)
    loaded, widths = _products(model)
    assert loaded.rewritten == {"split_products": 1}
    assert widths == [8, 8, 8]
    assert not any(n.op_type == "Slice" for n in loaded.graph.nodes)
    assert sum(n.op_type == "Add" for n in loaded.graph.nodes) == 3 + (3 if bias else 0)
    _compare(model, {"x": _x(1)}, bitwise=True)
    _compare(model, {"x": _x(7)}, bitwise=False)


def test_columns_no_slice_reads_are_dropped_and_negative_bounds_count_from_the_end():
    model = _sliced([(-8, 2 ** 63 - 1), (2, 6)])
    loaded, widths = _products(model)
    assert widths == [4, 8]
    _compare(model, {"x": _x(1)}, bitwise=True)


def test_a_positive_axis_is_the_last_when_the_rank_is_known():
    model = _sliced([(0, 12), (12, 24)], axis=2)
    assert _products(model)[1] == [12, 12]
    _compare(model, {"x": _x(1)}, bitwise=True)


def test_bounds_computed_from_the_products_shape_are_evaluated():
    loaded, widths = _products(_gate_up())
    assert widths == [12, 12]
    assert not any(n.op_type in ("Shape", "Slice", "Gather") for n in loaded.graph.nodes)
    _compare(_gate_up(), {"x": _x(1)}, bitwise=True)
    _compare(_gate_up(), {"x": _x(5)}, bitwise=False)


def test_the_halves_then_fuse_as_separate_gate_and_up_products():
    fused = runnx.load(_gate_up(), optimization_level="all")
    assert "SharedInputMatMul" in fused.fused and "SiluMul" in fused.fused
    assert [n.op_type for n in fused.plan()] == ["SharedInputMatMul"]


def test_a_split_of_the_last_axis_becomes_one_product_per_output():
    loaded, widths = _products(_split((4, 8, 12)))
    assert widths == [4, 8, 12] and not any(n.op_type == "Split" for n in loaded.graph.nodes)
    _compare(_split((4, 8, 12)), {"x": _x(1)}, bitwise=True)
    _compare(_split((4, 8, 12)), {"x": _x(6)}, bitwise=False)


@pytest.mark.parametrize("model", [
    _sliced([(0, 8), (8, 16)], extra_reader=True),  # another node reads the whole product
    _sliced([(0, 12), (8, 16)]),  # overlapping columns
    _sliced([(0, 8), (8, 16)], step=2),  # strided
    _sliced([(0, 8), (8, 16)], axis=1),  # not the columns
    _sliced([(0, 8), (8, 16)], weight_input=True),  # a computed weight
    _split(axis=1),  # rows (x has 24 of them here)
], ids=["read-elsewhere", "overlap", "step", "axis", "weight-input", "split-axis"])
def test_products_read_otherwise_stay_whole(model):
    loaded = runnx.load(model, optimization_level="all")
    assert not loaded.rewritten
    feeds = {"x": _x(24 if model.graph.node[1].op_type == "Split" else 1)}
    if "W" in [i.name for i in model.graph.input]:
        feeds["W"] = _weights()[0]
    _compare(model, feeds, bitwise=True)


def test_levels_without_fusion_keep_the_product():
    assert not runnx.load(_sliced([(0, 8), (8, 24)]), optimization_level="basic").rewritten


def _rotated_prefix(width):
    """Neg over x[..., :r] and x[..., r:] passed through, r read from another input's shape (as an
    export rotates the first r columns of each head, r the cos table's width)."""
    nodes = [helper.make_node("Shape", ["cos"], ["shape"]),
             helper.make_node("Gather", ["shape", "minus_one"], ["r0"], axis=0),
             helper.make_node("Unsqueeze", ["r0", "zero"], ["r"]),
             helper.make_node("Slice", ["x", "zero", "r", "last"], ["rotated"]),
             helper.make_node("Slice", ["x", "r", "end", "last"], ["passed"]),
             helper.make_node("Neg", ["rotated"], ["negated"]),
             helper.make_node("Concat", ["negated", "passed"], ["y"], axis=-1)]
    return _model(nodes, [("x", F), ("cos", F)], ["y"], {"last": np.array([-1]), "zero": np.array([0]),
                                                         "minus_one": np.array(-1),
                                                         "end": np.array([2 ** 63 - 1])},
                  shapes={"x": [1, 2, "s", 8], "cos": [1, 1, "s", width]})


def test_a_whole_slice_and_an_empty_concat_input_go():
    model = _rotated_prefix(8)
    loaded = runnx.load(model, optimization_level="all")
    assert loaded.rewritten == {"drop_identity_cuts": 2}  # the whole Slice, the Concat (an output: kept, one input)
    assert [n.op_type for n in loaded.plan()] == ["Neg", "Concat"]
    assert len(loaded.plan()[1].inputs) == 1
    feeds = {"x": np.random.default_rng(2).standard_normal((1, 2, 3, 8)).astype(np.float32),
             "cos": np.zeros((1, 1, 3, 8), np.float32)}
    _compare(model, feeds, bitwise=True)


@pytest.mark.parametrize("width", [4, "d"])
def test_cuts_of_part_of_an_axis_or_of_an_unknown_width_stay(width):
    model = _rotated_prefix(width)
    loaded = runnx.load(model, optimization_level="all")
    assert not loaded.rewritten
    assert sum(n.op_type == "Slice" for n in loaded.graph.nodes) == 2
    feeds = {"x": np.random.default_rng(2).standard_normal((1, 2, 3, 8)).astype(np.float32),
             "cos": np.zeros((1, 1, 3, 4), np.float32)}
    _compare(model, feeds, bitwise=True)


@pytest.mark.parametrize("malformed", ["no-outputs", "short-slice", "long-slice"])
def test_malformed_nodes_reach_the_checks_that_name_them(malformed):
    """The rewrites run before any kernel checks its node: a node with no outputs, or a Slice with
    too few or too many inputs, is left as it is (the load or run then raises a runnx error), never
    an IndexError of the rewrite."""
    w, _ = _weights()
    node = {"no-outputs": helper.make_node("Sub", ["x", "x"], []),
            "short-slice": helper.make_node("Slice", ["p"], ["bad"]),
            "long-slice": helper.make_node("Slice", ["p", "s", "e", "a", "t", "s"], ["bad"])}[malformed]
    constants = {"W": w, "s": np.array([0]), "e": np.array([4]), "a": np.array([-1]), "t": np.array([1])}
    model = _model([helper.make_node("MatMul", ["x", "W"], ["p"]), node,
                    helper.make_node("Slice", ["p", "s", "e", "a"], ["y"])],
                   [("x", F)], ["y"], constants, shapes={"x": [1, 1, K]})
    x = np.ones((1, 1, K), np.float32)
    try:
        runnx.load(model.SerializeToString()).run({"x": x})
    except runnx.RunnxError:
        pass  # named by the loader or the kernel: what a malformed node should get


def _saved(tmp_path, model) -> str:
    """`model` as a file: its weights are then read into runnx's own memory (`model_file.py`)."""
    path = tmp_path / "model.onnx"
    onnx.save(model, str(path))
    return str(path)


def _blocks(loaded):
    """The column blocks the rewrite made of W, in column order."""
    constants, moved = loaded.graph.constants, loaded.graph.moved
    return [constants[block] for block, _, _ in next(iter(moved.values()))] if moved else []


@pytest.mark.parametrize("model", [_sliced([(16, 24), (0, 8), (8, 16)]), _sliced([(0, 8), (8, 24)], bias=True),
                                   _split((8, 8, 8)), _gate_up()], ids=["slices", "bias", "split", "gate-up"])
def test_blocks_cut_from_a_weight_read_from_a_file_are_laid_in_its_own_memory(tmp_path, model):
    path = _saved(tmp_path, model)
    loaded = runnx.load(path, optimization_level="all")
    blocks = _blocks(loaded)
    weight, _ = _weights()
    assert len(loaded.graph.moved) == 1 and len(blocks) >= 2
    assert loaded.graph.names.index("W") not in loaded.graph.constants  # (no longer a constant)
    for before, block in zip(blocks, blocks[1:]):  # one after the other, where W's bytes were
        assert block.ctypes.data == before.ctypes.data + before.nbytes
    assert model_file.owned_bytes(blocks[0]) is not None and not blocks[0].flags.writeable
    np.testing.assert_array_equal(np.concatenate(blocks, axis=1), weight)
    plain = runnx.load(model, optimization_level="disabled")
    for rows in (1, 5):
        feeds = {"x": _x(rows)}
        want, got = plain.run(feeds), loaded.run(feeds)
        for name in want:
            np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-5, err_msg=name)
    # a value the rewrite removed is computed by the unrewritten graph, from W rebuilt of its blocks
    np.testing.assert_array_equal(loaded.run({"x": _x(1)}, ["p"])["p"], plain.run({"x": _x(1)}, ["p"])["p"])


@pytest.mark.parametrize("case", ["proto", "second-reader"])
def test_blocks_are_copies_when_the_weights_memory_is_not_runnxs_alone(tmp_path, case):
    """Bytes a caller handed over (a ModelProto's) or a weight another node reads too: the blocks
    are new arrays and W stays."""
    model = _sliced([(0, 8), (8, 24)])
    if case == "second-reader":
        model.graph.node.append(helper.make_node("MatMul", ["x", "W"], ["whole"]))
        model.graph.output.append(helper.make_tensor_value_info("whole", F, None))
    loaded = runnx.load(model if case == "proto" else _saved(tmp_path, model), optimization_level="all")
    assert loaded.rewritten == {"split_products": 1} and not loaded.graph.moved
    weight = loaded.graph.constants[loaded.graph.names.index("W")]
    np.testing.assert_array_equal(weight, _weights()[0])
    feeds = {"x": _x(1)}
    want = runnx.load(model, optimization_level="disabled").run(feeds)
    for name, value in loaded.run(feeds).items():
        np.testing.assert_array_equal(value, want[name], err_msg=name)


def test_a_weight_whose_bytes_another_constant_shares_stays_where_it_is(tmp_path):
    """A constant viewing W's bytes (as a Reshape of it could): W's blocks are copies, the view intact."""
    loaded = runnx.load(_saved(tmp_path, _sliced([(0, 8), (8, 24)])), optimization_level="basic")  # (unrewritten)
    graph = loaded.graph
    weight = graph.constants[graph.ids["W"]]
    view = graph.constants[graph.new_value("view")] = weight.reshape(-1)
    assert model_file.owned_bytes(weight) is not None
    assert split_products(graph) == 1 and not graph.moved
    np.testing.assert_array_equal(view, _weights()[0].reshape(-1))
