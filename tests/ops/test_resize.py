"""Resampling kernels against direct formulas."""
from __future__ import annotations

import numpy as np
import pytest

from tests.ops._single_node import run_node

RNG = np.random.default_rng(3)
EMPTY = np.array([], np.float32)


def test_nearest_integer_upscale_repeats():
    x = RNG.standard_normal((1, 2, 3, 4)).astype(np.float32)
    got = run_node("Resize", [x, EMPTY, np.array([1, 1, 2, 3], np.float32)], mode="nearest", opset=13)
    np.testing.assert_array_equal(got, x.repeat(2, axis=2).repeat(3, axis=3))
    np.testing.assert_array_equal(run_node("Upsample", [x, np.array([1, 1, 2, 3], np.float32)], opset=9), got)


def test_linear_align_corners_1d_formula():
    x = RNG.standard_normal((1, 5)).astype(np.float32)
    got = run_node("Resize", [x, EMPTY, EMPTY, np.array([1, 9])], mode="linear",
                   coordinate_transformation_mode="align_corners", opset=13)
    np.testing.assert_allclose(got[0], np.interp(np.linspace(0, 4, 9), np.arange(5), x[0]), rtol=1e-5)


def test_half_pixel_linear_downsample_by_two_averages_pairs():
    x = RNG.standard_normal((1, 1, 4, 6)).astype(np.float32)
    got = run_node("Resize", [x, EMPTY, np.array([1, 1, 0.5, 0.5], np.float32)], mode="linear", opset=13)
    expected = x.reshape(1, 1, 2, 2, 3, 2).mean(axis=(3, 5))
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_cubic_keeps_linear_ramps_inside_and_constant_images():
    ramp = np.tile(np.arange(8, dtype=np.float32), (1, 1, 8, 1))
    # Keys' cubic reproduces linear functions exactly for a = -0.5 (not for the default -0.75)
    got = run_node("Resize", [ramp, EMPTY, np.array([1, 1, 1, 2], np.float32)], mode="cubic", cubic_coeff_a=-0.5,
                   coordinate_transformation_mode="align_corners", opset=13)
    np.testing.assert_allclose(got[0, 0, 0, 4:-4], np.linspace(0, 7, 16)[4:-4], atol=1e-4)
    flat = np.full((1, 1, 9, 9), 3.0, np.float32)
    for antialias in (0, 1):
        got = run_node("Resize", [flat, EMPTY, np.array([1, 1, 0.4, 0.6], np.float32)], mode="cubic",
                       antialias=antialias, exclude_outside=1, opset=18)
        np.testing.assert_allclose(got, 3.0, rtol=1e-5)


def test_antialias_linear_widens_the_filter():
    x = np.zeros((1, 8), np.float32)
    x[0, 3] = 1.0
    plain = run_node("Resize", [x, EMPTY, np.array([1, 0.25], np.float32)], mode="linear", opset=18)
    smooth = run_node("Resize", [x, EMPTY, np.array([1, 0.25], np.float32)], mode="linear", antialias=1, opset=18)
    # the output sample at 1.5 sees 3 only through the antialiasing filter (taps 0..3 weighted 1..4..1)
    assert plain[0, 0] == 0 and smooth[0, 0] > 0
    np.testing.assert_allclose(smooth.sum() * 4, 1.0, rtol=1e-5)


@pytest.mark.parametrize("policy, expected", [("not_larger", (1, 1, 4, 2)), ("not_smaller", (1, 1, 8, 4))])
def test_keep_aspect_ratio_policy_with_axes(policy, expected):
    x = RNG.standard_normal((1, 1, 4, 2)).astype(np.float32)
    got = run_node("Resize", [x, None, None, np.array([4, 4])], axes=(2, 3), keep_aspect_ratio_policy=policy,
                   opset=18)
    assert got.shape == expected


@pytest.mark.parametrize("nearest_mode, expected", [
    ("round_prefer_floor", [0, 1, 1, 2, 2]), ("round_prefer_ceil", [0, 1, 1, 2, 2]),
    ("floor", [0, 0, 1, 1, 2]), ("ceil", [0, 1, 2, 2, 2])])
def test_nearest_modes_asymmetric(nearest_mode, expected):
    x = np.arange(3, dtype=np.float32).reshape(1, 3)
    got = run_node("Resize", [x, EMPTY, EMPTY, np.array([1, 5])], coordinate_transformation_mode="asymmetric",
                   nearest_mode=nearest_mode, opset=13)
    # source coordinates 0, 0.6, 1.2, 1.8, 2.4 (ceil of 2.4 is clamped to the last index)
    np.testing.assert_array_equal(got[0], expected)


