"""Normalisation: BatchNormalization (inference and training outputs), Instance/Layer/Group/RMS
normalisation, LRN, MeanVarianceNormalization, LpNormalization, and Dropout.

Statistics are computed in float32 at least (float16/bfloat16 inputs are promoted, as the spec's
stash_type asks) and the result is cast back to the input type. Inference BatchNormalization folds
into one multiply-add per element, in place when the executor grants it.
"""
from __future__ import annotations

import functools
import math

import numpy as np

from runnx.errors import RunnxError
from runnx.ops import _native
from runnx.ops._kernels_nn import layer_norm_rows
from runnx.ops.registry import register
from runnx.runtime.rows import share_rows


def _stash_dtype(dtype: np.dtype, stash_type: int = 1) -> np.dtype:
    """Precision of the statistics: float32 for narrow floats (stash_type 1), else the input's own."""
    if stash_type == 1 and dtype.itemsize < 4:
        return np.dtype(np.float32)
    return dtype


def _per_channel(values: np.ndarray, ndim: int) -> np.ndarray:
    """A (C,) vector shaped to broadcast along axis 1 of an ndim-d tensor."""
    return values.reshape((1, -1) + (1,) * (ndim - 2))


def _normalize(x, axes: tuple[int, ...], epsilon: float, compute_dtype):
    """(x - mean) / sqrt(var + epsilon) over `axes`, with the mean and 1/std (kept dims)."""
    xs = x.astype(compute_dtype, copy=False)
    mean = xs.mean(axis=axes, keepdims=True)
    centered = xs - mean
    inv_std = 1.0 / np.sqrt(np.mean(np.square(centered), axis=axes, keepdims=True) + epsilon)
    centered *= inv_std.astype(centered.dtype, copy=False)
    return centered, mean, inv_std


def _batch_norm_inference(x, scale, bias, mean, var, epsilon, overwrite):
    factor = (scale / np.sqrt(var + epsilon)).astype(x.dtype, copy=False)
    shift = (bias - mean * factor).astype(x.dtype, copy=False)
    if overwrite:
        out = np.multiply(x, _per_channel(factor, x.ndim), out=x)
    else:
        out = x * _per_channel(factor, x.ndim)
    out += _per_channel(shift, x.ndim)
    return out


@register("BatchNormalization", since=1, inplace=(0,))
def BatchNormalization_1(x, scale, bias, mean, var, *, consumed_inputs: tuple[int, ...] | None = None,
                         epsilon: float = 1e-5, is_test: int = 0, momentum: float = 0.9, spatial: int = 1,
                         overwrite=()):
    if not spatial:
        raise RunnxError("BatchNormalization with spatial=0 (per-activation statistics) is not supported")
    return _batch_norm_inference(x, scale, bias, mean, var, epsilon, overwrite)


@register("BatchNormalization", since=9, inplace=(0,))
def BatchNormalization_9(x, scale, bias, mean, var, *, epsilon: float = 1e-5, momentum: float = 0.9, overwrite=()):
    return _batch_norm_inference(x, scale, bias, mean, var, epsilon, overwrite)


@register("BatchNormalization", since=14, inplace=(0,))
def BatchNormalization(x, scale, bias, input_mean, input_var, *, epsilon: float = 1e-5, momentum: float = 0.9,
                       training_mode: int = 0, overwrite=()):
    if not training_mode:
        return _batch_norm_inference(x, scale, bias, input_mean, input_var, epsilon, overwrite)
    axes = (0,) + tuple(range(2, x.ndim))
    normalized, mean, _ = _normalize(x, axes, epsilon, _stash_dtype(x.dtype))
    var = x.astype(normalized.dtype).var(axis=axes)
    y = (normalized * _per_channel(scale, x.ndim) + _per_channel(bias, x.ndim)).astype(x.dtype, copy=False)
    running_mean = (input_mean * momentum + mean.reshape(-1) * (1 - momentum)).astype(input_mean.dtype)
    running_var = (input_var * momentum + var * (1 - momentum)).astype(input_var.dtype)
    return y, running_mean, running_var


