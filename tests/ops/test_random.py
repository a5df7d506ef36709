"""Random ops: the backend suite cannot compare random values, so these check shape, dtype, range,
that a seed makes a node reproducible (and different seeds differ), and the distributions roughly."""
import ml_dtypes
import numpy as np
import pytest
from _single_node import run_node
from onnx import TensorProto

from runnx.errors import ResourceLimitError


def test_uniform_has_shape_dtype_range_and_seeded_reproducibility():
    first = run_node("RandomUniform", [], shape=[1000], low=2.0, high=3.0, seed=1.0, dtype=TensorProto.DOUBLE)
    assert first.shape == (1000,) and first.dtype == np.float64
    assert first.min() >= 2.0 and first.max() < 3.0 and abs(first.mean() - 2.5) < 0.05
    again = run_node("RandomUniform", [], shape=[1000], low=2.0, high=3.0, seed=1.0, dtype=TensorProto.DOUBLE)
    other = run_node("RandomUniform", [], shape=[1000], low=2.0, high=3.0, seed=1.5, dtype=TensorProto.DOUBLE)
    np.testing.assert_array_equal(first, again)
    assert not np.array_equal(first, other)


def test_unseeded_draws_differ_between_runs():
    assert not np.array_equal(run_node("RandomNormal", [], shape=[64]), run_node("RandomNormal", [], shape=[64]))


def test_normal_like_takes_the_input_shape_and_type_unless_told():
    x = np.zeros((200, 50), np.float16)
    got = run_node("RandomNormalLike", [x], mean=5.0, scale=2.0, seed=0.0)
    assert got.shape == x.shape and got.dtype == np.float16
    assert abs(float(got.astype(np.float64).mean()) - 5) < 0.1 and abs(float(got.astype(np.float64).std()) - 2) < 0.1
    as_bf16 = run_node("RandomUniformLike", [x], dtype=TensorProto.BFLOAT16, opset=22)
    assert as_bf16.dtype == ml_dtypes.bfloat16


def test_bernoulli_is_exact_at_zero_and_one_and_keeps_the_input_type():
    p = np.array([0, 1, 0, 1], np.float32)
    got = run_node("Bernoulli", [p], seed=3.0)
    assert got.dtype == np.float32 and got.tolist() == [0, 1, 0, 1]
    assert run_node("Bernoulli", [p], dtype=TensorProto.INT32).dtype == np.int32
    frequency = run_node("Bernoulli", [np.full(10000, 0.3, np.float64)], seed=1.0).mean()
    assert abs(frequency - 0.3) < 0.02


def test_multinomial_samples_classes_by_their_probabilities():
    logits = np.log(np.array([[0.2, 0.8, 1e-12], [1.0, 1e-12, 1e-12]], np.float32))
    got = run_node("Multinomial", [logits], sample_size=5000, seed=2.0)
    assert got.shape == (2, 5000) and got.dtype == np.int32
    assert abs((got[0] == 1).mean() - 0.8) < 0.03 and not (got[0] == 2).any() and (got[1] == 0).all()
    assert run_node("Multinomial", [logits], dtype=TensorProto.INT64).dtype == np.int64
    np.testing.assert_array_equal(run_node("Multinomial", [logits], sample_size=50, seed=2.0),
                                  run_node("Multinomial", [logits], sample_size=50, seed=2.0))


def test_shape_attribute_is_held_to_the_element_limit():
    with pytest.raises(ResourceLimitError):
        run_node("RandomNormal", [], shape=[10**7, 10**7])
