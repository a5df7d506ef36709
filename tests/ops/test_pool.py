"""Pooling against naive loop references."""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from tests.ops._single_node import run_node

RNG = np.random.default_rng(1)


def naive_pool(x, kernel, strides, pads, dilations, ceil_mode, reduce):
    """reduce(values inside the input, window size incl. declared pads) for every window, by loops."""
    rank = len(kernel)
    spatial = x.shape[2:]
    out_shape = []
    for i in range(rank):
        span = spatial[i] + pads[i] + pads[i + rank] - ((kernel[i] - 1) * dilations[i] + 1)
        n = (math.ceil(span / strides[i]) if ceil_mode else span // strides[i]) + 1
        if ceil_mode and (n - 1) * strides[i] >= spatial[i] + pads[i]:
            n -= 1
        out_shape.append(n)
    out = np.zeros(x.shape[:2] + tuple(out_shape))
    for o in itertools.product(*(range(s) for s in out_shape)):
        values, declared = [], 0
        for k in itertools.product(*(range(s) for s in kernel)):
            pos = [o[i] * strides[i] - pads[i] + k[i] * dilations[i] for i in range(rank)]
            if all(-pads[i] <= pos[i] < spatial[i] + pads[i + rank] for i in range(rank)):
                declared += 1
            if all(0 <= pos[i] < spatial[i] for i in range(rank)):
                values.append(x[(slice(None), slice(None)) + tuple(pos)])
        out[(slice(None), slice(None)) + o] = reduce(np.stack(values, -1), declared)
    return out


CASES = [
    ((1, 2, 7, 6), (3, 2), (2, 2), (1, 0, 1, 1), (1, 1), 0),
    ((2, 1, 8, 9), (2, 3), (2, 3), (0, 1, 1, 0), (2, 1), 1),
    ((1, 3, 11), (3,), (3,), (1, 1), (2,), 1),
    ((1, 1, 5, 4, 6), (2, 2, 3), (1, 2, 2), (0, 1, 0, 1, 0, 1), (2, 1, 1), 0),
]


@pytest.mark.parametrize("shape, kernel, strides, pads, dilations, ceil_mode", CASES)
def test_max_pool_values_and_indices(shape, kernel, strides, pads, dilations, ceil_mode):
    x = RNG.standard_normal(shape).astype(np.float32)
    values, indices = run_node("MaxPool", [x], outputs=2, kernel_shape=kernel, strides=strides, pads=pads,
                               dilations=dilations, ceil_mode=ceil_mode)
    expected = naive_pool(x, kernel, strides, pads, dilations, ceil_mode, lambda v, _: v.max(-1))
    np.testing.assert_array_equal(values, expected.astype(np.float32))
    np.testing.assert_array_equal(x.reshape(-1)[indices], values)  # indices point at the maxima


def test_max_pool_storage_order_column_major_indices():
    x = np.arange(12, dtype=np.float32).reshape(1, 1, 3, 4)
    _, row_major = run_node("MaxPool", [x], outputs=2, kernel_shape=(2, 2))
    _, col_major = run_node("MaxPool", [x], outputs=2, kernel_shape=(2, 2), storage_order=1)
    np.testing.assert_array_equal(row_major.reshape(-1), [5, 6, 7, 9, 10, 11])
    h, w = divmod(row_major, 4)
    np.testing.assert_array_equal(col_major, w * 3 + h)


def test_max_pool_integer_input_pads_with_the_minimum():
    x = np.full((1, 1, 3, 3), -100, np.int8)
    got = run_node("MaxPool", [x], kernel_shape=(3, 3), pads=(1, 1, 1, 1))
    np.testing.assert_array_equal(got, np.full((1, 1, 3, 3), -100, np.int8))


@pytest.mark.parametrize("shape, kernel, strides, pads, dilations, ceil_mode", CASES)
@pytest.mark.parametrize("count_include_pad", [0, 1])
def test_average_pool_counts(shape, kernel, strides, pads, dilations, ceil_mode, count_include_pad):
    x = RNG.standard_normal(shape).astype(np.float32)
    got = run_node("AveragePool", [x], kernel_shape=kernel, strides=strides, pads=pads, dilations=dilations,
                   ceil_mode=ceil_mode, count_include_pad=count_include_pad, opset=19)
    divisor = (lambda v, d: v.sum(-1) / d) if count_include_pad else (lambda v, _: v.mean(-1))
    expected = naive_pool(x, kernel, strides, pads, dilations, ceil_mode, divisor)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_lp_pool_p3():
    x = RNG.standard_normal((1, 2, 6, 5)).astype(np.float32)
    got = run_node("LpPool", [x], kernel_shape=(2, 2), strides=(2, 1), pads=(1, 0, 0, 1), p=3)
    expected = naive_pool(x, (2, 2), (2, 1), (1, 0, 0, 1), (1, 1), 0,
                          lambda v, _: (np.abs(v) ** 3).sum(-1) ** (1 / 3))
    np.testing.assert_allclose(got, expected, rtol=1e-5)


def test_global_pools():
    x = RNG.standard_normal((2, 3, 4, 5)).astype(np.float32)
    np.testing.assert_allclose(run_node("GlobalAveragePool", [x]), x.mean(axis=(2, 3), keepdims=True), rtol=1e-6)
    np.testing.assert_array_equal(run_node("GlobalMaxPool", [x]), x.max(axis=(2, 3), keepdims=True))
    np.testing.assert_allclose(run_node("GlobalLpPool", [x], p=1), np.abs(x).sum(axis=(2, 3), keepdims=True),
                               rtol=1e-5)


def test_max_unpool_inverts_max_pool():
    x = RNG.standard_normal((1, 2, 4, 6)).astype(np.float32)
    values, indices = run_node("MaxPool", [x], outputs=2, kernel_shape=(2, 2), strides=(2, 2))
    restored = run_node("MaxUnpool", [values, indices], kernel_shape=(2, 2), strides=(2, 2))
    expected = np.zeros_like(x)
    expected.reshape(-1)[indices.reshape(-1)] = values.reshape(-1)
    np.testing.assert_array_equal(restored, expected)
    larger = run_node("MaxUnpool", [values, indices, np.array([1, 2, 5, 7])], kernel_shape=(2, 2), strides=(2, 2))
    assert larger.shape == (1, 2, 5, 7)
    np.testing.assert_array_equal(larger[:, :, :4, :6], expected)


def test_roi_align_bilinear_samples():
    x = np.arange(25, dtype=np.float32).reshape(1, 1, 5, 5)  # linear in both axes: bilinear is exact
    rois = np.array([[1.0, 1.0, 3.0, 3.0]], np.float32)
    got = run_node("RoiAlign", [x, rois, np.array([0])], output_height=2, output_width=2, sampling_ratio=1,
                   coordinate_transformation_mode="output_half_pixel", opset=16)
    # bin centres at 1.5 and 2.5 along both axes: value = 5*y + x
    np.testing.assert_allclose(got[0, 0], [[9.0, 10.0], [14.0, 15.0]], rtol=1e-6)
    shifted = run_node("RoiAlign", [x, rois, np.array([0])], output_height=2, output_width=2, sampling_ratio=1,
                       opset=16)  # half_pixel: coordinates shift by -0.5
    np.testing.assert_allclose(shifted[0, 0], [[6.0, 7.0], [11.0, 12.0]], rtol=1e-6)


def test_max_roi_pool():
    x = np.arange(36, dtype=np.float32).reshape(1, 1, 6, 6)
    rois = np.array([[0, 0, 0, 3, 3]], np.float32)  # batch, x1, y1, x2, y2 (inclusive)
    got = run_node("MaxRoiPool", [x, rois], pooled_shape=(2, 2))
    np.testing.assert_array_equal(got[0, 0], [[7, 9], [19, 21]])


def test_half_precision_average_pools_sum_in_float32():
    x = np.full((1, 1, 64, 64), 1.001, np.float16)
    got = run_node("AveragePool", [x], kernel_shape=(64, 64))
    assert got.dtype == np.float16 and got[0, 0, 0, 0] == np.float16(1.001)
    np.testing.assert_array_equal(run_node("GlobalAveragePool", [x]), got)


def test_valid_auto_pad_still_honours_ceil_mode():
    x = np.arange(8, dtype=np.float32).reshape(1, 1, 8)
    got = run_node("MaxPool", [x], kernel_shape=(3,), strides=(2,), auto_pad="VALID", ceil_mode=1)
    np.testing.assert_array_equal(got[0, 0], [2, 4, 6, 7])  # the last window holds only 6 and 7
