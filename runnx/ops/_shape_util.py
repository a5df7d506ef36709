"""Helpers shared by the tensor-manipulation families (shape, indexing, creation, sequence)."""
from __future__ import annotations

import itertools
import weakref

import numpy as np

from runnx.errors import RunnxError


def normalize_axis(axis: int, rank: int, what: str = "axis") -> int:
    """`axis` in [-rank, rank) as a non-negative axis; RunnxError otherwise."""
    axis = int(axis)
    if not -rank <= axis < rank:
        raise RunnxError(f"{what} {axis} is out of range for rank {rank}")
    return axis + rank if axis < 0 else axis


def normalize_axes(axes, rank: int, what: str = "axes") -> list[int]:
    """Each axis normalized; repeated axes are an error."""
    result = [normalize_axis(a, rank, what) for a in axes]
    if len(set(result)) != len(result):
        raise RunnxError(f"{what} {list(axes)} repeat an axis")
    return result


_REMEMBERED_SIZE = 64  # elements: shape-like inputs
_remembered: dict[int, tuple] = {}  # id -> (weak reference to the array, its values) of small read-only arrays


def int_values(tensor) -> list[int] | None:
    """A 0-D or 1-D integer tensor input (shape, axes, pads, ...) as Python ints; None stays None.
    The values of small read-only arrays (constants, shape memos' results: the same arrays step
    after step) are remembered by identity, while the array lives (the entry goes with it, before
    its id can be another's). A caller's array reaches kernels as a view made for its run
    (validation.bind_feeds), never as the object the caller may write through between runs."""
    return None if tensor is None else list(int_tuple(tensor))


def int_tuple(tensor) -> tuple[int, ...]:
    """`int_values` of a tensor as a tuple: the remembered one itself, no copy (fused kernels'
    hashable keys)."""
    known = _remembered.get(id(tensor))
    if known is not None and known[0]() is tensor:
        return known[1]
    array = np.asarray(tensor)
    values = array.reshape(-1).tolist()  # Python ints for integer tensors, in one C call
    values = tuple(values) if array.dtype.kind in "iu" else tuple([int(v) for v in values])
    if array is tensor and not array.flags.writeable and array.size <= _REMEMBERED_SIZE:
        if len(_remembered) >= 4096:
            _remembered.clear()
        identity = id(tensor)
        _remembered[identity] = (weakref.ref(tensor, lambda _: _remembered.pop(identity, None)), values)
    return values


def scalar_value(tensor, what: str):
    """The single element of a scalar-like input (0-D or one element), as a Python number."""
    if type(tensor) is np.ndarray and tensor.size == 1:
        return tensor.item()
    array = np.asarray(tensor)
    if array.size != 1:
        raise RunnxError(f"{what} must hold exactly one element, got shape {array.shape}")
    return array.reshape(-1)[0].item()


def checked_index(index: int, size: int, what: str = "index") -> int:
    """One integer index in [-size, size) made non-negative; RunnxError outside."""
    if not -size <= index < size:
        raise RunnxError(f"{what} {index} is out of range for a dimension of size {size}")
    return index + size if index < 0 else index


def checked_indices(indices: np.ndarray, size: int, what: str = "index") -> np.ndarray:
    """Integer indices in [-size, size) made non-negative (int64); RunnxError for any outside."""
    indices = np.asarray(indices).astype(np.int64, copy=False)
    if not indices.size:
        return indices
    if indices.size <= 64:  # a few indices (positions of a decode step): Python's min and max are cheaper
        flat = indices.ravel().tolist()
        low, high = min(flat), max(flat)
    else:
        low, high = int(indices.min()), int(indices.max())
    checked_index(low, size, what)
    checked_index(high, size, what)
    return indices if low >= 0 else np.where(indices < 0, indices + size, indices)


def broadcast_shape(*shapes) -> tuple[int, ...]:
    """The numpy (= ONNX multidirectional) broadcast of `shapes`; RunnxError when incompatible."""
    try:
        return np.broadcast_shapes(*shapes)
    except ValueError:
        raise RunnxError(f"shapes {' and '.join(str(tuple(s)) for s in shapes)} do not broadcast") from None


def split_parts(data, axis: int, sizes, count: int) -> tuple:
    """Views of `data` cut along `axis`: of the given sizes, or `count` equal parts (the last
    smaller when the dimension does not divide evenly)."""
    axis = normalize_axis(axis, data.ndim)
    length = data.shape[axis]
    if sizes is None:
        if count < 1:
            raise RunnxError("Split needs at least one output")
        chunk = -(-length // count)
        sizes = [max(0, min(chunk, length - i * chunk)) for i in range(count)]
    elif sum(sizes) != length or any(s < 0 for s in sizes):
        raise RunnxError(f"split sizes {list(sizes)} do not add up to the dimension {length}")
    return tuple(np.split(data, list(itertools.accumulate(sizes))[:-1], axis=axis))
