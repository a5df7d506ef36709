"""Indexing: Gather*, Scatter*, OneHot, Compress, NonZero, Trilu, Unique, ReverseSequence, TopK.

Indices are checked and made non-negative in one place (`checked_indices`), so an index out of
range is a clear RunnxError rather than numpy's wrap-around or IndexError. The scatters write
into `data` when the executor grants it (owned and dead afterwards) instead of copying it first.
"""
from __future__ import annotations

import numpy as np

from runnx.errors import RunnxError
from runnx.ops._shape_util import checked_index, checked_indices, int_values, normalize_axis, scalar_value
from runnx.ops.registry import register


@register("Gather", since=1)
def Gather(data, indices, *, axis: int = 0):
    axis = normalize_axis(axis, data.ndim)
    if type(indices) is np.ndarray and indices.ndim == 0 and indices.dtype.kind in "iu":  # shape bookkeeping
        return data[(slice(None),) * axis + (checked_index(int(indices), data.shape[axis]),)]
    positions = checked_indices(indices, data.shape[axis])
    if positions.ndim == 0:  # one index: a view, like numpy basic indexing
        return data[(slice(None),) * axis + (int(positions),)]
    return np.take(data, positions, axis=axis)


def _element_index(indices, axis: int, shape) -> tuple:
    """Index tuple addressing, for every position of `indices`, data[..., indices[pos], ...] at `axis`."""
    grid = list(np.indices(indices.shape, sparse=True))
    grid[axis] = checked_indices(indices, shape[axis])
    return tuple(grid)


@register("GatherElements", since=11)
def GatherElements(data, indices, *, axis: int = 0):
    axis = normalize_axis(axis, data.ndim)
    if indices.ndim != data.ndim:
        raise RunnxError(f"GatherElements indices of rank {indices.ndim} do not match data of rank {data.ndim}")
    return data[_element_index(indices, axis, data.shape)]


def _nd_index(indices, shape) -> tuple:
    """The index tuple of GatherND/ScatterND: the last axis of `indices` addresses leading data axes."""
    depth = indices.shape[-1]
    if depth > len(shape):
        raise RunnxError(f"indices address {depth} axes of a rank-{len(shape)} tensor")
    return tuple(checked_indices(indices[..., i], shape[i]) for i in range(depth))


@register("GatherND", since=11)
def GatherND_11(data, indices):
    return GatherND(data, indices)


@register("GatherND", since=12)
def GatherND(data, indices, *, batch_dims: int = 0):
    if batch_dims == 0:
        return data[_nd_index(indices, data.shape)]
    batch_shape = data.shape[:batch_dims]
    if indices.shape[:batch_dims] != batch_shape:
        raise RunnxError(f"GatherND batch dims {indices.shape[:batch_dims]} differ from data's {batch_shape}")
    batches = int(np.prod(batch_shape))
    flat_data = data.reshape(batches, *data.shape[batch_dims:])
    flat_indices = indices.reshape(batches, -1, indices.shape[-1])
    index = _nd_index(flat_indices, flat_data.shape[1:])
    gathered = flat_data[(np.arange(batches)[:, None], *index)]
    return gathered.reshape(*indices.shape[:-1], *gathered.shape[2:])


_REDUCTIONS = {"add": np.add, "mul": np.multiply, "max": np.maximum, "min": np.minimum}


def _scatter(data, index: tuple, updates, reduction: str, overwrite):
    target = data if 0 in overwrite and data.flags.writeable else data.copy()
    if reduction == "none":
        target[index] = updates
        return target
    if reduction not in _REDUCTIONS:
        raise RunnxError(f"reduction '{reduction}' is not one of none, {', '.join(_REDUCTIONS)}")
    _REDUCTIONS[reduction].at(target, index, updates)  # .at applies repeated indices one by one
    return target


def _scatter_elements(data, indices, updates, axis: int, reduction: str, overwrite):
    axis = normalize_axis(axis, data.ndim)
    if indices.shape != updates.shape or indices.ndim != data.ndim:
        raise RunnxError(f"scatter indices {indices.shape} and updates {updates.shape} do not fit data {data.shape}")
    return _scatter(data, _element_index(indices, axis, data.shape), updates, reduction, overwrite)


@register("Scatter", since=9, inplace=(0,))
def Scatter(data, indices, updates, *, axis: int = 0, overwrite=()):
    return _scatter_elements(data, indices, updates, axis, "none", overwrite)


@register("ScatterElements", since=11, inplace=(0,))
def ScatterElements_11(data, indices, updates, *, axis: int = 0, overwrite=()):
    return _scatter_elements(data, indices, updates, axis, "none", overwrite)


@register("ScatterElements", since=16, inplace=(0,))
def ScatterElements(data, indices, updates, *, axis: int = 0, reduction: str = "none", overwrite=()):
    return _scatter_elements(data, indices, updates, axis, reduction, overwrite)


@register("ScatterND", since=11, inplace=(0,))
def ScatterND_11(data, indices, updates, *, overwrite=()):
    return ScatterND(data, indices, updates, overwrite=overwrite)


@register("ScatterND", since=16, inplace=(0,))
def ScatterND(data, indices, updates, *, reduction: str = "none", overwrite=()):
    index = _nd_index(indices, data.shape)
    expected = indices.shape[:-1] + data.shape[indices.shape[-1]:]
    if updates.shape != expected:
        raise RunnxError(f"ScatterND updates have shape {updates.shape}, expected {expected}")
    return _scatter(data, index, updates, reduction, overwrite)


