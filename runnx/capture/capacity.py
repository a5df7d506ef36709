"""Capacity buffers: a tensor with spare room along an axis is a prefix view of a larger buffer.

`buf[:, :, :S]` of `buf[B, H, Smax, D]` can grow to `buf[:, :, :S+n]` by writing only the n new
rows: this is how a KV cache is extended in O(new tokens) instead of re-copied every step.
"""
from __future__ import annotations

import numba
import numpy as np

from runnx.capture.ownership import Owned
from runnx.interp.model_file import in_small_pages
from runnx.ops import _jit_cache  # noqa: F401  (numba caches this module's kernels under RUNNX_CACHE)
from runnx.ops import _native


def _room(view, buffer, axis, same_start):
    """`prefix_room` once whether the view starts where the buffer does is known (Python's, while
    compiled kernels are off: `runnx/ops/_native.py`; compiled into `prefix_room`)."""
    if not same_start:
        return -1
    for a in range(view.ndim):
        if view.strides[a] != buffer.strides[a] or (a != axis and view.shape[a] != buffer.shape[a]):
            return -1
    return buffer.shape[axis] - view.shape[axis]


_compiled_room = numba.njit(cache=True)(_room)


@numba.njit(cache=True)
def prefix_room(view, buffer, axis):
    """Rows `view` can grow by along `axis` inside `buffer` when it is a prefix view of it (same
    start, strides and other dimensions), else -1; arrays of one rank and dtype. numba: numpy's own
    `.ctypes.data` costs ~2 us, and fused kernels appending to a cache call this directly."""
    return _compiled_room(view, buffer, axis, view.ctypes.data == buffer.ctypes.data)


# dtypes numba types arrays of; `spare_capacity` reads others (float16, ml_dtypes' narrow floats) as the
# unsigned integers of their size, the layout being all it compares
_NUMBA_TYPED = frozenset("?bBhHiIlLqQefdFD") - {"e"}
_UINTS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _axis(array: np.ndarray, axis: int) -> int:
    if not -array.ndim <= axis < array.ndim:
        raise ValueError(f"axis {axis} out of range for a tensor of rank {array.ndim}")
    return axis % array.ndim


def allocate_prefix(shape: tuple, axis: int, capacity: int, dtype, zeroed: bool = False) -> np.ndarray:
    """An uninitialised (or zeroed) buffer with `capacity` rows along `axis`, as a prefix view of
    `shape`. Its untouched pages cost no memory, and come in 4 KiB pages as rows are written
    (`model_file.in_small_pages`: a huge page at first touch may wait for a virtual machine's host)."""
    buffer_shape = list(shape)
    buffer_shape[axis] = max(capacity, shape[axis])
    buffer = (np.zeros if zeroed else np.empty)(buffer_shape, dtype=dtype)
    in_small_pages(buffer)
    return buffer[(slice(None),) * axis + (slice(0, shape[axis]),)]


def with_capacity(array, axis: int, capacity: int) -> Owned:
    """Copy `array` into a new buffer with room for `capacity` rows along `axis`, handed over
    as `Owned` so that runnx can append to it in place (e.g. a KV cache: axis=2)."""
    array = np.asarray(array)
    axis = _axis(array, axis)
    view = allocate_prefix(array.shape, axis, capacity, array.dtype)
    view[...] = array
    return Owned(view)


def spare_capacity(view: np.ndarray, axis: int) -> int:
    """How many rows can be appended to `view` along `axis` inside its buffer (0 if it is not a
    prefix view of a larger buffer)."""
    buffer = view.base
    if type(buffer) is not np.ndarray or buffer.ndim != view.ndim or buffer.dtype != view.dtype:
        return 0
    if _native.enabled and view.size:  # an empty view (a first prompt's past) is typed C-contiguous, a
        # prefix of rows not: Python's check below spares a first prompt a second compiled signature's load
        if view.dtype.char not in _NUMBA_TYPED:  # float16, bfloat16, ...: the same bytes as integers
            view, buffer = view.view(_UINTS[view.itemsize]), buffer.view(_UINTS[view.itemsize])
        return max(prefix_room(view, buffer, axis), 0)
    start = view.__array_interface__["data"][0] == buffer.__array_interface__["data"][0]
    return max(_room(view, buffer, axis, start), 0)


def whole_buffer(view: np.ndarray, axis: int) -> np.ndarray | None:
    """The whole buffer `view` is a prefix of along `axis` (its base, `spare_capacity` rows longer),
    or None when it has no spare room in one."""
    return view.base if spare_capacity(view, axis) > 0 else None


def write_rows(buffer: np.ndarray, axis: int, start: int, rows: np.ndarray) -> None:
    """buffer[..., start:start+n, ...] = rows along `axis`."""
    index = (slice(None),) * axis + (slice(start, start + rows.shape[axis]),)
    buffer[index] = rows


def append_in_place(view: np.ndarray, parts, axis: int) -> np.ndarray | None:
    """Write `parts` after `view` inside its buffer and return the longer prefix view, or None
    when the buffer has no room (the caller then allocates)."""
    start = view.shape[axis]
    stop = start + sum([p.shape[axis] for p in parts])
    if spare_capacity(view, axis) < stop - start:
        return None
    buffer = view.base
    lead = (slice(None),) * axis
    for part in parts:
        end = start + part.shape[axis]
        buffer[lead + (slice(start, end),)] = part
        start = end
    return buffer[lead + (slice(0, stop),)]


def concatenate_with_headroom(parts, axis: int) -> np.ndarray:
    """np.concatenate into a buffer with twice the rows, so the next appends are in place
    (amortised doubling). Untouched pages of a large buffer cost no memory."""
    first = parts[0]
    total = sum(p.shape[axis] for p in parts)
    shape = first.shape[:axis] + (total,) + first.shape[axis + 1:]
    view = allocate_prefix(shape, axis, 2 * total, np.result_type(*parts))
    start = 0
    for part in parts:
        write_rows(view.base, axis, start, part)
        start += part.shape[axis]
    return view