@register("InstanceNormalization", since=1)
def InstanceNormalization(x, scale, bias, *, epsilon: float = 1e-5, consumed_inputs: tuple[int, ...] | None = None):
    normalized, _, _ = _normalize(x, tuple(range(2, x.ndim)), epsilon, _stash_dtype(x.dtype))
    return (normalized * _per_channel(scale, x.ndim) + _per_channel(bias, x.ndim)).astype(x.dtype, copy=False)


def _fused_layer_norm(x, scale, bias, axis, epsilon):
    """The two-pass numba kernel for the common case (float32/64, one scale and bias per normalised element)."""
    cols = math.prod(x.shape[axis:])
    rows = x.size // cols if cols else 0
    scale = np.broadcast_to(scale, x.shape[axis:]).reshape(cols).astype(x.dtype, copy=False)
    bias = (np.zeros(cols, x.dtype) if bias is None
            else np.broadcast_to(bias, x.shape[axis:]).reshape(cols).astype(x.dtype, copy=False))
    out = np.empty(x.shape, x.dtype)
    stats_shape = x.shape[:axis] + (1,) * (x.ndim - axis)
    mean, inv_std = np.empty(stats_shape, x.dtype), np.empty(stats_shape, x.dtype)
    share_rows(functools.partial(_layer_norm_rows, np.ascontiguousarray(x).reshape(rows, cols),
                                 np.ascontiguousarray(scale), np.ascontiguousarray(bias), float(epsilon),
                                 out.reshape(rows, cols), mean.reshape(rows), inv_std.reshape(rows)), rows, cols)
    return out, mean, inv_std


def _layer_norm_rows(x, scale, bias, epsilon: float, out, mean, inv_std, start: int, stop: int) -> None:
    layer_norm_rows(x[start:stop], scale, bias, epsilon, out[start:stop], mean[start:stop], inv_std[start:stop])


@register("LayerNormalization", since=17)
def LayerNormalization(x, scale, bias=None, *, axis: int = -1, epsilon: float = 1e-5, stash_type: int = 1):
    axis = axis + x.ndim if axis < 0 else axis
    if _native.enabled and x.dtype in (np.float32, np.float64) and x.size and scale.ndim <= x.ndim - axis and (
            bias is None or bias.ndim <= x.ndim - axis):
        return _fused_layer_norm(x, scale, bias, axis, epsilon)
    normalized, mean, inv_std = _normalize(x, tuple(range(axis, x.ndim)), epsilon, _stash_dtype(x.dtype, stash_type))
    normalized *= scale
    if bias is not None:
        normalized += bias
    return normalized.astype(x.dtype, copy=False), mean, inv_std


def _group_norm(x, num_groups, epsilon, stash_type):
    n, channels = x.shape[:2]
    if channels % num_groups:
        raise RunnxError(f"{channels} channels cannot be split into {num_groups} groups")
    grouped = x.reshape((n, num_groups, -1))
    normalized, _, _ = _normalize(grouped, (2,), epsilon, _stash_dtype(x.dtype, stash_type))
    return normalized.reshape(x.shape)


@register("GroupNormalization", since=18)
def GroupNormalization_18(x, scale, bias, *, epsilon: float = 1e-5, num_groups: int):
    # opset 18: scale and bias hold one value per group
    normalized = _group_norm(x, num_groups, epsilon, 1)
    per_group = x.shape[1] // num_groups
    scale, bias = np.repeat(scale, per_group), np.repeat(bias, per_group)
    return (normalized * _per_channel(scale, x.ndim) + _per_channel(bias, x.ndim)).astype(x.dtype, copy=False)


