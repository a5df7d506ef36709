"""Reductions: the Reduce* family, ArgMax/ArgMin, CumSum/CumProd.

The Reduce* ops take their axes as an attribute up to opset 12 (ReduceSum) or 17 (the others) and
as an optional input afterwards, where `noop_with_empty_axes=1` turns "no axes" into reducing over
nothing (each element then gets the op's elementwise part, e.g. ReduceL1 gives |x|). Sums and
means accumulate in the input's dtype, like the ONNX reference; an empty reduction gives the op's
identity (0 for sums, 1 for the product, -inf/+inf or the dtype's extremes for Max/Min).
"""
from __future__ import annotations

import numpy as np

from runnx.errors import RunnxError
from runnx.ops.registry import register


def _axes_tuple(data, axes, noop_with_empty_axes):
    """numpy's `axis`: None (all axes), () (none) or a tuple of non-negative axes."""
    if axes is not None and not isinstance(axes, tuple):
        axes = tuple(int(a) for a in np.asarray(axes).reshape(-1))
    if not axes:
        return () if noop_with_empty_axes else None
    rank = data.ndim
    for axis in axes:
        if not -rank <= axis < max(rank, 1):
            raise RunnxError(f"reduction axis {axis} is out of range for rank {rank}")
    return tuple(sorted(a + rank if a < 0 else a for a in axes))


def _reduce(reducer, data, axes, keepdims, noop_with_empty_axes=0):
    axis = _axes_tuple(data, axes, noop_with_empty_axes)
    result = reducer(data, axis, bool(keepdims))
    return np.asarray(result).astype(data.dtype, copy=False)


def _extreme(ufunc, empty_value):
    """A max/min reducer; numpy has no identity for them, so empty reductions get `empty_value`."""

    def reduce(data, axis, keepdims):
        if data.size == 0:
            shape = np.sum(data, axis=axis, keepdims=keepdims).shape
            return np.full(shape, empty_value(data.dtype), dtype=data.dtype)
        return ufunc.reduce(data, axis=axis, keepdims=keepdims)

    return reduce


def _lowest(dtype):
    if dtype == np.bool_:
        return False
    return np.iinfo(dtype).min if dtype.kind in "iu" else -np.inf


def _highest(dtype):
    if dtype == np.bool_:
        return True
    return np.iinfo(dtype).max if dtype.kind in "iu" else np.inf


def _sum(data, axis, keepdims):
    return np.sum(data, axis=axis, keepdims=keepdims, dtype=data.dtype)


def _mean(data, axis, keepdims):
    # np.mean's rule without its Python overhead: sum in the input dtype, divide (integers truncate)
    total = np.asarray(_sum(data, axis, keepdims))
    count = data.size // max(total.size, 1) if data.size else 0
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.true_divide(total, count, out=total, casting="unsafe")


def _prod(data, axis, keepdims):
    return np.prod(data, axis=axis, keepdims=keepdims, dtype=data.dtype)


def _l1(data, axis, keepdims):
    return _sum(np.abs(data), axis, keepdims)


def _sum_square(data, axis, keepdims):
    return _sum(np.square(data), axis, keepdims)


def _l2(data, axis, keepdims):
    if data.dtype.kind in "iu":  # squares of integers overflow their type long before the root does
        data = data.astype(np.float64)
    return np.sqrt(_sum_square(data, axis, keepdims))


def _log_sum(data, axis, keepdims):
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.log(_sum(data, axis, keepdims))


def _log_sum_exp(data, axis, keepdims):
    if data.size == 0:
        return np.full(np.sum(data, axis=axis, keepdims=keepdims).shape, -np.inf, dtype=data.dtype)
    # shift by the finite maximum so exp cannot overflow; infinities pass through exp unchanged
    finite = np.where(np.isinf(data), -np.inf, data)
    shift = np.max(finite, axis=axis, keepdims=True)
    shift = np.where(np.isfinite(shift), shift, 0).astype(data.dtype)
    with np.errstate(divide="ignore", over="ignore"):
        total = np.sum(np.exp(data - shift), axis=axis, keepdims=True, dtype=data.dtype)
        result = np.log(total) + shift
    if not keepdims:
        result = result.reshape(np.sum(data, axis=axis).shape)
    return result