def test_nearest_rounding_ties():
    x = np.arange(4, dtype=np.float32).reshape(1, 4)
    # half_pixel downsample by 2: source coordinates 0.5 and 2.5, exactly between two pixels
    floor = run_node("Resize", [x, EMPTY, np.array([1, 0.5], np.float32)], opset=13)
    ceil = run_node("Resize", [x, EMPTY, np.array([1, 0.5], np.float32)], nearest_mode="round_prefer_ceil", opset=13)
    np.testing.assert_array_equal(floor[0], [0, 2])
    np.testing.assert_array_equal(ceil[0], [1, 3])


def test_tf_crop_and_resize_extrapolates_outside_the_roi():
    x = np.arange(16, dtype=np.float32).reshape(1, 1, 4, 4)
    roi = np.array([0, 0, 0.5, 0.5, 1, 1, 1.5, 1.5], np.float32)
    got = run_node("Resize", [x, roi, EMPTY, np.array([1, 1, 3, 3])], mode="linear",
                   coordinate_transformation_mode="tf_crop_and_resize", extrapolation_value=-1.0, opset=13)
    # coordinates 1.5, 3.0, 4.5 on both axes: the last row and column fall outside
    np.testing.assert_allclose(got[0, 0, :2, :2], [[7.5, 9.0], [13.5, 15.0]], rtol=1e-6)
    assert (got[0, 0, 2] == -1).all() and (got[0, 0, :, 2] == -1).all()


def test_uint8_resize_rounds_and_saturates():
    x = np.array([[0, 255]], np.uint8)
    got = run_node("Resize", [x, EMPTY, EMPTY, np.array([1, 4])], mode="cubic", opset=13)
    assert got.dtype == np.uint8 and got[0, 0] == 0 and got[0, -1] == 255


def test_affine_grid_identity_then_grid_sample_reproduces_the_image():
    x = RNG.standard_normal((2, 3, 4, 5)).astype(np.float32)
    theta = np.tile(np.array([[1, 0, 0], [0, 1, 0]], np.float32), (2, 1, 1))
    for align_corners in (0, 1):
        grid = run_node("AffineGrid", [theta, np.array([2, 3, 4, 5])], align_corners=align_corners, opset=20)
        assert grid.shape == (2, 4, 5, 2)
        for mode in ("linear", "nearest", "cubic"):
            got = run_node("GridSample", [x, grid], mode=mode, align_corners=align_corners, opset=20)
            np.testing.assert_allclose(got, x, rtol=1e-4, atol=1e-5)


def test_grid_sample_padding_modes_outside_the_image():
    x = np.arange(4, dtype=np.float32).reshape(1, 1, 1, 4)
    grid = np.array([[[[-2.0, 0.0], [2.0, 0.0]]]], np.float32)  # far left and far right, x first
    zeros = run_node("GridSample", [x, grid], align_corners=1, padding_mode="zeros", opset=16)
    border = run_node("GridSample", [x, grid], align_corners=1, padding_mode="border", opset=16)
    reflection = run_node("GridSample", [x, grid], align_corners=1, padding_mode="reflection", opset=16)
    np.testing.assert_allclose(zeros[0, 0, 0], [0, 0])
    np.testing.assert_allclose(border[0, 0, 0], [0, 3])
    # -2 maps to -1.5 pixels: reflected at 0 -> 1.5; +2 maps to 4.5: reflected at 3 -> 1.5
    np.testing.assert_allclose(reflection[0, 0, 0], [1.5, 1.5])


def test_grid_sample_border_moves_only_coordinates_beyond_the_border():
    x = np.array([[[[0.0, 1.0, 8.0, 27.0]]]], np.float32)
    grid = np.array([[[[-0.9, 0.0]]]], np.float32)  # pixel -0.3 (align_corners=0): inside the -0.5 border
    got = run_node("GridSample", [x, grid], mode="cubic", padding_mode="border", opset=20)
    taps = np.array([0.0, 0.0, 0.0, 1.0])  # indices -2..1 around -0.3, clamped at the edge
    frac = 0.7  # -0.3 - floor(-0.3)
    a = -0.75

    def kernel(d):
        d = abs(d)
        return ((a + 2) * d - (a + 3)) * d * d + 1 if d <= 1 else ((a * d - 5 * a) * d + 8 * a) * d - 4 * a

    expected = sum(t * kernel(frac - o) for t, o in zip(taps, (-1, 0, 1, 2)))
    np.testing.assert_allclose(got[0, 0, 0, 0], expected, rtol=1e-5)


def test_resize_checks_the_output_size_before_allocating():
    from runnx.errors import RunnxError
    x = np.zeros((1, 1, 2, 2), np.float32)
    with pytest.raises(RunnxError, match="limit"):
        run_node("Resize", [x, EMPTY, np.array([1, 1, 1e5, 1e5], np.float32)], opset=13)
    with pytest.raises(RunnxError, match="positive"):
        run_node("Resize", [x, EMPTY, np.array([1, 1, -1, 1], np.float32)], opset=13)
    assert run_node("Resize", [x, EMPTY, EMPTY, np.array([1, 1, 0, 3])], opset=13).shape == (1, 1, 0, 3)