@register("OneHot", since=9)
def OneHot(indices, depth, values, *, axis: int = -1, ctx):
    depth = int(scalar_value(depth, "OneHot depth"))
    if depth < 1 or values.size != 2:
        raise RunnxError(f"OneHot needs a positive depth and two values, got {depth} and {values.size}")
    axis = normalize_axis(axis, indices.ndim + 1)
    ctx.check_elements(indices.shape + (depth,), "OneHot output")
    positions = indices.astype(np.int64)
    positions = np.where(positions < 0, positions + depth, positions)  # out of range stays all "off"
    hot = positions[..., None] == np.arange(depth)
    off, on = values.reshape(-1)
    return np.moveaxis(np.where(hot, on, off).astype(values.dtype, copy=False), -1, axis)


@register("Compress", since=9)
def Compress(data, condition, *, axis: int | None = None):
    condition = condition.reshape(-1).astype(bool, copy=False)
    if axis is None:
        data = data.reshape(-1)
        axis = 0
    axis = normalize_axis(axis, data.ndim)
    if condition.size > data.shape[axis]:
        if condition[data.shape[axis]:].any():
            raise RunnxError(f"Compress condition selects past the end of axis {axis} ({data.shape[axis]})")
        condition = condition[:data.shape[axis]]
    return np.compress(condition, data, axis=axis)


@register("NonZero", since=9)
def NonZero(x):
    if x.ndim == 0:  # numpy no longer defines nonzero of a 0-D array
        return np.zeros((0, int(bool(x))), dtype=np.int64)
    return np.array(np.nonzero(x), dtype=np.int64).reshape(x.ndim, -1)


@register("Trilu", since=14, inplace=(0,))
def Trilu(x, k=None, *, upper: int = 1, overwrite=()):
    """Zeroes below (upper=1) or above the k-th diagonal of the last two axes; in place when granted."""
    if x.ndim < 2:
        raise RunnxError(f"Trilu needs at least 2 dimensions, got shape {x.shape}")
    diagonal = 0 if k is None else int(scalar_value(k, "Trilu k"))
    rows, cols = x.shape[-2:]
    # np.tri(..., d) marks column <= row + d
    cleared = np.tri(rows, cols, diagonal - 1, dtype=bool) if upper else ~np.tri(rows, cols, diagonal, dtype=bool)
    result = x if 0 in overwrite and x.flags.writeable else x.copy()
    result[..., cleared] = 0
    return result


@register("Unique", since=11)
def Unique(x, *, axis: int | None = None, sorted: int = 1):
    if axis is not None:
        axis = normalize_axis(axis, x.ndim)
    values, first, inverse, counts = np.unique(x if axis is not None else x.reshape(-1), axis=axis,
                                               return_index=True, return_inverse=True, return_counts=True)
    inverse = inverse.reshape(-1)
    if not sorted:  # order of first occurrence
        order = np.argsort(first, kind="stable")
        rank = np.empty_like(order)
        rank[order] = np.arange(order.size)
        values = np.take(values, order, axis=0 if axis is None else axis)
        first, counts, inverse = first[order], counts[order], rank[inverse]
    return values, first.astype(np.int64), inverse.astype(np.int64), counts.astype(np.int64)


@register("ReverseSequence", since=10)
def ReverseSequence(x, sequence_lens, *, batch_axis: int = 1, time_axis: int = 0):
    batch_axis, time_axis = normalize_axis(batch_axis, x.ndim), normalize_axis(time_axis, x.ndim)
    lengths = int_values(sequence_lens)
    if len(lengths) != x.shape[batch_axis] or any(not 0 <= n <= x.shape[time_axis] for n in lengths):
        raise RunnxError(f"ReverseSequence lengths {lengths} do not fit shape {x.shape}")
    result = x.copy()
    for batch, length in enumerate(lengths):
        index = [slice(None)] * x.ndim
        index[batch_axis] = batch
        index[time_axis] = slice(0, length)
        prefix = tuple(index)
        index[time_axis] = slice(length - 1, None, -1) if length else slice(0, 0)
        result[prefix] = x[tuple(index)]
    return result


def _top_k(x, k: int, axis: int, largest: int):
    """The k largest (or smallest) along `axis`, always sorted (also allowed when sorted=0)."""
    axis = normalize_axis(axis, x.ndim)
    size = x.shape[axis]
    if not 0 <= k <= size:
        raise RunnxError(f"TopK k={k} is out of range for a dimension of size {size}")
    if largest:
        # a stable ascending sort of the reversed axis, read backwards, ranks equal values by
        # ascending index (ONNX's tie rule) without negating (which unsigned types cannot)
        order = np.argsort(np.flip(x, axis), axis=axis, kind="stable")
        order = size - 1 - np.flip(order, axis)
    else:
        order = np.argsort(x, axis=axis, kind="stable")
    indices = np.take(order, np.arange(k), axis=axis)
    return np.take_along_axis(x, indices, axis=axis), indices.astype(np.int64, copy=False)


@register("TopK", since=1)
def TopK_1(x, *, axis: int = -1, k: int):
    return _top_k(x, k, axis, 1)


@register("TopK", since=10)
def TopK_10(x, k, *, axis: int = -1):
    return _top_k(x, int(scalar_value(k, "TopK k")), axis, 1)


@register("TopK", since=11)
def TopK(x, k, *, axis: int = -1, largest: int = 1, sorted: int = 1):
    return _top_k(x, int(scalar_value(k, "TopK k")), axis, largest)


@register("ArrayFeatureExtractor", since=1, domain="ai.onnx.ml")
def ArrayFeatureExtractor(x, indices):
    """The columns `indices` (flattened) of the last axis; a 1-D input gives one row [1, k]."""
    columns = checked_indices(indices.reshape(-1), x.shape[-1])
    selected = np.take(x, columns, axis=-1)
    return selected.reshape(1, -1) if x.ndim == 1 else selected
