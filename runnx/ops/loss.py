"""Training losses: NegativeLogLikelihoodLoss and SoftmaxCrossEntropyLoss (opsets 12/13; 22 only
widens the types). Scores are [N, C] or [N, C, d1, ..., dk] with class indices [N] or [N, d1, ..., dk];
a target equal to `ignore_index` contributes nothing, neither to the loss nor to the mean's weight."""
from __future__ import annotations

import numpy as np

from runnx.errors import RunnxError
from runnx.ops.registry import register
from runnx.ops.softmax import _log_softmax

_REDUCTIONS = ("none", "sum", "mean")


def _negative_log_likelihood(log_prob, target, weight, ignore_index, reduction):
    """The loss of picking class `target` from `log_prob` (classes on axis 1), reduced."""
    if reduction not in _REDUCTIONS:
        raise RunnxError(f"reduction '{reduction}' is not one of {', '.join(_REDUCTIONS)}")
    if log_prob.ndim < 2 or target.shape != log_prob.shape[:1] + log_prob.shape[2:]:
        raise RunnxError(f"scores {log_prob.shape} and targets {target.shape} do not match ([N, C, d...] vs [N, d...])")
    classes = log_prob.shape[1]
    kept = np.ones(target.shape, dtype=bool) if ignore_index is None else target != ignore_index
    # ignored targets may lie outside [0, C): look up class 0 for them, their weight is zero anyway
    safe_target = np.where(kept, target, 0).astype(np.int64)
    if safe_target.size and (safe_target.min() < 0 or safe_target.max() >= classes):
        raise RunnxError(f"a target class lies outside [0, {classes}) and is not ignore_index {ignore_index}")
    picked = np.take_along_axis(log_prob, np.expand_dims(safe_target, 1), axis=1).squeeze(1)
    sample_weight = kept.astype(log_prob.dtype)
    if weight is not None:
        if weight.shape != (classes,):
            raise RunnxError(f"weight has shape {weight.shape}, expected ({classes},)")
        sample_weight = sample_weight * weight[safe_target]
    loss = -picked * sample_weight
    if reduction == "none":
        return loss
    if reduction == "sum":
        return np.asarray(loss.sum(), dtype=log_prob.dtype)
    return np.asarray(loss.sum() / sample_weight.sum(), dtype=log_prob.dtype)


@register("NegativeLogLikelihoodLoss", since=12)
def NegativeLogLikelihoodLoss(x, target, weight=None, *, ignore_index: int | None = None, reduction: str = "mean"):
    return _negative_log_likelihood(x, target, weight, ignore_index, reduction)


@register("SoftmaxCrossEntropyLoss", since=12)
def SoftmaxCrossEntropyLoss(scores, labels, weights=None, *, ignore_index: int | None = None,
                            reduction: str = "mean", output_count):
    """The loss of log_softmax(scores) over classes (axis 1), and the log-probabilities when asked."""
    if scores.ndim < 2:
        raise RunnxError(f"scores must be [N, C, d...], got shape {scores.shape}")
    log_prob = _log_softmax(scores, 1)
    loss = _negative_log_likelihood(log_prob, labels, weights, ignore_index, reduction)
    return (loss, log_prob) if output_count == 2 else loss
