"""Fused kernels for patterns that `runnx.interp.fusion` finds in exported decoders (private
domain `runnx.fused`; never in a model file).

Each kernel does the arithmetic of the nodes it replaces with the same numpy operations in the
same order, so its results are those of the unfused graph; the one exception is attention, which
scales the (small) query by both scale factors instead of scaling the (long) key cache. The win is
fewer dispatches, fewer temporaries and, for attention, no copy of the KV cache per step: the
exporters' grouped-query head repeat (Unsqueeze/Expand/Reshape of the whole cache) becomes a
reshape of the queries.
"""
from __future__ import annotations

import functools
import math

import numpy as np

from runnx.errors import RunnxError
from runnx.interp.dtypes import ONNX_TO_NUMPY
from runnx.ops._elementwise_util import sigmoid
from runnx.ops.registry import register
from runnx.ops.shape import Slice

DOMAIN = "runnx.fused"


def _fits(operand, result) -> bool:
    """Whether `result op= operand` is `result op operand` (same dtype, operand broadcasts into it)."""
    return (operand.dtype == result.dtype and operand.ndim <= result.ndim
            and all(o == 1 or o == r for o, r in zip(operand.shape[::-1], result.shape[::-1])))


def _softmax_in_place(scores, axis: int):
    """Softmax-13 of a fresh array, in it: the same operations as the Softmax kernel (max-shifted
    exp, divided by its sum), without numpy's Python-level reduction wrappers."""
    if scores.size == 0:
        return scores
    np.subtract(scores, np.maximum.reduce(scores, axis=axis, keepdims=True), out=scores)
    np.exp(scores, out=scores)
    scores /= np.add.reduce(scores, axis=axis, keepdims=True)
    return scores


@register("RMSNorm", since=1, domain=DOMAIN)
def RMSNorm(x, epsilon, one, weight, *, axis: int = -1, to: int = 0):
    """weight * Cast(x * (one / sqrt(ReduceMean(x * x, axis) + epsilon)), to) (to=0: no Cast)."""
    squares = np.square(x)
    mean = np.add.reduce(squares, axis=axis, keepdims=True, dtype=squares.dtype)  # np.sum without its wrapper
    mean = np.true_divide(mean, x.shape[axis], out=mean, casting="unsafe")
    np.add(mean, epsilon, out=mean, casting="unsafe")
    np.sqrt(mean, out=mean)
    normed = np.multiply(x, np.divide(one, mean))
    if to:
        normed = normed.astype(ONNX_TO_NUMPY[to], copy=False)
    return np.multiply(weight, normed)


@register("SiluMul", since=1, domain=DOMAIN)
def SiluMul(gate, up):
    """gate * Sigmoid(gate) * up: the SiLU-gated MLP's activation."""
    activated = sigmoid(gate)
    np.multiply(gate, activated, out=activated)
    if _fits(up, activated):
        return np.multiply(activated, up, out=activated)
    return np.multiply(activated, up)


@register("RotateHalf", since=1, domain=DOMAIN)
def RotateHalf(x, cos, sin, negated_starts, negated_ends, negated_axes, negated_steps, kept_starts, kept_ends,
               kept_axes, kept_steps, *, axis: int = -1):
    """x * cos + Concat(-Slice(x, negated...), Slice(x, kept...)) * sin: rotary embedding."""
    rotated = np.concatenate([np.negative(_slice(x, negated_starts, negated_ends, negated_axes, negated_steps)),
                              _slice(x, kept_starts, kept_ends, kept_axes, kept_steps)], axis=axis)
    return np.add(np.multiply(x, cos), np.multiply(rotated, sin))


def _slice(x, starts, ends, axes, steps):
    """ONNX Slice; one axis with step 1 clamps exactly like a Python slice, so it is one."""
    if axes is not None and starts.size == 1 and ends.size == 1 and axes.size == 1 and (
            steps is None or (steps.size == 1 and int(steps.reshape(-1)[0]) == 1)):
        axis = int(axes.reshape(-1)[0])
        if -x.ndim <= axis < x.ndim:
            index = [slice(None)] * x.ndim
            index[axis] = slice(int(starts.reshape(-1)[0]), int(ends.reshape(-1)[0]))
            return x[tuple(index)]
    return Slice(x, starts, ends, axes, steps)


def _resolve_reshape(shape: tuple, target: tuple) -> tuple | None:
    """Reshape's output shape (allowzero=0: a 0 copies the input's dimension), None if invalid."""
    dims = [shape[i] if d == 0 and i < len(shape) else d for i, d in enumerate(target)]
    total = math.prod(shape)
    if dims.count(-1) == 1:
        known = math.prod(d for d in dims if d != -1)
        if known == 0 or total % known:
            return None
        dims[dims.index(-1)] = total // known
    if any(d < 0 for d in dims) or math.prod(dims) != total:
        return None
    return tuple(dims)


