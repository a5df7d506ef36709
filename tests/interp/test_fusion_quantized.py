"""Fusion in a graph that quantizes the values it computes: only patterns whose kernels compute
bitwise what their nodes do are fused there. A dynamically quantized projection (as
onnxruntime.quantization.quantize_dynamic writes it: DynamicQuantizeLinear -> MatMulInteger ->
Cast -> Mul by the scales' product) after an attention rounds the attention's output to a grid
of its range / 255; a fused attention one unit in the last place apart moves a value a whole step
now and then, an error as large as the quantization's own."""
import numpy as np
import onnxruntime
import pytest
from onnx import TensorProto, helper, numpy_helper

import runnx
import runnx.interp.fusion as fusion

F, I64, U8, I8 = TensorProto.FLOAT, TensorProto.INT64, TensorProto.UINT8, TensorProto.INT8
HEADS, GROUPS, LENGTH, DEPTH, COLUMNS = 8, 2, 6, 64, 32
FLIPPING_SEED = 190  # inputs on which the fused attention's rounding moved a quantized value a step (searched)


def _node(op, inputs, outputs, **attrs):
    return helper.make_node(op, inputs, outputs, name=outputs[0], **attrs)


def attention_then_quantized_projection() -> "onnx.ModelProto":
    """Llama's eager attention over a grouped KV cache (the RepeatedKVAttention pattern: scaled
    query and transposed repeated key, additive bias, Softmax, Where(IsNaN), repeated value), heads
    merged, then a dynamically quantized product by an int8 weight with a zero point; outputs the
    product and the quantizer's three outputs."""
    rng = np.random.default_rng(0)
    repeat = HEADS // GROUPS

    def repeated(cache, name):
        return [_node("Unsqueeze", [cache, "two"], [f"{name}_u"]),
                _node("Expand", [f"{name}_u", "expand"], [f"{name}_e"]),
                _node("Reshape", [f"{name}_e", "repeated"], [f"{name}_r"])]

    nodes = [*repeated("key", "k"), *repeated("value", "v"),
             _node("Transpose", ["k_r"], ["k_t"], perm=[0, 1, 3, 2]),
             _node("Mul", ["query", "scale"], ["q_s"]), _node("Mul", ["k_t", "scale"], ["k_s"]),
             _node("MatMul", ["q_s", "k_s"], ["scores"]), _node("Add", ["scores", "bias"], ["biased"]),
             _node("Softmax", ["biased"], ["p"], axis=-1), _node("IsNaN", ["p"], ["nan"]),
             _node("Where", ["nan", "zero", "p"], ["filled"]), _node("MatMul", ["filled", "v_r"], ["heads"]),
             _node("Transpose", ["heads"], ["heads_t"], perm=[0, 2, 1, 3]),
             _node("Reshape", ["heads_t", "merged"], ["attended"]),
             helper.make_node("DynamicQuantizeLinear", ["attended"], ["x_q", "x_scale", "x_zero"], name="quantize"),
             _node("MatMulInteger", ["x_q", "w_q", "x_zero", "w_zero"], ["product"]),
             _node("Cast", ["product"], ["product_f"], to=F),
             _node("Mul", ["x_scale", "w_scale"], ["scales"]),
             _node("Mul", ["product_f", "scales"], ["y"])]
    constants = {
        "two": np.array([2]), "expand": np.array([1, GROUPS, repeat, 1, 1]),
        "repeated": np.array([1, HEADS, -1, DEPTH]), "scale": np.float32(DEPTH ** -0.25), "zero": np.float32(0),
        "merged": np.array([1, -1, HEADS * DEPTH]),
        "w_q": rng.integers(-64, 64, (HEADS * DEPTH, COLUMNS)).astype(np.int8),  # reduce_range's 7 bits
        "w_zero": np.int8(3), "w_scale": np.float32(0.0123)}
    graph = helper.make_graph(
        nodes, "attention_quantized",
        [helper.make_tensor_value_info("query", F, [1, HEADS, LENGTH, DEPTH]),
         helper.make_tensor_value_info("key", F, [1, GROUPS, LENGTH, DEPTH]),
         helper.make_tensor_value_info("value", F, [1, GROUPS, LENGTH, DEPTH]),
         helper.make_tensor_value_info("bias", F, [1, 1, LENGTH, LENGTH])],
        [helper.make_tensor_value_info("y", F, None), helper.make_tensor_value_info("x_q", U8, None),
         helper.make_tensor_value_info("x_scale", F, None), helper.make_tensor_value_info("x_zero", U8, None)],
        [numpy_helper.from_array(np.asarray(v), k) for k, v in constants.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def feeds(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    causal = np.triu(np.full((LENGTH, LENGTH), -np.inf, np.float32), 1)
    return {"query": rng.standard_normal((1, HEADS, LENGTH, DEPTH)).astype(np.float32),
            "key": rng.standard_normal((1, GROUPS, LENGTH, DEPTH)).astype(np.float32),
            "value": rng.standard_normal((1, GROUPS, LENGTH, DEPTH)).astype(np.float32),
            "bias": causal.reshape(1, 1, LENGTH, LENGTH)}


def _outputs_of_onnxruntime(model, inputs) -> dict:
    session = onnxruntime.InferenceSession(model.SerializeToString())
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, inputs)))


