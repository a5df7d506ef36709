"""A KV cache's repeated heads read by a MatMul (interp/fusion/repeated_kv_products.py): one
RepeatedKVMatMul reading the cache in place, bitwise the unfused nodes, for decode rows and prompts,
caches in capacity buffers or not, with runnx's own products or numpy's, and the nodes' own
computation for a repeat that is not a plain head repeat."""
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import runnx
from runnx.ops import _kernels_gemm, _matmul, linalg

F, I64 = TensorProto.FLOAT, TensorProto.INT64
DEPTH = 8


def _model(groups: int, repeat: int, length: int, *, axis: int = 2, shape_reader: bool = False):
    """softmax(q @ (Transpose(repeat(k)) * scale)) @ repeat(v): no query scale and no NaN fill, so
    the attention pattern leaves it to the products. k and v are declared (batch, groups, length,
    DEPTH): what proves the constant targets a head repeat."""
    def repeated(name):
        return [helper.make_node("Unsqueeze", [name, "axis"], [f"{name}5"]),
                helper.make_node("Expand", [f"{name}5", "expand"], [f"{name}x"]),
                helper.make_node("Reshape", [f"{name}x", "target"], [f"{name}r"])]
    nodes = repeated("k") + repeated("v") + [
        helper.make_node("Transpose", ["kr"], ["kt"], perm=[0, 1, 3, 2]),
        helper.make_node("Mul", ["scale", "kt"], ["ks"]),
        helper.make_node("MatMul", ["q", "ks"], ["scores"]),
        helper.make_node("Softmax", ["scores"], ["p"], axis=-1),
        helper.make_node("MatMul", ["p", "vr"], ["y"])]
    outputs = [helper.make_tensor_value_info("y", F, None)]
    if shape_reader:
        nodes.append(helper.make_node("Shape", ["kr"], ["kshape"]))
        outputs.append(helper.make_tensor_value_info("kshape", I64, None))
    expand = [1, groups, repeat, length, DEPTH] if axis == 2 else [1, repeat, groups, length, DEPTH]
    constants = {"axis": np.array([axis]), "scale": np.float32(DEPTH ** -0.5), "expand": np.array(expand),
                 "target": np.array([0, groups * repeat, length, DEPTH])}
    cache = ["batch", groups, length, DEPTH]
    inputs = [helper.make_tensor_value_info("q", F, None)] + [helper.make_tensor_value_info(n, F, cache) for n in "kv"]
    graph = helper.make_graph(nodes, "g", inputs, outputs,
                              [numpy_helper.from_array(np.asarray(v), k) for k, v in constants.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def _feeds(batch, groups, repeat, rows, length, in_buffer: bool, seed=0):
    rng = np.random.default_rng(seed)
    if in_buffer:  # prefix views of capacity buffers, as a decoder's KV cache hands them over
        key, value = (rng.standard_normal((batch, groups, length + 5, DEPTH)).astype(np.float32)[:, :, :length]
                      for _ in range(2))
    else:
        key, value = (rng.standard_normal((batch, groups, length, DEPTH)).astype(np.float32) for _ in range(2))
    return {"q": rng.standard_normal((batch, groups * repeat, rows, DEPTH)).astype(np.float32), "k": key, "v": value}


def _both(model, feeds):
    fused = runnx.load(model, shape_cache=False)
    plain = runnx.load(model, optimization_level="disabled")
    return fused.run(feeds), plain.run(feeds), [n.op_type for n in fused.plan()]


@pytest.mark.parametrize("in_buffer", [True, False])
@pytest.mark.parametrize("batch, groups, repeat, rows, length", [
    (1, 3, 3, 1, 40),  # a decode step: 3 rows a group, unpacked
    (1, 2, 4, 1, 17),
    (2, 2, 2, 1, 9),  # two sequences
    (1, 3, 3, 6, 40),  # a prompt: 18 rows a group, packed
    (1, 1, 5, 2, 300),  # one KV head, more than a block of columns
])
def test_repeated_heads_are_read_in_place_to_the_same_bits(batch, groups, repeat, rows, length, in_buffer):
    feeds = _feeds(batch, groups, repeat, rows, length, in_buffer)
    fused, plain, ops = _both(_model(groups, repeat, length), feeds)
    assert ops.count("RepeatedKVMatMul") == 2 and "Expand" not in ops and "MatMul" not in ops
    np.testing.assert_array_equal(fused["y"], plain["y"])


def test_readers_of_the_repeated_shape_get_a_stand_in():
    feeds = _feeds(1, 2, 3, 1, 11, True)
    fused, plain, ops = _both(_model(2, 3, 11, shape_reader=True), feeds)
    assert "RepeatedKVShape" in ops and "Expand" not in ops
    np.testing.assert_array_equal(fused["kshape"], [1, 6, 11, DEPTH])
    np.testing.assert_array_equal(fused["y"], plain["y"])


def test_heads_tiled_rather_than_repeated_stay_the_nodes():
    """Unsqueeze at axis 1 tiles the heads (0, 1, 0, 1, ...): not a head repeat, so nothing fuses."""
    feeds = _feeds(1, 2, 3, 1, 11, True)
    fused, plain, ops = _both(_model(2, 3, 11, axis=1), feeds)
    assert "RepeatedKVMatMul" not in ops and ops.count("Expand") == 2
    np.testing.assert_array_equal(fused["y"], plain["y"])


def test_a_repeat_of_a_cache_of_undeclared_shape_stays_the_nodes():
    """Constant targets over a cache whose shape the graph does not state could broadcast a cache of
    one head rather than repeat each: not proven, not fused, the same result."""
    model = _model(2, 3, 11)
    for value in model.graph.input:
        value.type.tensor_type.ClearField("shape")
    fused, plain, ops = _both(model, _feeds(1, 2, 3, 1, 11, True))
    assert "RepeatedKVMatMul" not in ops and ops.count("Expand") == 2
    np.testing.assert_array_equal(fused["y"], plain["y"])


def test_with_numpys_products_it_multiplies_as_the_nodes_do(monkeypatch):
    """Where runnx's own products do not run (another CPU, MKL), numpy's BLAS rounds by the shapes
    it is given: the kernel then gives it the nodes' shapes, the repeat made."""
    monkeypatch.setattr(_matmul, "_enabled", False)
    grouped = []
    original = linalg._grouped_product
    monkeypatch.setattr(linalg, "_grouped_product", lambda *a: grouped.append(a) or original(*a))
    feeds = _feeds(1, 3, 3, 1, 40, True)
    fused, plain, ops = _both(_model(3, 3, 40), feeds)
    assert ops.count("RepeatedKVMatMul") == 2 and not grouped
    np.testing.assert_array_equal(fused["y"], plain["y"])


def test_a_decode_step_multiplies_no_repeated_array(monkeypatch):
    """The grouped product reads the cache's own buffer: the values' heads go to the kernel as the
    capacity buffer itself, the keys' as their scaled copy of the cache's heads (not of the repeat).
    runnx's own products are made to run: numpy's OpenBLAS with its AVX-512 kernels would take them."""
    if not _kernels_gemm.AVAILABLE:
        pytest.skip("runnx's own float32 products need numba compiling for AVX-512 or AVX2 with FMA")
    monkeypatch.setattr(_matmul, "_enabled", True)
    seen = []
    original = _matmul.stacked_product
    monkeypatch.setattr(linalg, "stacked_product", lambda a, b, out, given: seen.append(b) or original(a, b, out, given))
    feeds = _feeds(1, 3, 3, 1, 40, True)
    fused, plain, _ = _both(_model(3, 3, 40), feeds)
    np.testing.assert_array_equal(fused["y"], plain["y"])
    keys, values = seen
    assert keys.shape == (3, 40, DEPTH) and values.shape == (3, 45, DEPTH)
    assert np.shares_memory(values, feeds["v"])