_max = _extreme(np.maximum, _lowest)
_min = _extreme(np.minimum, _highest)


# --- axes as an attribute (up to opset 12 / 17) ---------------------------------------------------


@register("ReduceSum", since=1)
def ReduceSum(data, *, axes: tuple[int, ...] | None = None, keepdims: int = 1):
    return _reduce(_sum, data, axes, keepdims)


@register("ReduceMean", since=1)
def ReduceMean(data, *, axes: tuple[int, ...] | None = None, keepdims: int = 1):
    return _reduce(_mean, data, axes, keepdims)


@register("ReduceProd", since=1)
def ReduceProd(data, *, axes: tuple[int, ...] | None = None, keepdims: int = 1):
    return _reduce(_prod, data, axes, keepdims)


@register("ReduceMax", since=1)
def ReduceMax(data, *, axes: tuple[int, ...] | None = None, keepdims: int = 1):
    return _reduce(_max, data, axes, keepdims)


@register("ReduceMin", since=1)
def ReduceMin(data, *, axes: tuple[int, ...] | None = None, keepdims: int = 1):
    return _reduce(_min, data, axes, keepdims)


@register("ReduceL1", since=1)
def ReduceL1(data, *, axes: tuple[int, ...] | None = None, keepdims: int = 1):
    return _reduce(_l1, data, axes, keepdims)


@register("ReduceL2", since=1)
def ReduceL2(data, *, axes: tuple[int, ...] | None = None, keepdims: int = 1):
    return _reduce(_l2, data, axes, keepdims)


@register("ReduceSumSquare", since=1)
def ReduceSumSquare(data, *, axes: tuple[int, ...] | None = None, keepdims: int = 1):
    return _reduce(_sum_square, data, axes, keepdims)


@register("ReduceLogSum", since=1)
def ReduceLogSum(data, *, axes: tuple[int, ...] | None = None, keepdims: int = 1):
    return _reduce(_log_sum, data, axes, keepdims)


@register("ReduceLogSumExp", since=1)
def ReduceLogSumExp(data, *, axes: tuple[int, ...] | None = None, keepdims: int = 1):
    return _reduce(_log_sum_exp, data, axes, keepdims)


# --- axes as an optional input (ReduceSum from 13, the others from 18) -----------------------------


@register("ReduceSum", since=13)
def ReduceSum_13(data, axes=None, *, keepdims: int = 1, noop_with_empty_axes: int = 0):
    return _reduce(_sum, data, axes, keepdims, noop_with_empty_axes)


@register("ReduceMean", since=18)
def ReduceMean_18(data, axes=None, *, keepdims: int = 1, noop_with_empty_axes: int = 0):
    return _reduce(_mean, data, axes, keepdims, noop_with_empty_axes)


@register("ReduceProd", since=18)
def ReduceProd_18(data, axes=None, *, keepdims: int = 1, noop_with_empty_axes: int = 0):
    return _reduce(_prod, data, axes, keepdims, noop_with_empty_axes)


@register("ReduceMax", since=18)
def ReduceMax_18(data, axes=None, *, keepdims: int = 1, noop_with_empty_axes: int = 0):
    return _reduce(_max, data, axes, keepdims, noop_with_empty_axes)


@register("ReduceMin", since=18)
def ReduceMin_18(data, axes=None, *, keepdims: int = 1, noop_with_empty_axes: int = 0):
    return _reduce(_min, data, axes, keepdims, noop_with_empty_axes)


