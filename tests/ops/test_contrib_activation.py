"""onnxruntime's contrib activations against onnxruntime, float32 and float16."""
from __future__ import annotations

import numpy as np
import pytest

from tests.ops._contrib_node import assert_close, run_both

RNG = np.random.default_rng(42)


@pytest.mark.parametrize("dtype,tolerance", [(np.float32, 1e-5), (np.float16, 2e-3)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_fast_gelu(dtype, tolerance, with_bias):
    x = (RNG.standard_normal((3, 7, 16)) * 4).astype(dtype)
    bias = RNG.standard_normal(16).astype(dtype) if with_bias else None
    got, expected = run_both("FastGelu", [x, bias])
    assert_close(got, expected, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dtype,tolerance", [(np.float32, 1e-5), (np.float16, 2e-3)])
def test_bias_gelu_and_gelu(dtype, tolerance):
    x = (RNG.standard_normal((5, 12)) * 4).astype(dtype)
    got, expected = run_both("BiasGelu", [x, RNG.standard_normal(12).astype(dtype)])
    assert_close(got, expected, rtol=tolerance, atol=tolerance)
    got, expected = run_both("Gelu", [x])
    assert_close(got, expected, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("alpha", [1.702, 0.5])
def test_quick_gelu(alpha):
    x = (RNG.standard_normal((4, 9)) * 6).astype(np.float32)
    got, expected = run_both("QuickGelu", [x], alpha=alpha)
    assert_close(got, expected)