def _ints(array) -> tuple:
    return tuple(np.asarray(array).reshape(-1).tolist())


def _unsqueezed_shape(shape: tuple, axes: tuple) -> tuple:
    """Shape of Unsqueeze (axes count in the output's rank; negative from its end)."""
    rank = len(shape) + len(axes)
    result = list(shape)
    for a in sorted(a % rank for a in axes):
        result.insert(a, 1)
    return tuple(result)


@functools.lru_cache(maxsize=256)
def _repeat_shapes(shape: tuple, axes: tuple, expand: tuple, target: tuple) -> tuple:
    """(unsqueezed, expanded, reshaped) shapes of Reshape(Expand(Unsqueeze(kv, axes), expand),
    target) for a kv of `shape`, and r when that repeats each of kv's heads r times in place
    (grouped-query attention), else None."""
    unsqueezed = _unsqueezed_shape(shape, axes)
    try:
        expanded = np.broadcast_shapes(unsqueezed, expand)
    except ValueError:
        raise RunnxError(f"cannot expand shape {list(unsqueezed)} to {list(expand)}") from None
    reshaped = _resolve_reshape(expanded, target)
    if reshaped is None:
        raise RunnxError(f"cannot reshape {list(expanded)} to {list(target)}")
    repeat = None
    if len(shape) == 4 and [a % 5 for a in axes] == [2] and expanded[:2] == shape[:2] and expanded[3:] == shape[2:]:
        if reshaped == (shape[0], shape[1] * expanded[2], shape[2], shape[3]):
            repeat = expanded[2]
    return unsqueezed, expanded, reshaped, repeat


def _repeat(kv, axes, expand, target) -> tuple:
    return _repeat_shapes(kv.shape, _ints(axes), _ints(expand), _ints(target))


def _materialised(kv, shapes):
    """The unfused computation of the repeated cache, for shapes that are not a plain head repeat."""
    unsqueezed, expanded, reshaped, _ = shapes
    return np.broadcast_to(kv.reshape(unsqueezed), expanded).reshape(reshaped)


@register("RepeatedKVShape", since=1, domain=DOMAIN)
def RepeatedKVShape(kv, axes, expand, target):
    """A stand-in with the shape of the repeated cache, for nodes that only read its shape."""
    return _stand_in(kv.dtype, _repeat(kv, axes, expand, target)[2])


@functools.lru_cache(maxsize=256)
def _stand_in(dtype, shape: tuple) -> np.ndarray:
    return np.broadcast_to(np.zeros((), dtype), shape)  # read-only: safe to hand out again


@register("RepeatedKVAttention", since=1, domain=DOMAIN)
def RepeatedKVAttention(query, key, value, bias, query_scale, key_scale, nan_fill, key_axes, key_expand, key_target,
                        value_axes, value_expand, value_target, *, axis: int = -1):
    """Softmax((query * qs) @ (repeat(key)^T * ks) + bias) with NaN -> nan_fill, @ repeat(value),
    where repeat is the exporter's Unsqueeze/Expand/Reshape head repeat. Query heads are grouped
    per KV head instead, so the cache (a view into its capacity buffer) is read in place."""
    key_shapes = _repeat(key, key_axes, key_expand, key_target)
    value_shapes = _repeat(value, value_axes, value_expand, value_target)
    key_repeat = key_shapes[3]
    scaled = np.multiply(query, query_scale)
    plain = (key_repeat is None or key_repeat != value_shapes[3] or query.ndim != 4
             or query.shape[1] != key.shape[1] * key_repeat or query.shape[0] != key.shape[0]
             or axis % 4 != 3)
    if plain:
        keys = _materialised(key, key_shapes)
        values = _materialised(value, value_shapes)
        scores = np.matmul(scaled, np.multiply(np.swapaxes(keys, -1, -2), key_scale))
    else:
        batch, heads, length, _ = query.shape
        groups = key.shape[1]
        np.multiply(scaled, key_scale, out=scaled, casting="unsafe")
        grouped = scaled.reshape(batch, groups, key_repeat * length, query.shape[3])
        scores = np.matmul(grouped, np.swapaxes(key, -1, -2)).reshape(batch, heads, length, key.shape[2])
    if _fits(bias, scores):
        np.add(scores, bias, out=scores)
    else:
        scores = np.add(scores, bias)
    probabilities = _softmax_in_place(scores, axis)
    missing = np.isnan(probabilities)
    if missing.any():
        probabilities = np.where(missing, nan_fill, probabilities)
    else:
        probabilities = probabilities.astype(np.result_type(nan_fill, probabilities), copy=False)
    if plain:
        return np.matmul(probabilities, values)
    grouped = probabilities.reshape(batch, groups, key_repeat * length, key.shape[2])
    return np.matmul(grouped, value).reshape(batch, heads, length, value.shape[3])