@register("ReduceL1", since=18)
def ReduceL1_18(data, axes=None, *, keepdims: int = 1, noop_with_empty_axes: int = 0):
    return _reduce(_l1, data, axes, keepdims, noop_with_empty_axes)


@register("ReduceL2", since=18)
def ReduceL2_18(data, axes=None, *, keepdims: int = 1, noop_with_empty_axes: int = 0):
    return _reduce(_l2, data, axes, keepdims, noop_with_empty_axes)


@register("ReduceSumSquare", since=18)
def ReduceSumSquare_18(data, axes=None, *, keepdims: int = 1, noop_with_empty_axes: int = 0):
    return _reduce(_sum_square, data, axes, keepdims, noop_with_empty_axes)


@register("ReduceLogSum", since=18)
def ReduceLogSum_18(data, axes=None, *, keepdims: int = 1, noop_with_empty_axes: int = 0):
    return _reduce(_log_sum, data, axes, keepdims, noop_with_empty_axes)


@register("ReduceLogSumExp", since=18)
def ReduceLogSumExp_18(data, axes=None, *, keepdims: int = 1, noop_with_empty_axes: int = 0):
    return _reduce(_log_sum_exp, data, axes, keepdims, noop_with_empty_axes)


# --- index of the extreme ----------------------------------------------------------------------------


def _arg_extreme(arg_function, data, axis, keepdims, select_last_index):
    if select_last_index:
        # the first extreme of the reversed axis is the last one of the original
        flipped = arg_function(np.flip(data, axis), axis=axis, keepdims=bool(keepdims))
        index = data.shape[axis] - 1 - flipped
    else:
        index = arg_function(data, axis=axis, keepdims=bool(keepdims))
    return np.asarray(index, dtype=np.int64)


@register("ArgMax", since=1)
def ArgMax(data, *, axis: int = 0, keepdims: int = 1):
    return _arg_extreme(np.argmax, data, axis, keepdims, 0)


@register("ArgMax", since=12)
def ArgMax_12(data, *, axis: int = 0, keepdims: int = 1, select_last_index: int = 0):
    return _arg_extreme(np.argmax, data, axis, keepdims, select_last_index)


@register("ArgMin", since=1)
def ArgMin(data, *, axis: int = 0, keepdims: int = 1):
    return _arg_extreme(np.argmin, data, axis, keepdims, 0)


@register("ArgMin", since=12)
def ArgMin_12(data, *, axis: int = 0, keepdims: int = 1, select_last_index: int = 0):
    return _arg_extreme(np.argmin, data, axis, keepdims, select_last_index)


# --- running totals -------------------------------------------------------------------------------


def _scan(ufunc, x, axis, exclusive, reverse, identity):
    """ufunc.accumulate along axis (given as a 0-d or 1-element tensor), optionally exclusive and/or
    from the end, in x's dtype."""
    axis = int(np.asarray(axis).reshape(-1)[0])
    if not -x.ndim <= axis < x.ndim:
        raise RunnxError(f"axis {axis} is out of range for rank {x.ndim}")
    work = np.flip(x, axis) if reverse else x
    result = ufunc.accumulate(work, axis=axis, dtype=x.dtype)
    if exclusive:
        # shift by one: element i gets the total of the elements before it
        shifted = np.full_like(result, identity)
        body = [slice(None)] * x.ndim
        head = list(body)
        body[axis], head[axis] = slice(1, None), slice(None, -1)
        shifted[tuple(body)] = result[tuple(head)]
        result = shifted
    return np.flip(result, axis) if reverse else result


@register("CumSum", since=11)
def CumSum(x, axis, *, exclusive: int = 0, reverse: int = 0):
    return _scan(np.add, x, axis, exclusive, reverse, 0)


@register("CumProd", since=26)
def CumProd(x, axis, *, exclusive: int = 0, reverse: int = 0):
    return _scan(np.multiply, x, axis, exclusive, reverse, 1)
