"""onnxruntime's contrib norms against onnxruntime: every output, broadcast skips, biases, float16."""
from __future__ import annotations

import numpy as np
import pytest

import runnx
from runnx.errors import RunnxError
from tests.ops._contrib_node import assert_close, contrib_model, run_both

RNG = np.random.default_rng(41)


def _normal(*shape, dtype=np.float32):
    return RNG.standard_normal(shape).astype(dtype)


@pytest.mark.parametrize("skip_shape", [(2, 5, 24), (5, 24), (1, 5, 24)])
@pytest.mark.parametrize("with_beta,with_bias", [(True, True), (False, False), (True, False)])
def test_skip_layer_normalization_all_outputs(skip_shape, with_beta, with_bias):
    x = _normal(2, 5, 24) * 3 + 1
    inputs = [x, _normal(*skip_shape), _normal(24), _normal(24) if with_beta else None,
              _normal(24) if with_bias else None]
    got, expected = run_both("SkipLayerNormalization", inputs, outputs=4, epsilon=1e-5)
    assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_skip_layer_normalization_default_epsilon_and_first_output_only():
    x = _normal(3, 16) * 1e-3  # small values: the epsilon matters
    got, expected = run_both("SkipLayerNormalization", [x, _normal(3, 16) * 1e-3, _normal(16)], outputs=1)
    assert_close(got, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("with_bias", [True, False])
def test_skip_simplified_layer_normalization(with_bias):
    inputs = [_normal(2, 3, 32), _normal(2, 3, 32), _normal(32), _normal(32) if with_bias else None]
    got, expected = run_both("SkipSimplifiedLayerNormalization", inputs, outputs=4, epsilon=1e-6)
    assert_close(got, expected, rtol=1e-4, atol=1e-5)
    got, expected = run_both("SkipSimplifiedLayerNormalization", inputs, outputs=[True, False, False, True])
    assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_skip_norms_float16():
    inputs = [_normal(2, 4, 16, dtype=np.float16), _normal(2, 4, 16, dtype=np.float16),
              _normal(16, dtype=np.float16), _normal(16, dtype=np.float16)]
    got, expected = run_both("SkipLayerNormalization", inputs, outputs=4)
    assert_close(got, expected, rtol=2e-3, atol=2e-3)
    got, expected = run_both("SkipSimplifiedLayerNormalization", inputs[:3], outputs=[True, False, True, True])
    assert_close(got, expected, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("axis", [-1, 1])
def test_simplified_layer_normalization(axis):
    x = _normal(2, 3, 8)
    scale = _normal(*x.shape[axis:])
    got, expected = run_both("SimplifiedLayerNormalization", [x, scale], outputs=2, domain="", axis=axis,
                             epsilon=1e-6)
    assert_close(got, expected, rtol=1e-4, atol=1e-6)


def test_simplified_layer_normalization_output_takes_the_scale_type():
    got, expected = run_both("SimplifiedLayerNormalization", [_normal(4, 8), _normal(8, dtype=np.float16)], domain="")
    assert_close(got, expected, rtol=2e-3, atol=2e-3)
    got, expected = run_both("SimplifiedLayerNormalization",
                             [_normal(4, 8, dtype=np.float16), _normal(8, dtype=np.float16)], domain="")
    assert_close(got, expected, rtol=2e-3, atol=2e-3)


def test_skip_that_does_not_broadcast_is_refused():
    model, feeds = contrib_model("SkipLayerNormalization", [_normal(2, 3, 8), _normal(2, 8), _normal(8)], ["y"])
    with pytest.raises(RunnxError, match="skip of shape"):  # onnxruntime refuses it too
        runnx.load(model).run(feeds)
