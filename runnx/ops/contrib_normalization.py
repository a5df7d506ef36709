"""onnxruntime's contrib normalisations: SimplifiedLayerNormalization (RMSNorm, in the ONNX domain,
where onnxruntime registers it), SkipLayerNormalization and
SkipSimplifiedLayerNormalization (a residual add fused with the norm that reads it).

Statistics are float32 for float16/bfloat16/float32 inputs (float64 for float64), as onnxruntime
computes them; the mean and inverse standard deviation outputs are float32 (stash type), the
normalised output has the scale's type and input_skip_bias_sum the input's.
"""
from __future__ import annotations

import functools

import numpy as np

from runnx.errors import RunnxError
from runnx.ops._kernels_contrib import skip_norm_rows
from runnx.ops.registry import register
from runnx.runtime.pool import settle
from runnx.runtime.rows import SHARED_FROM, share_rows

DOMAIN = "com.microsoft"
_SKIP_EPSILON = 1e-12  # onnxruntime's default for the Skip* norms


def _compute_dtype(dtype) -> np.dtype:
    return np.dtype(np.float64) if dtype == np.float64 else np.dtype(np.float32)


def _vector(value, width: int, dtype, what: str, op: str) -> np.ndarray:
    """A per-column parameter as a contiguous (width,) array in the compute dtype; (0,) when absent."""
    if value is None:
        return np.empty(0, dtype)
    if value.size != width:
        raise RunnxError(f"{op}: {what} has {value.size} elements, expected the hidden size {width}")
    return np.ascontiguousarray(value.reshape(width), dtype=dtype)


_FLOAT32 = np.dtype(np.float32)
_NONE32 = np.empty(0, _FLOAT32)  # an absent bias or beta


def _float32_rows(x, skip, gamma, beta, bias) -> bool:
    """Whether the norm is `_skip_norm_float32`'s: float32 throughout, skip of x's shape, every
    array C-contiguous (a decode step's rows, read and written as they are)."""
    return (x.dtype == _FLOAT32 and skip.dtype == _FLOAT32 and gamma.dtype == _FLOAT32 and skip.shape == x.shape
            and x.flags.c_contiguous and skip.flags.c_contiguous and gamma.flags.c_contiguous
            and gamma.size == x.shape[-1] and (beta is None or (beta.dtype == _FLOAT32 and beta.flags.c_contiguous
                                                               and beta.size == x.shape[-1]))
            and (bias is None or (bias.dtype == _FLOAT32 and bias.flags.c_contiguous and bias.size == x.shape[-1])))


def _skip_norm_float32(x, skip, gamma, beta, bias, epsilon, simplified, output_count):
    """`skip_norm` of float32 rows: `skip_norm_rows` writing the outputs themselves, a prompt's rows
    shared among runnx's threads (`share_rows`: each row alone, the same bits)."""
    width = x.shape[-1]
    rows = x.size // width
    out, total = np.empty(x.shape, _FLOAT32), np.empty(x.shape, _FLOAT32)
    stats_shape = x.shape[:-1] + (1,)
    mean, inv_std = np.empty(stats_shape, _FLOAT32), np.empty(stats_shape, _FLOAT32)
    settle()  # x or skip may be a pool job's output
    arguments = (x.reshape(rows, width), skip.reshape(rows, width), _NONE32 if bias is None else bias.reshape(width),
                 gamma.reshape(width), _NONE32 if beta is None else beta.reshape(width), float(epsilon), simplified,
                 out.reshape(rows, width), total.reshape(rows, width), mean.reshape(rows), inv_std.reshape(rows))
    if rows * width < SHARED_FROM:  # (a decode step's row: one call, nothing cut)
        skip_norm_rows(*arguments)
    else:
        share_rows(functools.partial(_skip_norm_range, *arguments), rows, width)
    return (out, mean, inv_std, total)[:output_count] if output_count > 1 else out


def _skip_norm_range(x, skip, bias, gamma, beta, epsilon: float, simplified: bool, out, total, mean, inv_std,
                     start: int, stop: int) -> None:
    """`skip_norm_rows` of rows start .. stop (skip has x's rows)."""
    at = slice(start, stop)
    skip_norm_rows(x[at], skip[at], bias, gamma, beta, epsilon, simplified, out[at], total[at], mean[at], inv_std[at])


