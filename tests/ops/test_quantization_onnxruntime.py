"""The standard quantized path of quantized models against onnxruntime: blocked DequantizeLinear
(opset 21), DynamicQuantizeLinear, MatMulInteger and QLinearMatMul on single-node graphs."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from tests.ops._contrib_node import assert_close, run_both

RNG = np.random.default_rng(45)


@pytest.mark.parametrize("dtype,low,high", [(np.uint8, 0, 256), (np.int8, -128, 128), (ml_dtypes.int4, -8, 8),
                                            (ml_dtypes.uint4, 0, 16)])
@pytest.mark.parametrize("with_zero_point", [True, False])
def test_blocked_dequantize_linear(dtype, low, high, with_zero_point):
    x = RNG.integers(low, high, (6, 70)).astype(dtype)  # 70 = 4 blocks of 16 and a tail of 6
    scale = (RNG.random((6, 5)) + 0.1).astype(np.float32)
    zero = RNG.integers(low, high, (6, 5)).astype(dtype) if with_zero_point else None
    got, expected = run_both("DequantizeLinear", [x, scale, zero], domain="", initializers=(0, 1, 2), axis=1,
                             block_size=16)
    assert_close(got, expected, rtol=1e-6, atol=1e-6)


def test_dynamic_quantize_linear():
    for x in (RNG.standard_normal((3, 17)).astype(np.float32) * 5, np.abs(RNG.standard_normal(9)).astype(np.float32)):
        got, expected = run_both("DynamicQuantizeLinear", [x], outputs=3, domain="")
        for g, e in zip(got, expected):
            np.testing.assert_array_equal(g, e)


def test_matmul_integer_and_qlinear_matmul_u8u8():
    # u8 x u8: no 16-bit pair saturation in onnxruntime's kernels, so its result is exact here
    a = RNG.integers(0, 256, (4, 32)).astype(np.uint8)
    b = RNG.integers(0, 256, (32, 8)).astype(np.uint8)
    a_zero, b_zero = np.array(120, np.uint8), np.array(130, np.uint8)
    got, expected = run_both("MatMulInteger", [a, b, a_zero, b_zero], domain="", initializers=(1, 3))
    np.testing.assert_array_equal(got[0], expected[0])
    inputs = [a, np.array(0.02, np.float32), a_zero, b, np.array(0.01, np.float32), b_zero, np.array(0.5, np.float32),
              np.array(128, np.uint8)]
    got, expected = run_both("QLinearMatMul", inputs, domain="", initializers=(3, 4, 5, 6, 7))
    assert np.abs(got[0].astype(np.int32) - expected[0].astype(np.int32)).max() <= 1  # one rounding step apart at most
