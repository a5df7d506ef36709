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

from runnx.capture.capacity import allocate_prefix, spare_capacity
from runnx.capture.ownership import Owned, storage_root
from runnx.errors import RunnxError

SEQUENCE_AXIS = 2  # [batch, kv_heads, sequence, head_dim], the layout of every Optimum export


class KVCache:
    """Named KV tensors of equal length along the sequence axis (past input name -> array)."""

    def __init__(self, arrays: dict[str, np.ndarray], *, zeroed: bool = False):
        self.arrays = dict(arrays)
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
        return min((self.length + spare_capacity(a, SEQUENCE_AXIS) for a in self.arrays.values()), default=0)

    def reserve(self, rows: int) -> None:
        """Make room for `rows` more rows in every buffer, doubling the capacity when short."""
        for name, array in self.arrays.items():
            if spare_capacity(array, SEQUENCE_AXIS) < rows:
                needed = array.shape[SEQUENCE_AXIS] + rows
                current = array.shape[SEQUENCE_AXIS] + spare_capacity(array, SEQUENCE_AXIS)
                self.arrays[name] = _copy_into_buffer(array, max(2 * current, needed, 1), self.zeroed)
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
            return {name: Owned(_whole_buffer(array)) for name, array in self.arrays.items()}
        return {name: Owned(array) for name, array in self.arrays.items()}

    def accept(self, arrays: dict[str, np.ndarray], length: int | None = None) -> None:
        """Take the model's present.* outputs (keyed by past input name) as the new cache; `length`
        keeps only that many rows of each (the filled part of whole buffers)."""
        if arrays.keys() != self.arrays.keys():
            raise RunnxError(f"KV cache update names {sorted(set(arrays) ^ set(self.arrays))} do not match")
        if length is not None:
            index = (slice(None),) * SEQUENCE_AXIS + (slice(0, length),)
            arrays = {name: array[index] for name, array in arrays.items()}
        self.appended_in_place = all(storage_root(array) is storage_root(self.arrays[name])
                                     for name, array in arrays.items())
        self.arrays = dict(arrays)
        self._handed_over = False

    def copy_arrays(self) -> dict[str, np.ndarray]:
        """Exact-size copies of the current tensors (for saving; the buffers stay the cache's)."""
        return {name: np.ascontiguousarray(array) for name, array in self.arrays.items()}


def _whole_buffer(view: np.ndarray) -> np.ndarray:
    """The whole buffer a prefix view was cut from (the view itself when it has no spare room)."""
    if spare_capacity(view, SEQUENCE_AXIS) == 0:
        return view
    index = (slice(None),) * SEQUENCE_AXIS + (slice(0, view.shape[SEQUENCE_AXIS] + spare_capacity(view, SEQUENCE_AXIS)),)
    return view.base[index]


def _allocate(shape: tuple, capacity: int, dtype, zeroed: bool) -> np.ndarray:
    if not zeroed:
        return allocate_prefix(shape, SEQUENCE_AXIS, capacity, dtype)
    buffer_shape = list(shape)
    buffer_shape[SEQUENCE_AXIS] = max(capacity, shape[SEQUENCE_AXIS])
    return np.zeros(buffer_shape, dtype)[(slice(None),) * SEQUENCE_AXIS + (slice(0, shape[SEQUENCE_AXIS]),)]


def _copy_into_buffer(array: np.ndarray, capacity: int, zeroed: bool = False) -> np.ndarray:
    view = _allocate(array.shape, capacity, array.dtype, zeroed)
    view[...] = array
    return view
