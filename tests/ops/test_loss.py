"""NegativeLogLikelihoodLoss and SoftmaxCrossEntropyLoss against the losses written out per sample."""
import numpy as np
import pytest
from _single_node import run_node

from runnx.errors import RunnxError

RNG = np.random.default_rng(12)


def per_sample_nll(log_prob, target, weight, ignore_index):
    """Loss and weight of every sample, by explicit loops over [N, C, D] (D flattened)."""
    n, c = log_prob.shape[:2]
    flat, labels = log_prob.reshape(n, c, -1), target.reshape(n, -1)
    loss, weights = np.zeros(labels.shape), np.zeros(labels.shape)
    for i in range(n):
        for d in range(labels.shape[1]):
            label = labels[i, d]
            if label == ignore_index:
                continue
            weights[i, d] = 1.0 if weight is None else weight[label]
            loss[i, d] = -flat[i, label, d] * weights[i, d]
    return loss.reshape(target.shape), weights.reshape(target.shape)


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("weighted", [False, True])
def test_nll_loss_with_ignored_targets(reduction, weighted):
    x = RNG.standard_normal((3, 5, 2, 4)).astype(np.float32)
    target = RNG.integers(0, 5, (3, 2, 4)).astype(np.int64)
    target[0, 0, 0] = target[2, 1, 3] = -7  # ignored, and outside [0, C)
    weight = RNG.random(5).astype(np.float32) if weighted else None
    got = run_node("NegativeLogLikelihoodLoss", [x, target, weight], opset=13, reduction=reduction, ignore_index=-7)
    loss, weights = per_sample_nll(x, target, weight, -7)
    expected = {"none": loss, "sum": loss.sum(), "mean": loss.sum() / weights.sum()}[reduction]
    assert got.dtype == np.float32 and got.shape == np.shape(expected)
    np.testing.assert_allclose(got, expected, rtol=1e-5)


def test_softmax_cross_entropy_returns_log_probabilities():
    scores = RNG.standard_normal((4, 3)).astype(np.float64)
    labels = np.array([0, 2, 1, 2], dtype=np.int64)
    loss, log_prob = run_node("SoftmaxCrossEntropyLoss", [scores, labels], outputs=2, opset=13)
    expected_log_prob = scores - np.log(np.exp(scores).sum(axis=1, keepdims=True))
    np.testing.assert_allclose(log_prob, expected_log_prob, rtol=1e-12)
    np.testing.assert_allclose(loss, -expected_log_prob[np.arange(4), labels].mean(), rtol=1e-12)


def test_softmax_cross_entropy_single_output_sum():
    scores = RNG.standard_normal((2, 3, 5)).astype(np.float32)
    labels = RNG.integers(0, 3, (2, 5)).astype(np.int64)
    got = run_node("SoftmaxCrossEntropyLoss", [scores, labels], opset=12, reduction="sum")
    log_prob = scores - np.log(np.exp(scores).sum(axis=1, keepdims=True))
    np.testing.assert_allclose(got, per_sample_nll(log_prob, labels, None, None)[0].sum(), rtol=1e-5)


def test_loss_rejects_target_out_of_range_and_bad_reduction():
    x = np.zeros((2, 3), np.float32)
    with pytest.raises(RunnxError, match="outside"):
        run_node("NegativeLogLikelihoodLoss", [x, np.array([0, 3], np.int64)], opset=13)
    with pytest.raises(RunnxError, match="reduction"):
        run_node("NegativeLogLikelihoodLoss", [x, np.array([0, 1], np.int64)], opset=13, reduction="max")
