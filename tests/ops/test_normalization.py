"""Normalisation kernels against their formulas written out directly."""
from __future__ import annotations

import math

import numpy as np
import pytest

from runnx.ops._kernels_nn import _float64_sum
from tests.ops._single_node import run_node

RNG = np.random.default_rng(2)


def channel(v, ndim):
    return v.reshape((1, -1) + (1,) * (ndim - 2))


@pytest.mark.parametrize("owned", [False, True])
def test_batch_norm_inference(owned):
    x = RNG.standard_normal((2, 3, 4, 5)).astype(np.float32)
    scale, bias = RNG.standard_normal(3).astype(np.float32), RNG.standard_normal(3).astype(np.float32)
    mean, var = RNG.standard_normal(3).astype(np.float32), RNG.random(3).astype(np.float32) + 0.5
    got = run_node("BatchNormalization", [x, scale, bias, mean, var], epsilon=1e-3, owned=owned, opset=15)
    expected = (x - channel(mean, 4)) / np.sqrt(channel(var, 4) + 1e-3) * channel(scale, 4) + channel(bias, 4)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_batch_norm_training_outputs_running_statistics():
    x = RNG.standard_normal((4, 2, 3)).astype(np.float32)
    scale, bias = np.array([1.0, 2.0], np.float32), np.array([0.5, -0.5], np.float32)
    mean0, var0 = np.zeros(2, np.float32), np.ones(2, np.float32)
    y, running_mean, running_var = run_node("BatchNormalization", [x, scale, bias, mean0, var0], outputs=3,
                                            training_mode=1, momentum=0.8, opset=15)
    batch_mean, batch_var = x.mean(axis=(0, 2)), x.var(axis=(0, 2))
    expected = (x - channel(batch_mean, 3)) / np.sqrt(channel(batch_var, 3) + 1e-5) * channel(scale, 3)
    np.testing.assert_allclose(y, expected + channel(bias, 3), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(running_mean, 0.2 * batch_mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(running_var, 0.8 + 0.2 * batch_var, rtol=1e-5)


@pytest.mark.parametrize("axis", [-1, 1])
def test_layer_norm_outputs_mean_and_inverse_std(axis):
    x = RNG.standard_normal((2, 3, 4)).astype(np.float32)
    normalized_shape = x.shape[axis:]
    scale = RNG.standard_normal(normalized_shape).astype(np.float32)
    bias = RNG.standard_normal(normalized_shape).astype(np.float32)
    y, mean, inv_std = run_node("LayerNormalization", [x, scale, bias], outputs=3, axis=axis, opset=17)
    axes = tuple(range(axis % 3, 3))
    m = x.mean(axis=axes, keepdims=True)
    s = 1 / np.sqrt(x.var(axis=axes, keepdims=True) + 1e-5)
    np.testing.assert_allclose(y, (x - m) * s * scale + bias, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(mean, m, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(inv_std, s, rtol=1e-5)


@pytest.mark.parametrize("length", [1, 2, 7, 8, 9, 13, 17, 100, 383, 384, 385, 1000])
def test_layer_norm_statistics_are_float64_sums_of_every_element(length):
    """The pairwise tree over any length (odd halves fold their last term into the first) adds
    every term once: float64 sums within rounding of the exact ones, float32 terms or float64."""
    for dtype in (np.float32, np.float64):
        row = (RNG.standard_normal(length) * 10 + 3).astype(dtype)
        scratch = np.empty(length)
        total = _float64_sum(row, 0.0, False, scratch)
        assert total == pytest.approx(math.fsum(row.astype(np.float64)), rel=1e-13, abs=1e-12)
        centre = total / length
        squares = _float64_sum(row, centre, True, scratch)
        assert squares == pytest.approx(math.fsum((row.astype(np.float64) - centre) ** 2), rel=1e-12, abs=1e-12)


def test_layer_norm_float16_computes_statistics_in_float32():
    x = (RNG.standard_normal((2, 64)) * 100 + 1000).astype(np.float16)
    y = run_node("LayerNormalization", [x, np.ones(64, np.float16)], opset=17)
    assert y.dtype == np.float16
    xf = x.astype(np.float32)
    expected = (xf - xf.mean(-1, keepdims=True)) / np.sqrt(xf.var(-1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(y.astype(np.float32), expected, atol=2e-2)


def test_group_norm_opset18_per_group_affine_equals_opset21_per_channel():
    x = RNG.standard_normal((2, 6, 5)).astype(np.float32)
    group_scale, group_bias = np.array([1.0, 2.0, 3.0], np.float32), np.array([0.0, 1.0, -1.0], np.float32)
    old = run_node("GroupNormalization", [x, group_scale, group_bias], num_groups=3, opset=18)
    new = run_node("GroupNormalization", [x, np.repeat(group_scale, 2), np.repeat(group_bias, 2)], num_groups=3,
                   opset=21)
    grouped = x.reshape(2, 3, -1)
    normalized = ((grouped - grouped.mean(-1, keepdims=True)) / np.sqrt(grouped.var(-1, keepdims=True) + 1e-5))
    expected = normalized.reshape(x.shape) * channel(np.repeat(group_scale, 2), 3) + channel(
        np.repeat(group_bias, 2), 3)
    np.testing.assert_allclose(old, expected, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(new, expected, rtol=1e-4, atol=1e-5)


def test_instance_and_rms_norm():
    x = RNG.standard_normal((2, 3, 4, 4)).astype(np.float32)
    scale, bias = RNG.standard_normal(3).astype(np.float32), RNG.standard_normal(3).astype(np.float32)
    got = run_node("InstanceNormalization", [x, scale, bias])
    m, v = x.mean(axis=(2, 3), keepdims=True), x.var(axis=(2, 3), keepdims=True)
    np.testing.assert_allclose(got, (x - m) / np.sqrt(v + 1e-5) * channel(scale, 4) + channel(bias, 4),
                               rtol=1e-4, atol=1e-5)
    weight = RNG.standard_normal(4).astype(np.float32)
    got = run_node("RMSNormalization", [x, weight], epsilon=1e-6, opset=23)
    np.testing.assert_allclose(got, x / np.sqrt(np.mean(x * x, -1, keepdims=True) + 1e-6) * weight, rtol=1e-5)


@pytest.mark.parametrize("size", [3, 4])
def test_lrn_matches_channel_window_loop(size):
    x = RNG.standard_normal((2, 7, 3, 2)).astype(np.float32)
    got = run_node("LRN", [x], size=size, alpha=0.01, beta=0.6, bias=2.0)
    expected = np.empty_like(x)
    for c in range(7):
        lo, hi = max(0, c - (size - 1) // 2), min(7, c + (size - 1) - (size - 1) // 2 + 1)
        window = (x[:, lo:hi] ** 2).sum(axis=1)
        expected[:, c] = x[:, c] / (2.0 + 0.01 / size * window) ** 0.6
    np.testing.assert_allclose(got, expected, rtol=1e-5)


def test_mean_variance_and_lp_normalization():
    x = RNG.standard_normal((2, 3, 4, 5)).astype(np.float32)
    got = run_node("MeanVarianceNormalization", [x], opset=13)
    m = x.mean(axis=(0, 2, 3), keepdims=True)
    np.testing.assert_allclose(got, (x - m) / (x.std(axis=(0, 2, 3), keepdims=True) + 1e-9), rtol=1e-4, atol=1e-5)
    got = run_node("LpNormalization", [x], axis=1, p=1)
    np.testing.assert_allclose(got, x / np.abs(x).sum(axis=1, keepdims=True), rtol=1e-5)
    zeros = run_node("LpNormalization", [np.zeros((2, 3), np.float32)])
    np.testing.assert_array_equal(zeros, 0)


def test_dropout_inference_is_identity_with_all_true_mask():
    x = RNG.standard_normal((3, 4)).astype(np.float32)
    y, mask = run_node("Dropout", [x, np.array(0.7, np.float32)], outputs=2, opset=13)
    np.testing.assert_array_equal(y, x)
    assert mask.dtype == np.bool_ and mask.all()
    np.testing.assert_array_equal(run_node("Dropout", [x], ratio=0.3, opset=7), x)


def test_dropout_training_scales_kept_values_and_is_seeded():
    x = np.ones((50, 40), np.float32)
    inputs = [x, np.array(0.25, np.float32), np.array(True)]
    y, mask = run_node("Dropout", inputs, outputs=2, seed=3, opset=13)
    np.testing.assert_allclose(y, mask / 0.75, rtol=1e-6)
    assert 0.15 < 1 - mask.mean() < 0.35
    again, _ = run_node("Dropout", inputs, outputs=2, seed=3, opset=13)
    np.testing.assert_array_equal(y, again)