def test_a_quantized_projection_after_attention_gives_onnxruntimes_result():
    """The seed where the fused attention (before: fused here too) moved one quantized value a step:
    y was one step (0.0156) off onnxruntime's and plain interpretation's."""
    model = attention_then_quantized_projection()
    inputs = feeds(FLIPPING_SEED)
    theirs = _outputs_of_onnxruntime(model, inputs)
    optimized = runnx.load(model)  # optimization_level "all"
    for _ in range(3):  # interpreted, then compiled
        ours = optimized.run(inputs)
        for name in ("x_q", "x_scale", "x_zero"):
            np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)
        np.testing.assert_allclose(ours["y"], theirs["y"], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("seed", [0, 1, FLIPPING_SEED])
def test_a_quantized_projection_after_attention_is_bitwise_plain_interpretation(seed):
    """Every output (the float product too) bitwise as optimization_level "disabled" computes it;
    before, the fused attention's own rounding moved even the quantizer's scale (seeds 0, 1)."""
    model = attention_then_quantized_projection()
    plain, optimized = runnx.load(model, optimization_level="disabled"), runnx.load(model)
    inputs = feeds(seed)
    expected = plain.run(inputs)
    for _ in range(3):
        got = optimized.run(inputs)
        for name, value in expected.items():
            np.testing.assert_array_equal(got[name], value, err_msg=name)


def test_only_a_graph_quantizing_computed_values_leaves_the_rounding_patterns_unfused():
    model = attention_then_quantized_projection()
    quantizing = runnx.load(model)
    assert quantizing.fuses_bitwise and "RepeatedKVAttention" not in quantizing.fused
    float_only = attention_then_quantized_projection()  # the same attention, its output the result
    del float_only.graph.node[-5:]
    float_only.graph.ClearField("output")
    float_only.graph.output.append(helper.make_tensor_value_info("attended", F, None))
    fused = runnx.load(float_only)
    assert not fused.fuses_bitwise and fused.fused == {"RepeatedKVAttention": 1}


def test_a_quantizer_of_a_constant_is_no_reason_to_fuse_bitwise():
    """QuantizeLinear of a weight (left unfolded) rounds nothing computed."""
    nodes = [_node("QuantizeLinear", ["w", "s", "z"], ["w_q"]), _node("DequantizeLinear", ["w_q", "s", "z"], ["w_f"]),
             _node("MatMul", ["x", "w_f"], ["y"])]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", F, [2, 4])], [helper.make_tensor_value_info("y", F, None)],
        [numpy_helper.from_array(np.ones((4, 4), np.float32), "w"), numpy_helper.from_array(np.float32(0.1), "s"),
         numpy_helper.from_array(np.uint8(128), "z")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    loaded = runnx.load(model, fold_constants=False)
    assert not fusion.quantizes_computed_values(loaded.graph) and not loaded.fuses_bitwise


def test_a_dynamically_quantized_product_becomes_onnxruntimes_matmul_integer_to_float():
    """MatMulInteger -> Cast -> Mul by the scales' product is one com.microsoft MatMulIntegerToFloat
    node (its standard fused op), in the graph that quantizes computed values too: bitwise. The
    quantizer's outputs are graph outputs here, so it stays a node of its own."""
    loaded = runnx.load(attention_then_quantized_projection())
    assert loaded.fused == {"MatMulIntegerToFloat": 1, "RepeatedKVMatMul": 2}
    fused = [n for n in loaded.graph.nodes if n.op_type == "MatMulIntegerToFloat"]
    assert len(fused) == 1 and fused[0].domain == "com.microsoft"
    assert not any(n.op_type in ("MatMulInteger", "Cast") for n in loaded.graph.nodes)


def _quantized_product(per_column: bool, scales_read_elsewhere: bool, cast_to=F):
    rng = np.random.default_rng(1)
    nodes = [helper.make_node("DynamicQuantizeLinear", ["x"], ["x_q", "x_scale", "x_zero"], name="quantize"),
             _node("MatMulInteger", ["x_q", "w_q", "x_zero", "w_zero"], ["product"]),
             _node("Cast", ["product"], ["product_f"], to=cast_to),
             _node("Mul", ["w_scale", "x_scale"], ["scales"]),  # the constant first: either order
             _node("Mul", ["scales", "product_f"], ["y"])]
    outputs = [helper.make_tensor_value_info("y", cast_to, None)]
    if scales_read_elsewhere:
        outputs.append(helper.make_tensor_value_info("scales", F, None))
    w_scale = (rng.random(COLUMNS) * 0.02 + 0.001) if per_column else 0.0123
    w_zero = rng.integers(-3, 3, COLUMNS) if per_column else 3
    constants = {"w_q": rng.integers(-64, 64, (48, COLUMNS)).astype(np.int8),
                 "w_zero": np.asarray(w_zero, np.int8), "w_scale": np.asarray(w_scale, np.float32)}
    graph = helper.make_graph(nodes, "quantized_product", [helper.make_tensor_value_info("x", F, [3, 48])], outputs,
                              [numpy_helper.from_array(v, k) for k, v in constants.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


@pytest.mark.parametrize("per_column", [False, True])
@pytest.mark.parametrize("scales_read_elsewhere", [False, True])
def test_the_fused_integer_product_is_bitwise_its_nodes(per_column, scales_read_elsewhere):
    """Per-tensor or per-column weight scales; the scales' product read elsewhere stays a node of
    its own (the fused node computes it again, the same value), and so does the quantizer then;
    a quantizer that only the product reads joins it as DynamicQuantizeMatMul."""
    model = _quantized_product(per_column, scales_read_elsewhere)
    plain, optimized = runnx.load(model, optimization_level="disabled"), runnx.load(model)
    ops = sorted(n.op_type for n in optimized.graph.nodes)
    if scales_read_elsewhere:
        assert optimized.fused == {"MatMulIntegerToFloat": 1}
        assert ops == ["DynamicQuantizeLinear", "MatMulIntegerToFloat", "Mul"]
    else:
        assert optimized.fused == {"MatMulIntegerToFloat": 1, "DynamicQuantizeMatMul": 1}
        assert ops == ["DynamicQuantizeMatMul"]
    rng = np.random.default_rng(2)
    for _ in range(3):  # interpreted, then compiled
        inputs = {"x": (rng.standard_normal((3, 48)) * 4).astype(np.float32)}
        expected = plain.run(inputs)
        got = optimized.run(inputs)
        for name, value in expected.items():
            np.testing.assert_array_equal(got[name], value, err_msg=name)
    theirs = _outputs_of_onnxruntime(model, inputs)
    np.testing.assert_allclose(got["y"], theirs["y"], rtol=1e-6, atol=1e-6)


def test_an_integer_product_cast_to_another_type_is_left_alone():
    model = _quantized_product(False, False, cast_to=TensorProto.DOUBLE)
    model.graph.node[3].input[0] = "w_scale_d"
    model.graph.initializer.append(numpy_helper.from_array(np.float64(0.0123), "w_scale_d"))
    model.graph.node[3].input[1] = "x_scale_d"
    model.graph.node.insert(3, _node("Cast", ["x_scale"], ["x_scale_d"], to=TensorProto.DOUBLE))
    loaded = runnx.load(model)
    assert "MatMulIntegerToFloat" not in loaded.fused
