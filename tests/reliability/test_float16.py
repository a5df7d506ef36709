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
