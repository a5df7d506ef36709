"""Softmax, LogSoftmax and Hardmax. Before opset 13 they treat the input as a 2-D matrix
[prod(shape[:axis]), prod(shape[axis:])] and normalise each row (default axis 1); from opset 13 on
they normalise along the one given axis (default -1). Softmax and LogSoftmax can reuse a dying input."""
from __future__ import annotations

import numpy as np

from runnx.ops.registry import register


def _coerced_2d(x, axis):
    """The pre-13 view of x as rows of everything from `axis` on."""
    axis = axis + x.ndim if axis < 0 else axis
    rows = int(np.prod(x.shape[:axis], dtype=np.int64))
    return x.reshape(rows, -1)


def _shifted(x, axis, out):
    """x minus its maximum along axis (so exp cannot overflow), into `out` (None: a new array)."""
    return np.subtract(x, np.max(x, axis=axis, keepdims=True), out=np.empty_like(x) if out is None else out)


def _softmax(x, axis, out=None):
    if x.size == 0:
        return x.copy()
    exp = _shifted(x, axis, out)
    np.exp(exp, out=exp)
    exp /= np.sum(exp, axis=axis, keepdims=True)
    return exp


def _log_softmax(x, axis, out=None):
    if x.size == 0:
        return x.copy()
    shifted = _shifted(x, axis, out)
    shifted -= np.log(np.sum(np.exp(shifted), axis=axis, keepdims=True))
    return shifted


def _hardmax(x, axis):
    result = np.zeros_like(x)
    if x.size == 0:
        return result
    first_max = np.expand_dims(np.argmax(x, axis=axis), axis)
    np.put_along_axis(result, first_max, 1, axis=axis)
    return result


@register("Softmax", since=1, inplace=(0,))
def Softmax(x, *, axis: int = 1, overwrite=()):
    rows = _coerced_2d(x, axis)
    return _softmax(rows, 1, rows if overwrite else None).reshape(x.shape)


@register("Softmax", since=13, inplace=(0,))
def Softmax_13(x, *, axis: int = -1, overwrite=()):
    return _softmax(x, axis, x if overwrite else None)


@register("LogSoftmax", since=1, inplace=(0,))
def LogSoftmax(x, *, axis: int = 1, overwrite=()):
    rows = _coerced_2d(x, axis)
    return _log_softmax(rows, 1, rows if overwrite else None).reshape(x.shape)


@register("LogSoftmax", since=13, inplace=(0,))
def LogSoftmax_13(x, *, axis: int = -1, overwrite=()):
    return _log_softmax(x, axis, x if overwrite else None)


@register("Hardmax", since=1)
def Hardmax(x, *, axis: int = 1):
    return _hardmax(_coerced_2d(x, axis), 1).reshape(x.shape)


@register("Hardmax", since=13)
def Hardmax_13(x, *, axis: int = -1):
    return _hardmax(x, axis)
