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

    def __init__(self, arrays: dict[str, np.ndarray]):
        self.arrays = dict(arrays)
        self.regrowths = 0  # buffers copied to a larger one (0 when everything appended in place)
        self.appended_in_place = True  # did the last step write into the buffers it was handed?
        self._handed_over = False

    @classmethod
    def empty(cls, shapes: dict[str, tuple], dtypes: dict[str, np.dtype], capacity: int) -> "KVCache":
        """Length-0 views of fresh buffers with `capacity` rows; `shapes` give [batch, heads, 0, head_dim]."""
        return cls({name: allocate_prefix(tuple(shape), SEQUENCE_AXIS, capacity, dtypes[name])
                    for name, shape in shapes.items()})

    @classmethod
    def with_capacity(cls, arrays: dict[str, np.ndarray], capacity: int) -> "KVCache":
        """Copies of `arrays` in buffers with room for `capacity` rows (used after a prefill that
        returned exact-size arrays, or when restoring a saved state)."""
        return cls({name: _copy_into_buffer(array, max(capacity, array.shape[SEQUENCE_AXIS]))
                    for name, array in arrays.items()})

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
                self.arrays[name] = _copy_into_buffer(array, max(2 * current, needed, 1))
                self.regrowths += 1

    def handover(self, new_tokens: int) -> dict[str, Owned]:
        """The feeds for one step appending `new_tokens` rows. The buffers become the model's until
        `accept` receives its outputs: the cache must not be read in between."""
        if self._handed_over:
            raise RunnxError("KV cache already handed over: accept() the step's outputs first")
        if self.appended_in_place:
            self.reserve(new_tokens)
        self._handed_over = True
        return {name: Owned(array) for name, array in self.arrays.items()}

    def accept(self, arrays: dict[str, np.ndarray]) -> None:
        """Take the model's present.* outputs (keyed by past input name) as the new cache."""
        if arrays.keys() != self.arrays.keys():
            raise RunnxError(f"KV cache update names {sorted(set(arrays) ^ set(self.arrays))} do not match")
        self.appended_in_place = all(storage_root(array) is storage_root(self.arrays[name])
                                     for name, array in arrays.items())
        self.arrays = dict(arrays)
        self._handed_over = False

    def copy_arrays(self) -> dict[str, np.ndarray]:
        """Exact-size copies of the current tensors (for saving; the buffers stay the cache's)."""
        return {name: np.ascontiguousarray(array) for name, array in self.arrays.items()}


def _copy_into_buffer(array: np.ndarray, capacity: int) -> np.ndarray:
    view = allocate_prefix(array.shape, SEQUENCE_AXIS, capacity, array.dtype)
    view[...] = array
    return view