def skip_norm(op, x, skip, gamma, beta, bias, epsilon, simplified, output_count):
    """(norm, mean, inv_std, sum)[:output_count] (the norm alone for one) of onnxruntime's skip norms
    of x + skip [+ bias], named `op` in errors: LayerNorm, or RMSNorm when `simplified`."""
    if x.ndim < 2:
        raise RunnxError(f"{op}: input must be at least 2-D (rows, hidden), got shape {list(x.shape)}")
    if x.size and _float32_rows(x, skip, gamma, beta, bias):
        return _skip_norm_float32(x, skip, gamma, beta, bias, epsilon, simplified, output_count)
    settle()
    width = x.shape[-1]
    rows = x.size // width if width else 0
    if skip.shape[-2:] != x.shape[-2:] or skip.size not in (x.size, width * x.shape[-2]):
        raise RunnxError(f"{op}: skip of shape {list(skip.shape)} does not fit input {list(x.shape)} (expected its "
                         f"shape or its last two dimensions)")
    work = _compute_dtype(x.dtype)
    rows_of = lambda a: np.ascontiguousarray(a, dtype=work).reshape(-1, width)  # noqa: E731
    out = np.empty((rows, width), work)
    total = np.empty((rows, width), work)
    mean, inv_std = np.empty(rows, work), np.empty(rows, work)
    skip_norm_rows(rows_of(x), rows_of(skip), _vector(bias, width, work, "bias", op),
                   _vector(gamma, width, work, "gamma", op), _vector(beta, width, work, "beta", op),
                   float(epsilon), simplified, out, total, mean, inv_std)
    stats_shape = x.shape[:-1] + (1,)
    results = (out.reshape(x.shape).astype(gamma.dtype if simplified else x.dtype, copy=False),
               np.zeros(stats_shape, np.float32) if simplified else mean.reshape(stats_shape).astype(np.float32),
               inv_std.reshape(stats_shape).astype(np.float32),
               total.reshape(x.shape).astype(x.dtype, copy=False))
    return results[:output_count] if output_count > 1 else results[0]


@register("SkipLayerNormalization", since=1, domain=DOMAIN, overlaps_jobs=True)
def SkipLayerNormalization(x, skip, gamma, beta=None, bias=None, *, epsilon: float = _SKIP_EPSILON, output_count):
    """(LayerNorm(x + skip + bias) * gamma + beta, mean, inv_std_var, x + skip + bias)."""
    return skip_norm("SkipLayerNormalization", x, skip, gamma, beta, bias, epsilon, False, output_count)


@register("SkipSimplifiedLayerNormalization", since=1, domain=DOMAIN, overlaps_jobs=True)
def SkipSimplifiedLayerNormalization(x, skip, gamma, bias=None, *, epsilon: float = _SKIP_EPSILON, output_count):
    """(RMSNorm(x + skip + bias) * gamma, mean (zeros: an RMS norm has none), inv_std_var, x + skip + bias)."""
    return skip_norm("SkipSimplifiedLayerNormalization", x, skip, gamma, None, bias, epsilon, True, output_count)


@register("SimplifiedLayerNormalization", since=1)
def SimplifiedLayerNormalization(x, scale, *, axis: int = -1, epsilon: float = 1e-5, stash_type: int = 1,
                                 output_count):
    """x / sqrt(mean(x^2) + epsilon) * scale over the axes from `axis` on (output in the scale's type)."""
    axis = axis + x.ndim if axis < 0 else axis
    if not 0 <= axis < x.ndim:
        raise RunnxError(f"SimplifiedLayerNormalization: axis {axis} out of range for rank {x.ndim}")
    width = int(np.prod(x.shape[axis:]))
    if scale.size != width:
        raise RunnxError(f"SimplifiedLayerNormalization: scale of shape {list(scale.shape)} does not match the "
                         f"normalised shape {list(x.shape[axis:])}")
    work = _compute_dtype(x.dtype)
    rows = x.size // width if width else 0
    out, total = np.empty((rows, width), work), np.empty((rows, width), work)
    mean, inv_std = np.empty(rows, work), np.empty(rows, work)
    skip_norm_rows(np.ascontiguousarray(x, dtype=work).reshape(rows, width), np.empty((0, width), work),
                   np.empty(0, work), np.ascontiguousarray(scale.reshape(width), dtype=work), np.empty(0, work),
                   float(epsilon), True, out, total, mean, inv_std)
    y = out.reshape(x.shape).astype(scale.dtype, copy=False)
    if output_count > 1:
        return y, inv_std.reshape(x.shape[:axis] + (1,) * (x.ndim - axis)).astype(np.float32)
    return y