@register("GroupNormalization", since=21)
def GroupNormalization(x, scale, bias, *, epsilon: float = 1e-5, num_groups: int, stash_type: int = 1):
    normalized = _group_norm(x, num_groups, epsilon, stash_type)
    return (normalized * _per_channel(scale, x.ndim) + _per_channel(bias, x.ndim)).astype(x.dtype, copy=False)


@register("RMSNormalization", since=23)
def RMSNormalization(x, scale, *, axis: int = -1, epsilon: float = 1e-5, stash_type: int = 1):
    axis = axis + x.ndim if axis < 0 else axis
    xs = x.astype(_stash_dtype(x.dtype, stash_type), copy=False)
    inv_rms = 1.0 / np.sqrt(np.mean(np.square(xs), axis=tuple(range(axis, x.ndim)), keepdims=True) + epsilon)
    return (xs * inv_rms * scale).astype(x.dtype, copy=False)


@register("LRN", since=1)
def LRN(x, *, alpha: float = 1e-4, beta: float = 0.75, bias: float = 1.0, size: int):
    # sum of squares over the channel window [c - floor((size-1)/2), c + ceil((size-1)/2)], by prefix sums
    before, after = (size - 1) // 2, size - 1 - (size - 1) // 2
    squares = np.square(x.astype(_stash_dtype(x.dtype)))
    prefix = np.cumsum(np.pad(squares, [(0, 0), (before + 1, after)] + [(0, 0)] * (x.ndim - 2)), axis=1)
    channels = x.shape[1]
    window_sum = prefix[:, size:size + channels] - prefix[:, :channels]
    return (x / (bias + (alpha / size) * window_sum) ** beta).astype(x.dtype, copy=False)


@register("MeanVarianceNormalization", since=9)
def MeanVarianceNormalization(x, *, axes: tuple[int, ...] = (0, 2, 3)):
    # the spec's function body: (X - E[X]) / (sqrt(E[X^2] - E[X]^2) + 1e-9)
    mean = x.mean(axis=axes, keepdims=True)
    variance = np.mean(np.square(x), axis=axes, keepdims=True) - np.square(mean)
    return ((x - mean) / (np.sqrt(variance) + 1e-9)).astype(x.dtype, copy=False)


@register("LpNormalization", since=1)
def LpNormalization(x, *, axis: int = -1, p: int = 2):
    if p not in (1, 2):
        raise RunnxError(f"LpNormalization supports p = 1 or 2, got {p}")
    norm = np.abs(x).sum(axis=axis, keepdims=True) if p == 1 else np.sqrt(np.square(x).sum(axis=axis, keepdims=True))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(norm == 0, 0, x / norm).astype(x.dtype, copy=False)


def _dropout(x, ratio: float, training: bool, seed, mask_wanted: bool):
    if not training or ratio == 0:
        return (x, np.ones(x.shape, dtype=bool)) if mask_wanted else x
    if not 0 <= ratio < 1:
        raise RunnxError(f"Dropout ratio must be in [0, 1), got {ratio}")
    rng = np.random.RandomState(seed) if seed is not None else np.random.RandomState()
    mask = rng.uniform(0.0, 1.0, x.shape) >= ratio
    y = (x * mask / (1.0 - ratio)).astype(x.dtype, copy=False)
    return (y, mask) if mask_wanted else y


@register("Dropout", since=1)
def Dropout_1(x, *, consumed_inputs: tuple[int, ...] | None = None, is_test: int = 0, ratio: float = 0.5,
              output_count):
    # these versions scale at training time only; an inference runtime is always "test"
    return _dropout(x, ratio, False, None, output_count > 1)


@register("Dropout", since=7)
def Dropout_7(x, *, ratio: float = 0.5, output_count):
    return _dropout(x, ratio, False, None, output_count > 1)


@register("Dropout", since=12)
def Dropout(x, ratio=None, training_mode=None, *, seed: int | None = None, output_count):
    ratio = 0.5 if ratio is None else float(ratio)
    training = bool(training_mode) if training_mode is not None else False
    return _dropout(x, ratio, training, seed, output_count > 1)
