"""The self-attention KV cache: one buffer per KV tensor, grown in place by the model itself.

Each tensor is a prefix view `buffer[:, :, :length]` of a buffer `[batch, heads, capacity, head_dim]`.
`handover(new_tokens)` gives every view to the model as `runnx.Owned`, so the model's Concat writes
the new rows into the spare capacity; the model's `present.*` outputs are then the longer views of
the same buffers and become the cache (`accept`). When a buffer has no room for the next step it is
regrown here to double its capacity (amortised O(1) per token), so every step stays in place; a
runtime that returned fresh arrays instead (in-place execution off) is not given copies it would
not use.
"""
from __future__ import annotations

import numpy as np

from runnx.capture.capacity import allocate_prefix, whole_buffer
from runnx.capture.ownership import Owned, storage_root
from runnx.errors import RunnxError

SEQUENCE_AXIS = 2  # [batch, kv_heads, sequence, head_dim], the layout of every Optimum export


class KVCache:
    """Named KV tensors of equal length along the sequence axis (past input name -> array)."""

    def __init__(self, arrays: dict[str, np.ndarray], *, zeroed: bool = False):
        self.arrays = dict(arrays)
        # each tensor's whole buffer, of which it is a prefix view (None: no room known): a step
        # then reads the room and hands buffers over without asking numpy where views start
        self._buffers = {name: whole_buffer(array, SEQUENCE_AXIS) for name, array in self.arrays.items()}
        # buffers' spare rows zero, not uninitialised: a model reading whole buffers (handover(whole=
        # True)) masks the rows past each sequence's length, and a mask cannot hide a NaN
        self.zeroed = zeroed
        self.regrowths = 0  # buffers copied to a larger one (0 when everything appended in place)
        self.appended_in_place = True  # did the last step write into the buffers it was handed?
        self._handed_over = False

    @classmethod
    def empty(cls, shapes: dict[str, tuple], dtypes: dict[str, np.dtype], capacity: int, *,
              zeroed: bool = False) -> "KVCache":
        """Length-0 views of fresh buffers with `capacity` rows; `shapes` give [batch, heads, 0, head_dim]."""
        return cls({name: _allocate(tuple(shape), capacity, dtypes[name], zeroed) for name, shape in shapes.items()},
                   zeroed=zeroed)

    @classmethod
    def with_capacity(cls, arrays: dict[str, np.ndarray], capacity: int, *, zeroed: bool = False) -> "KVCache":
        """Copies of `arrays` in buffers with room for `capacity` rows (used after a prefill that
        returned exact-size arrays, or when restoring a saved state)."""
        return cls({name: _copy_into_buffer(array, max(capacity, array.shape[SEQUENCE_AXIS]), zeroed)
                    for name, array in arrays.items()}, zeroed=zeroed)

    @property
    def length(self) -> int:
        if not self.arrays:
            return 0
        return next(iter(self.arrays.values())).shape[SEQUENCE_AXIS]

    @property
    def capacity(self) -> int:
        """The smallest room (rows) of any buffer: how long the cache can grow without a copy."""
        return min((self._rows(name) for name in self.arrays), default=0)

    def _rows(self, name: str) -> int:
        """Rows the buffer of tensor `name` holds, filled or not."""
        buffer = self._buffers[name]
        return (buffer if buffer is not None else self.arrays[name]).shape[SEQUENCE_AXIS]

    def reserve(self, rows: int) -> None:
        """Make room for `rows` more rows in every buffer, doubling the capacity when short."""
        for name, array in self.arrays.items():
            length, current = array.shape[SEQUENCE_AXIS], self._rows(name)
            if current - length < rows:
                view = _copy_into_buffer(array, max(2 * current, length + rows, 1), self.zeroed)
                self.arrays[name], self._buffers[name] = view, view.base
                self.regrowths += 1

    def handover(self, new_tokens: int, *, whole: bool = False) -> dict[str, Owned]:
        """The feeds for one step appending `new_tokens` rows. The buffers become the model's until
        `accept` receives its outputs: the cache must not be read in between. `whole` hands over
        each whole buffer instead of its filled prefix (a model sharing one buffer between past and
        present, onnxruntime-genai's `past_present_share_buffer`, writes the new rows at each
        sequence's length and returns the buffer itself)."""
        if self._handed_over:
            raise RunnxError("KV cache already handed over: accept() the step's outputs first")
        if self.appended_in_place:
            self.reserve(new_tokens)
        self._handed_over = True
        if whole:
            buffers = self._buffers
            return {name: Owned(array if buffers[name] is None else buffers[name])
                    for name, array in self.arrays.items()}
        return {name: Owned(array) for name, array in self.arrays.items()}

    def accept(self, arrays: dict[str, np.ndarray], length: int | None = None) -> None:
        """Take the model's present.* outputs (keyed by past input name) as the new cache; `length`
        keeps only that many rows of each (the filled part of whole buffers)."""
        if arrays.keys() != self.arrays.keys():
            raise RunnxError(f"KV cache update names {sorted(set(arrays) ^ set(self.arrays))} do not match")
        index = None if length is None else (slice(None),) * SEQUENCE_AXIS + (slice(0, length),)
        views, buffers, in_place = {}, {}, True
        for name, array in arrays.items():
            buffer = self._buffers[name]
            if buffer is None or array is not buffer:  # (a whole buffer handed back is its own buffer)
                if index is not None:
                    array = array[index]
                in_place = in_place and storage_root(array) is storage_root(self.arrays[name])
                buffer = whole_buffer(array, SEQUENCE_AXIS)
            elif index is not None:
                array = array[index]
            views[name], buffers[name] = array, buffer
        self.appended_in_place = in_place
        self.arrays, self._buffers = views, buffers
        self._handed_over = False

    def copy_arrays(self) -> dict[str, np.ndarray]:
        """Exact-size copies of the current tensors (for saving; the buffers stay the cache's)."""
        return {name: np.ascontiguousarray(array) for name, array in self.arrays.items()}


def _allocate(shape: tuple, capacity: int, dtype, zeroed: bool) -> np.ndarray:
    return allocate_prefix(shape, SEQUENCE_AXIS, capacity, dtype, zeroed)


def _copy_into_buffer(array: np.ndarray, capacity: int, zeroed: bool = False) -> np.ndarray:
    view = _allocate(array.shape, capacity, array.dtype, zeroed)
    view[...] = array
    return view
