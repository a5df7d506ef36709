"""Helpers shared by the tensor-manipulation families (shape, indexing, creation, sequence)."""
from __future__ import annotations

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


def int_values(tensor) -> list[int] | None:
    """A 0-D or 1-D integer tensor input (shape, axes, pads, ...) as Python ints; None stays None."""
    if tensor is None:
        return None
    return [int(v) for v in np.asarray(tensor).reshape(-1)]


def scalar_value(tensor, what: str):
    """The single element of a scalar-like input (0-D or one element), as a Python number."""
    array = np.asarray(tensor)
    if array.size != 1:
        raise RunnxError(f"{what} must hold exactly one element, got shape {array.shape}")
    return array.reshape(-1)[0].item()


def checked_indices(indices: np.ndarray, size: int, what: str = "index") -> np.ndarray:
    """Integer indices in [-size, size) made non-negative (int64); RunnxError for any outside."""
    indices = np.asarray(indices).astype(np.int64, copy=False)
    if indices.size:
        low, high = int(indices.min()), int(indices.max())
        if low < -size or high >= size:
            bad = low if low < -size else high
            raise RunnxError(f"{what} {bad} is out of range for a dimension of size {size}")
    return np.where(indices < 0, indices + size, indices)


def broadcast_shape(*shapes) -> tuple[int, ...]:
    """The numpy (= ONNX multidirectional) broadcast of `shapes`; RunnxError when incompatible."""
    try:
        return np.broadcast_shapes(*shapes)
    except ValueError:
        raise RunnxError(f"shapes {' and '.join(str(tuple(s)) for s in shapes)} do not broadcast") from None
