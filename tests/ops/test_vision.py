"""NonMaxSuppression and RotaryEmbedding."""
from __future__ import annotations

import numpy as np
import pytest

from runnx.errors import RunnxError
from tests.ops._single_node import run_node

RNG = np.random.default_rng(7)


def test_non_max_suppression_greedy_per_class():
    boxes = np.array([[[0, 0, 1, 1], [0, 0.1, 1, 1.1], [0, 2, 1, 3], [1, 1, 0, 0]]], np.float32)  # last: flipped
    scores = np.array([[[0.9, 0.8, 0.7, 0.95], [0.1, 0.6, 0.2, 0.05]]], np.float32)
    got = run_node("NonMaxSuppression", [boxes, scores, np.array([3]), np.array([0.5], np.float32),
                                         np.array([0.1], np.float32)], opset=11)
    # class 0: box 3 (same as box 0) wins, suppresses 0 and 1; box 2 is apart.
    # class 1: box 0 is not above the score threshold; 1 then 2 are kept
    np.testing.assert_array_equal(got, [[0, 0, 3], [0, 0, 2], [0, 1, 1], [0, 1, 2]])
    limited = run_node("NonMaxSuppression", [boxes, scores, np.array([1])], opset=11)
    np.testing.assert_array_equal(limited, [[0, 0, 3], [0, 1, 1]])


def test_non_max_suppression_center_point_format():
    boxes = np.array([[[0.5, 0.5, 1, 1], [0.55, 0.5, 1, 1], [5, 5, 1, 1]]], np.float32)
    scores = np.array([[[0.9, 0.8, 0.7]]], np.float32)
    got = run_node("NonMaxSuppression", [boxes, scores, np.array([10]), np.array([0.5], np.float32)],
                   center_point_box=1, opset=11)
    np.testing.assert_array_equal(got[:, 2], [0, 2])


def rotate_half_reference(x, cos, sin):
    half = x.shape[-1] // 2
    first, second = x[..., :half], x[..., half:]
    return np.concatenate([first * cos - second * sin, first * sin + second * cos], axis=-1)


def test_rotary_embedding_halves_and_partial_dim():
    x = RNG.standard_normal((2, 3, 4, 8)).astype(np.float32)  # batch, heads, seq, head_size
    positions = np.array([[0, 1, 2, 3], [4, 5, 6, 7]])
    angles = RNG.standard_normal((10, 2)).astype(np.float32)
    cos, sin = np.cos(angles), np.sin(angles)
    got = run_node("RotaryEmbedding", [x, cos, sin, positions], rotary_embedding_dim=4, opset=23)
    c, s = cos[positions][:, None], sin[positions][:, None]  # (batch, 1, seq, 2)
    np.testing.assert_allclose(got[..., :4], rotate_half_reference(x[..., :4], c, s), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(got[..., 4:], x[..., 4:])


def test_rotary_embedding_interleaved_3d_input():
    x = RNG.standard_normal((1, 2, 2 * 4)).astype(np.float32)  # batch, seq, heads * head_size
    cos_cache = RNG.standard_normal((1, 2, 2)).astype(np.float32)
    sin_cache = RNG.standard_normal((1, 2, 2)).astype(np.float32)
    got = run_node("RotaryEmbedding", [x, cos_cache, sin_cache], num_heads=2, interleaved=1, opset=23)
    heads = x.reshape(1, 2, 2, 4)
    even, odd = heads[..., 0::2], heads[..., 1::2]
    c, s = cos_cache[:, :, None], sin_cache[:, :, None]
    expected = np.stack([even * c - odd * s, even * s + odd * c], axis=-1).reshape(x.shape)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_image_decoder_without_pillow_says_what_is_missing():
    try:
        import PIL  # noqa: F401
    except ImportError:
        with pytest.raises(RunnxError, match="Pillow"):
            run_node("ImageDecoder", [np.frombuffer(b"P6\n1 1\n255\n\x01\x02\x03", np.uint8)], opset=20)
        return
    got = run_node("ImageDecoder", [np.frombuffer(b"P6\n1 1\n255\n\x01\x02\x03", np.uint8)], pixel_format="BGR",
                   opset=20)
    np.testing.assert_array_equal(got, [[[3, 2, 1]]])
