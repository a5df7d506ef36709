"""Quantisation kernels: rounding, saturation, per-axis and blocked parameters, integer-exact products."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from onnx import TensorProto

from tests.ops._single_node import run_node
from tests.ops.test_conv import naive_conv

RNG = np.random.default_rng(5)


def test_quantize_rounds_half_to_even_and_saturates():
    x = np.array([0.5, 1.5, 2.5, -0.5, 300.0, -300.0], np.float32)
    got = run_node("QuantizeLinear", [x, np.array(1.0, np.float32), np.array(0, np.int8)], opset=13)
    np.testing.assert_array_equal(got, np.array([0, 2, 2, 0, 127, -128], np.int8))
    got = run_node("QuantizeLinear", [x, np.array(2.0, np.float32)], opset=10)  # default uint8, zero point 0
    np.testing.assert_array_equal(got, np.array([0, 1, 1, 0, 150, 0], np.uint8))


def test_quantize_per_axis_and_dequantize_round_trip():
    x = RNG.standard_normal((2, 3, 4)).astype(np.float32)
    scale = np.array([0.01, 0.02, 0.05], np.float32)
    zero = np.array([10, 128, 250], np.uint8)
    q = run_node("QuantizeLinear", [x, scale, zero], axis=1, opset=13)
    expected = np.clip(np.rint(x / scale[:, None]) + zero[:, None], 0, 255)
    np.testing.assert_array_equal(q, expected.astype(np.uint8))
    back = run_node("DequantizeLinear", [q, scale, zero], axis=1, opset=13)
    np.testing.assert_allclose(back, (expected - zero[:, None]) * scale[:, None], rtol=1e-6)


def test_blocked_quantization_to_int4():
    x = RNG.standard_normal((2, 6)).astype(np.float32)
    scale = np.array([[0.5, 0.25], [1.0, 0.125]], np.float32)  # blocks of 3 along axis 1
    q = run_node("QuantizeLinear", [x, scale], axis=1, block_size=3, output_dtype=TensorProto.INT4, opset=21)
    assert q.dtype == ml_dtypes.int4
    full_scale = np.repeat(scale, 3, axis=1)
    np.testing.assert_array_equal(q.astype(np.int8), np.clip(np.rint(x / full_scale), -8, 7))
    back = run_node("DequantizeLinear", [q, scale], axis=1, block_size=3, opset=21)
    np.testing.assert_allclose(back, np.clip(np.rint(x / full_scale), -8, 7) * full_scale, rtol=1e-6)


def test_float8_saturates_unless_told_not_to():
    x = np.array([1000.0, -1000.0, 1.0], np.float32)
    zero = np.array(0, ml_dtypes.float8_e4m3fn)
    got = run_node("QuantizeLinear", [x, np.array(1.0, np.float32), zero], opset=19)
    np.testing.assert_array_equal(got.astype(np.float32), [448.0, -448.0, 1.0])
    raw = run_node("QuantizeLinear", [x, np.array(1.0, np.float32), zero], saturate=0, opset=19)
    assert np.isnan(raw.astype(np.float32)[0])


def test_dynamic_quantize_linear_covers_zero_and_the_range():
    x = np.array([-1.0, 0.0, 2.0, 3.0], np.float32)
    y, scale, zero = run_node("DynamicQuantizeLinear", [x], outputs=3, opset=11)
    np.testing.assert_allclose(scale, 4.0 / 255, rtol=1e-6)
    assert zero == np.rint(255 / 4)
    np.testing.assert_allclose((y.astype(np.float32) - zero) * scale, x, atol=scale)


def test_qlinear_matmul_per_row_and_column_scales():
    a = RNG.integers(0, 255, (3, 4), dtype=np.uint8)
    b = RNG.integers(-128, 127, (4, 2), dtype=np.int8)
    a_scale, a_zero = np.array([0.1, 0.2, 0.3], np.float32), np.array([100, 120, 140], np.uint8)
    b_scale, b_zero = np.array([0.05, 0.02], np.float32), np.array([1, -3], np.int8)
    y_scale, y_zero = np.array(0.5, np.float32), np.array(128, np.uint8)
    got = run_node("QLinearMatMul", [a, a_scale, a_zero, b, b_scale, b_zero, y_scale, y_zero], opset=10)
    real = ((a - a_zero[:, None].astype(np.float64)) * a_scale[:, None]) @ ((b - b_zero.astype(np.float64))
                                                                             * b_scale)
    np.testing.assert_array_equal(got, np.clip(np.rint(real / 0.5) + 128, 0, 255).astype(np.uint8))


def test_qlinear_conv_per_channel_weights():
    x = RNG.integers(0, 255, (1, 2, 5, 5), dtype=np.uint8)
    w = RNG.integers(-100, 100, (3, 2, 3, 3), dtype=np.int8)
    x_scale, x_zero = np.array(0.02, np.float32), np.array(128, np.uint8)
    w_scale, w_zero = np.array([0.01, 0.02, 0.03], np.float32), np.array([0, 0, 0], np.int8)
    y_scale, y_zero = np.array(0.1, np.float32), np.array(5, np.int8)
    bias = np.array([100, -200, 0], np.int32)
    got = run_node("QLinearConv", [x, x_scale, x_zero, w, w_scale, w_zero, y_scale, y_zero, bias], pads=(1, 1, 1, 1))
    acc = naive_conv(x.astype(np.float64) - 128, w.astype(np.float64), bias.astype(np.float64), pads=(1, 1, 1, 1))
    real = acc * (0.02 * w_scale.astype(np.float64)).reshape(1, 3, 1, 1) / np.float64(np.float32(0.1))
    np.testing.assert_array_equal(got, np.clip(np.rint(real) + 5, -128, 127).astype(np.int8))


@pytest.mark.parametrize("dtype", [np.uint8, np.int8, np.int16])
@pytest.mark.parametrize("with_zero", [True, False])
def test_dequantize_per_tensor_is_numpys_arithmetic_bitwise(dtype, with_zero):
    """One scale (and zero point): a single pass computing (float32(x) - float32(zero)) * scale,
    numpy's arithmetic, to the bit."""
    info = np.iinfo(dtype)
    x = np.random.default_rng(3).integers(info.min, info.max + 1, (37, 129)).astype(dtype)
    scale = np.array(0.0123457, np.float32)
    zero = np.array(info.max // 3, dtype) if with_zero else None
    expected = (x.astype(np.float32) - (np.float32(0) if zero is None else zero.astype(np.float32))) * scale
    got = run_node("DequantizeLinear", [x, scale] + ([zero] if with_zero else []))
    assert got.dtype == np.float32 and got.tobytes() == expected.tobytes()


def test_dynamic_quantize_one_pass_is_numpys_bitwise(monkeypatch):
    """A decode step's rows take one numba pass: the same uint8 values, scale and zero point as
    numpy's float32 arithmetic, ties rounded to even, all-positive, all-negative and all-zero rows
    included; NaN or infinity fall back to numpy's path."""
    from runnx.ops import _native, quantization

    rng = np.random.default_rng(5)
    cases = [(rng.standard_normal(n) * s).astype(np.float32) for n, s in ((576, 1.0), (1536, 40.0), (7, 1e-3))]
    cases += [np.abs(cases[0]), -np.abs(cases[0]), np.zeros(5, np.float32), (np.arange(-255, 256) / 2).astype(np.float32),
              np.array([np.inf, 1.0], np.float32)]
    for x in cases:
        fast = quantization.DynamicQuantizeLinear(x)
        monkeypatch.setattr(_native, "enabled", False)
        with np.errstate(invalid="ignore"):
            slow = quantization.DynamicQuantizeLinear(x)
        monkeypatch.setattr(_native, "enabled", True)
        for got, want in zip(fast, slow):
            assert got.dtype == want.dtype and got.tobytes() == want.tobytes()
