"""What a graph states about shapes before anything runs (interp/fusion/static_dims.py): named
unknown dims (`Dim`) carried through the shape computations exporters write, so that a target
built from a value's own dims is seen to be those dims."""
import numpy as np
from onnx import TensorProto, helper, numpy_helper

import runnx
from runnx.interp.fusion.static_dims import Dim, StaticDims

F, I64 = TensorProto.FLOAT, TensorProto.INT64


def _static(nodes, inputs, constants, outputs):
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info(n, F, shape) for n, shape in inputs],
        [helper.make_tensor_value_info(n, F, None) for n in outputs],
        [numpy_helper.from_array(np.asarray(v), k) for k, v in constants.items()])
    model = runnx.load(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10),
                       optimization_level="disabled")
    ids = {name: vid for vid, name in enumerate(model.graph.names)}
    return StaticDims(model.graph), ids


def _dim(source: str, axis: int, name: str) -> list:
    """Unsqueeze(Gather(Shape(source), axis), 0) as exporters write one dim of a target."""
    return [helper.make_node("Shape", [source], [f"{name}_shape"]),
            helper.make_node("Gather", [f"{name}_shape", f"i{axis}"], [f"{name}_dim"], axis=0),
            helper.make_node("Unsqueeze", [f"{name}_dim", "zero"], [name])]


CONSTANTS = {"zero": np.array([0]), "two": np.array([2]), "minus_one": np.array([-1]), "one": np.array(1),
             **{f"i{axis}": np.array(axis) for axis in range(4)}}


def test_an_expand_target_from_the_caches_own_dims_repeats_its_heads():
    """repeat_kv as transformers exports it: Expand(Unsqueeze(kv, 2), where(t == -1, 1, t)) with
    t = (b, h, 2, n, d) from Shape(kv), then Reshape to (b, h * 2, n, d)."""
    nodes = [n for axis in range(4) for n in _dim("kv", axis, f"d{axis}")] + [
        helper.make_node("Concat", ["d0", "d1", "two", "d2", "d3"], ["t5"], axis=0),
        helper.make_node("Reshape", ["t5", "minus_one"], ["t"]),
        helper.make_node("Shape", ["t"], ["t_length"]),
        helper.make_node("ConstantOfShape", ["t_length"], ["ones"], value=numpy_helper.from_array(np.array([1]))),
        helper.make_node("Mul", ["ones", "minus_one"], ["minus_ones"]),
        helper.make_node("Equal", ["t", "minus_ones"], ["free"]),
        helper.make_node("Where", ["free", "ones", "t"], ["target"]),
        helper.make_node("Unsqueeze", ["kv", "two"], ["kv5"]),
        helper.make_node("Expand", ["kv5", "target"], ["expanded"]),
        helper.make_node("Mul", ["d1_dim", "two_scalar"], ["heads"]),
        helper.make_node("Unsqueeze", ["heads", "zero"], ["h"]),
        helper.make_node("Concat", ["d0", "h", "d2", "d3"], ["merged"], axis=0),
        helper.make_node("Reshape", ["expanded", "merged"], ["repeated"])]
    static, ids = _static(nodes, [("kv", ["batch", 3, "length", 8])], {**CONSTANTS, "two_scalar": np.array(2)},
                          ["repeated"])
    kv = static.dim_terms(ids["kv"])
    assert kv == (Dim(ids["kv"], 0), 3, Dim(ids["kv"], 2), 8)
    assert static.terms(ids["target"]).tolist() == [kv[0], 3, 2, kv[2], 8]
    assert static.dim_terms(ids["expanded"]) == (kv[0], 3, 2, kv[2], 8)
    assert static.dim_terms(ids["repeated"]) == (kv[0], 6, kv[2], 8)
    assert static.ints(ids["target"]).tolist() == [None, 3, 2, None, 8]  # (ints: unknowns stay None)


def test_a_minus_one_is_what_the_named_dims_leave_and_two_values_do_not_share_names():
    """Reshape(x, (b, n, -1, 4)) of x (b, n, 24): the -1 is 6 once b and n cancel; a dim of another
    input keeps its own name, so broadcasting the two is not known."""
    nodes = _dim("x", 0, "b") + _dim("x", 1, "n") + [
        helper.make_node("Concat", ["b", "n", "minus_one", "four"], ["target"], axis=0),
        helper.make_node("Reshape", ["x", "target"], ["heads"]),
        helper.make_node("Transpose", ["heads"], ["split"], perm=[0, 2, 1, 3]),
        helper.make_node("Add", ["x", "y"], ["sum"])]
    static, ids = _static(nodes, [("x", ["b", "n", 24]), ("y", ["b", "n", 24])], {**CONSTANTS, "four": np.array([4])},
                          ["split", "sum"])
    b, n = Dim(ids["x"], 0), Dim(ids["x"], 1)
    assert static.dim_terms(ids["heads"]) == (b, n, 6, 4)
    assert static.dim_terms(ids["split"]) == (b, 6, n, 4)
    assert static.dim_terms(ids["sum"]) == (Dim(ids["sum"], 0), Dim(ids["sum"], 1), 24)


def test_a_slice_of_a_shape_keeps_its_names():
    nodes = [helper.make_node("Shape", ["x"], ["shape"]),
             helper.make_node("Slice", ["shape", "zero", "two"], ["front"]),
             helper.make_node("Concat", ["front", "minus_one"], ["target"], axis=0),
             helper.make_node("Reshape", ["x", "target"], ["flat"])]
    static, ids = _static(nodes, [("x", ["b", 3, 4, 5])], CONSTANTS, ["flat"])
    assert static.terms(ids["front"]).tolist() == [Dim(ids["x"], 0), 3]
    assert static.dim_terms(ids["flat"]) == (Dim(ids["x"], 0), 3, 20)


def test_a_minus_one_may_be_the_one_named_dim_left():
    """Reshape(x, (1, -1, 6, 4)) of x (1, n, 24), as a fixed-batch export splits heads: -1 is n."""
    nodes = [helper.make_node("Reshape", ["x", "target"], ["heads"])]
    static, ids = _static(nodes, [("x", [1, "n", 24])], {"target": np.array([1, -1, 6, 4])}, ["heads"])
    assert static.dim_terms(ids["heads"]) == (1, Dim(ids["x"], 1), 6, 4)
