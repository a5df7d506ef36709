"""Float16 models (onnxruntime's convert_float_to_float16, as transformers.js's model_fp16.onnx files
are made): their arithmetic computes in float32 (runnx/interp/float16.py) at every optimization
level, fused or not, and matches onnxruntime where float16 arithmetic would overflow."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.transformers.float16 import convert_float_to_float16

import runnx

from differential import decode_and_compare, decoder, load_both, random_shape


@pytest.mark.parametrize("style", ["llama", "gpt"])
@pytest.mark.parametrize("seed", [0, 1])
def test_float16_decoders_agree_with_unoptimized(style, seed):
    """Every fusion pattern of the style can match the converted graph; its fused kernels given
    float16 (or the float32 between widening Casts) equal plain interpretation within float16's tolerance."""
    shape = random_shape(np.random.default_rng(seed), style, usual=True)
    model, _ = decoder(shape)
    half = convert_float_to_float16(model, keep_io_types=False)
    plain, optimized = load_both(half)
    assert plain.widened > 0 and plain.widened == optimized.widened
    decode_and_compare(plain, optimized, shape, seed, dtype=np.float16)


def test_a_norm_of_large_values_computes_in_float32_as_onnxruntime_does():
    """x**2 of 300 overflows float16 (65504): computed in float16 the norm is 0 or NaN everywhere."""
    nodes = [helper.make_node("Pow", ["x", "two"], ["squares"]),
             helper.make_node("ReduceMean", ["squares"], ["mean"], axes=[-1]),
             helper.make_node("Add", ["mean", "eps"], ["shifted"]),
             helper.make_node("Sqrt", ["shifted"], ["root"]),
             helper.make_node("Div", ["x", "root"], ["normed"]),
             helper.make_node("Transpose", ["normed"], ["y"], perm=[1, 0])]
    graph = helper.make_graph(nodes, "norm", [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [2, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [8, 2])],
                              [numpy_helper.from_array(np.float16(2), "two"), numpy_helper.from_array(np.float16(1e-5), "eps")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    x = (np.random.default_rng(0).standard_normal((2, 8)) * 300).astype(np.float16)
    path_free = model.SerializeToString()
    expected = session_of(path_free).run(None, {"x": x})[0]
    for level in ("disabled", "all"):
        got = runnx.load(path_free, optimization_level=level).run({"x": x})["y"]
        assert got.dtype == np.float16 and np.isfinite(got).all()
        np.testing.assert_array_equal(got, expected)


def session_of(data: bytes):
    import onnxruntime as ort
    return ort.InferenceSession(data, providers=["CPUExecutionProvider"])


H = TensorProto.FLOAT16


def _half_model(nodes, inputs, outputs, constants):
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, H, None) for n in inputs],
                              [helper.make_tensor_value_info(n, H, None) for n in outputs],
                              [numpy_helper.from_array(np.asarray(v), k) for k, v in constants.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10).SerializeToString()


def _fused_and_plain(model: bytes, feeds: dict):
    fused = runnx.load(model, shape_cache=False)
    plain = runnx.load(model, optimization_level="disabled")
    return fused.run(feeds), plain.run(feeds), [n.op_type for n in fused.plan()]


def _rotary_after_a_product():
    """q = MatMul(a, W) rounded to float16 by the Reshape reading it, then rotate-half rotary."""
    nodes = [helper.make_node("MatMul", ["a", "w"], ["q"]),
             helper.make_node("Reshape", ["q", "heads"], ["x"]),
             helper.make_node("Slice", ["x", "zero", "half", "last"], ["x1"]),
             helper.make_node("Slice", ["x", "half", "end", "last"], ["x2"]),
             helper.make_node("Neg", ["x2"], ["neg"]),
             helper.make_node("Concat", ["neg", "x1"], ["rot"], axis=-1),
             helper.make_node("Mul", ["x", "cos"], ["c"]),
             helper.make_node("Mul", ["rot", "sin"], ["s"]),
             helper.make_node("Add", ["c", "s"], ["y"])]
    rng = np.random.default_rng(5)
    return _half_model(nodes, ["a", "cos", "sin"], ["y"], {
        "w": rng.standard_normal((16, 16)).astype(np.float16), "heads": np.array([1, 5, 2, 8]),
        "zero": np.array([0]), "half": np.array([4]), "end": np.array([2**62]), "last": np.array([-1])})


