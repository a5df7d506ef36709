"""Convolutions against naive loop references."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from tests.ops._single_node import run_node

RNG = np.random.default_rng(0)


def naive_conv(x, w, b=None, strides=None, pads=None, dilations=None, group=1):
    """Direct loops over every output position (N-d)."""
    rank = x.ndim - 2
    strides = strides or (1,) * rank
    dilations = dilations or (1,) * rank
    pads = pads or (0,) * (2 * rank)
    xp = np.pad(x, [(0, 0), (0, 0)] + [(pads[i], pads[i + rank]) for i in range(rank)])
    kernel = w.shape[2:]
    out_shape = [(xp.shape[2 + i] - (kernel[i] - 1) * dilations[i] - 1) // strides[i] + 1 for i in range(rank)]
    n, c = x.shape[:2]
    m = w.shape[0]
    cg, mg = c // group, m // group
    out = np.zeros((n, m, *out_shape), dtype=np.float64)
    for o in itertools.product(*(range(s) for s in out_shape)):
        for k in itertools.product(*(range(s) for s in kernel)):
            idx = tuple(o[i] * strides[i] + k[i] * dilations[i] for i in range(rank))
            for g in range(group):
                patch = xp[(slice(None), slice(g * cg, (g + 1) * cg)) + idx]  # (N, Cg)
                out[(slice(None), slice(g * mg, (g + 1) * mg)) + o] += patch @ w[(slice(g * mg, (g + 1) * mg),
                                                                                  slice(None)) + k].T
    if b is not None:
        out += b.reshape((1, -1) + (1,) * rank)
    return out


def naive_conv_transpose(x, w, strides, pads, dilations, output_padding, group=1):
    rank = x.ndim - 2
    n, c = x.shape[:2]
    cg, mg = c // group, w.shape[1]
    kernel = w.shape[2:]
    full = [(x.shape[2 + i] - 1) * strides[i] + (kernel[i] - 1) * dilations[i] + 1 + output_padding[i]
            for i in range(rank)]
    out = np.zeros((n, mg * group, *full))
    for i in itertools.product(*(range(s) for s in x.shape[2:])):
        for k in itertools.product(*(range(s) for s in kernel)):
            pos = tuple(i[a] * strides[a] + k[a] * dilations[a] for a in range(rank))
            for g in range(group):
                v = x[(slice(None), slice(g * cg, (g + 1) * cg)) + i]  # (N, Cg)
                out[(slice(None), slice(g * mg, (g + 1) * mg)) + pos] += v @ w[(slice(g * cg, (g + 1) * cg),
                                                                              slice(None)) + k]
    crop = tuple(slice(pads[a], full[a] - pads[a + rank]) for a in range(rank))
    return out[(slice(None), slice(None)) + crop]


@pytest.mark.parametrize("shape, kernel, attrs", [
    ((2, 4, 9, 8), (6, 2, 3, 3), dict(strides=(2, 1), pads=(1, 0, 2, 1), dilations=(1, 2), group=2)),
    ((1, 3, 7, 7), (4, 3, 1, 1), dict(strides=(2, 2))),
    ((1, 6, 10), (6, 1, 3), dict(pads=(1, 1), group=6)),  # depthwise 1-d
    ((1, 8, 30), (5, 8, 3), dict(pads=(1, 1), strides=(2,))),  # Whisper's Conv1d shape family
    ((1, 2, 4, 5, 3), (3, 2, 2, 3, 2), dict(pads=(1, 0, 1, 0, 1, 0))),
])
def test_conv_matches_naive_loops(shape, kernel, attrs):
    x = RNG.standard_normal(shape).astype(np.float32)
    w = RNG.standard_normal(kernel).astype(np.float32)
    b = RNG.standard_normal(kernel[0]).astype(np.float32)
    got = run_node("Conv", [x, w, b], **attrs)
    np.testing.assert_allclose(got, naive_conv(x, w, b, **attrs), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("auto_pad, expected_pads", [("SAME_UPPER", (0, 1)), ("SAME_LOWER", (1, 0))])
def test_conv_auto_pad_same_puts_the_odd_pad_where_told(auto_pad, expected_pads):
    x = RNG.standard_normal((1, 1, 6)).astype(np.float32)
    w = RNG.standard_normal((1, 1, 2)).astype(np.float32)
    got = run_node("Conv", [x, w], auto_pad=auto_pad)
    np.testing.assert_allclose(got, naive_conv(x, w, pads=expected_pads), rtol=1e-5)


@pytest.mark.parametrize("attrs", [
    dict(strides=(2, 3), pads=(1, 0, 0, 2), dilations=(1, 2), output_padding=(1, 0)),
    dict(strides=(1, 1), pads=(0, 0, 0, 0), dilations=(1, 1), output_padding=(0, 0), group=2),
])
def test_conv_transpose_matches_scatter_loops(attrs):
    x = RNG.standard_normal((2, 4, 3, 4)).astype(np.float32)
    w = RNG.standard_normal((4, 3, 3, 2)).astype(np.float32)
    got = run_node("ConvTranspose", [x, w], **attrs)
    expected = naive_conv_transpose(x, w, attrs["strides"], attrs["pads"], attrs["dilations"],
                                    attrs["output_padding"], attrs.get("group", 1))
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


def test_conv_transpose_output_shape_pads_symmetrically():
    x = RNG.standard_normal((1, 1, 3)).astype(np.float32)
    w = RNG.standard_normal((1, 1, 3)).astype(np.float32)
    full = naive_conv_transpose(x, w, (2,), (0, 0), (1,), (0,))  # length 7
    got = run_node("ConvTranspose", [x, w], strides=(2,), output_shape=(5,))
    np.testing.assert_allclose(got, full[:, :, 1:6], rtol=1e-5)


def test_conv_integer_subtracts_zero_points_exactly():
    x = RNG.integers(0, 255, (1, 2, 5, 5), dtype=np.uint8)
    w = RNG.integers(0, 255, (3, 2, 3, 3), dtype=np.uint8)
    xz, wz = np.uint8(128), np.uint8(7)
    got = run_node("ConvInteger", [x, w, np.array(xz), np.array(wz)], pads=(1, 1, 1, 1))
    assert got.dtype == np.int32
    expected = naive_conv(x.astype(np.float64) - 128, w.astype(np.float64) - 7, pads=(1, 1, 1, 1))
    np.testing.assert_array_equal(got, expected.astype(np.int64))


def test_deform_conv_without_offsets_is_conv_and_mask_scales():
    x = RNG.standard_normal((1, 4, 6, 6)).astype(np.float32)
    w = RNG.standard_normal((2, 4, 3, 3)).astype(np.float32)
    offsets = np.zeros((1, 2 * 2 * 9, 4, 4), np.float32)  # two offset groups
    got = run_node("DeformConv", [x, w, offsets], offset_group=2, opset=19)
    np.testing.assert_allclose(got, naive_conv(x, w), rtol=1e-4, atol=1e-4)
    mask = np.full((1, 2 * 9, 4, 4), 0.5, np.float32)
    got = run_node("DeformConv", [x, w, offsets, None, mask], offset_group=2, opset=19)
    np.testing.assert_allclose(got, naive_conv(x, w) * 0.5, rtol=1e-4, atol=1e-4)


def test_deform_conv_integer_offset_shifts_the_sampling_grid():
    x = RNG.standard_normal((1, 1, 5, 5)).astype(np.float32)
    w = np.ones((1, 1, 1, 1), np.float32)
    offsets = np.zeros((1, 2, 5, 5), np.float32)
    offsets[0, 1] = 1.0  # every sample one column to the right
    got = run_node("DeformConv", [x, w, offsets], opset=19)
    expected = np.zeros_like(x)
    expected[..., :4] = x[..., 1:]  # the last column samples outside: zero
    np.testing.assert_allclose(got, expected, rtol=1e-6)


def test_causal_conv_with_state_carries_the_tail_between_calls():
    x = RNG.standard_normal((2, 3, 7)).astype(np.float32)
    w = RNG.standard_normal((3, 1, 3)).astype(np.float32)
    b = RNG.standard_normal(3).astype(np.float32)
    whole, state = run_node("CausalConvWithState", [x, w, b], outputs=2, opset=27)
    expected = naive_conv(x, w, b, pads=(2, 0), group=3)
    np.testing.assert_allclose(whole, expected, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(state, x[:, :, -2:])
    first, carry = run_node("CausalConvWithState", [x[:, :, :4], w, b], outputs=2, opset=27)
    second, _ = run_node("CausalConvWithState", [x[:, :, 4:], w, b, carry], outputs=2, opset=27)
    np.testing.assert_allclose(np.concatenate([first, second], axis=2), expected, rtol=1e-4, atol=1e-5)
    silu, _ = run_node("CausalConvWithState", [x, w, b], outputs=2, opset=27, activation="silu")
    np.testing.assert_allclose(silu, expected / (1 + np.exp(-expected)), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("op", ["Conv", "ConvTranspose"])
def test_half_precision_conv_accumulates_in_float32_and_returns_float16(op):
    x = RNG.standard_normal((1, 4, 6, 6)).astype(np.float16)
    w = RNG.standard_normal((4, 4, 3, 3)).astype(np.float16)
    got = run_node(op, [x, w], pads=(1, 1, 1, 1))
    exact = run_node(op, [x.astype(np.float32), w.astype(np.float32)], pads=(1, 1, 1, 1))
    assert got.dtype == np.float16
    np.testing.assert_array_equal(got, exact.astype(np.float16))