def test_a_float16_rotary_embedding_fuses_and_keeps_the_rounding_before_it():
    """The Slices, Neg and Concat move float32 copies of the rounded product, so the rotary
    pattern matches; the product is still rounded to float16 where the Reshape read it."""
    rng = np.random.default_rng(6)
    feeds = {"a": rng.standard_normal((1, 5, 16)).astype(np.float16),
             "cos": rng.standard_normal((1, 5, 1, 8)).astype(np.float16),
             "sin": rng.standard_normal((1, 5, 1, 8)).astype(np.float16)}
    fused, plain, ops = _fused_and_plain(_rotary_after_a_product(), feeds)
    assert "RotateHalf" in ops and not {"Slice", "Neg", "Concat"} & set(ops)
    assert fused["y"].dtype == np.float16
    np.testing.assert_array_equal(fused["y"], plain["y"])
    w = np.random.default_rng(5).standard_normal((16, 16)).astype(np.float16)
    x = (feeds["a"].astype(np.float32) @ w.astype(np.float32)).astype(np.float16).astype(np.float32).reshape(1, 5, 2, 8)
    rotated = np.concatenate([-x[..., 4:], x[..., :4]], axis=-1)
    cos, sin = feeds["cos"].astype(np.float32), feeds["sin"].astype(np.float32)
    expected = (x * cos + rotated * sin).astype(np.float16)  # q rounded once, the sum once
    np.testing.assert_array_equal(fused["y"], expected)
    unrounded = (feeds["a"].astype(np.float32) @ w.astype(np.float32)).reshape(1, 5, 2, 8)
    assert not np.array_equal(fused["y"], (unrounded * cos + np.concatenate(
        [-unrounded[..., 4:], unrounded[..., :4]], axis=-1) * sin).astype(np.float16))


def test_movement_read_as_float16_stays_float16():
    """A Concat into a float16 cache that is an output, and read by a product, keeps float16: the
    product reads the cache's values widened, never the unrounded keys."""
    nodes = [helper.make_node("MatMul", ["a", "w"], ["k"]),
             helper.make_node("Concat", ["past", "k"], ["present"], axis=1),
             helper.make_node("Transpose", ["present"], ["kt"], perm=[0, 2, 1]),
             helper.make_node("MatMul", ["a", "kt"], ["scores"])]
    rng = np.random.default_rng(8)
    w = rng.standard_normal((8, 8)).astype(np.float16)
    model = _half_model(nodes, ["a", "past"], ["present", "scores"], {"w": w})
    feeds = {"a": rng.standard_normal((1, 1, 8)).astype(np.float16),
             "past": rng.standard_normal((1, 3, 8)).astype(np.float16)}
    fused, plain, _ = _fused_and_plain(model, feeds)
    assert fused["present"].dtype == np.float16 and fused["scores"].dtype == np.float16
    for name in ("present", "scores"):
        np.testing.assert_array_equal(fused[name], plain[name])
    keys = np.concatenate([feeds["past"], (feeds["a"].astype(np.float32) @ w.astype(np.float32)).astype(np.float16)], 1)
    expected = (feeds["a"].astype(np.float32) @ keys.astype(np.float32).transpose(0, 2, 1)).astype(np.float16)
    np.testing.assert_array_equal(fused["scores"], expected)


def test_a_cast_of_float16_to_float16_goes_and_its_rounding_stays():
    """An export's Cast to float (float16 once converted) of a float16 sum is an identity: it goes,
    and the Mul reading it still reads the sum rounded to float16."""
    nodes = [helper.make_node("Add", ["x", "a"], ["s"]),
             helper.make_node("Cast", ["s"], ["c"], to=H, name="identity"),
             helper.make_node("Mul", ["c", "b"], ["y"])]
    model = _half_model(nodes, ["x", "a", "b"], ["y"], {})
    rng = np.random.default_rng(9)
    feeds = {name: rng.standard_normal((4, 8)).astype(np.float16) for name in ("x", "a", "b")}
    fused, plain, _ = _fused_and_plain(model, feeds)
    assert "identity" not in [n.name for n in runnx.load(model, shape_cache=False).plan()]
    wide = {name: value.astype(np.float32) for name, value in feeds.items()}
    expected = ((wide["x"] + wide["a"]).astype(np.float16).astype(np.float32) * wide["b"]).astype(np.float16)
    np.testing.assert_array_equal(fused["y"], expected)
    np.testing.assert_array_equal(plain["y"], expected)
