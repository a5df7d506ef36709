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

import sys

import numpy as np

from runnx.capture.capacity import allocate_prefix, whole_buffer
from runnx.capture.ownership import Owned, storage_root
from runnx.errors import RunnxError
from runnx.interp.model_file import faulted_in

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
        # the rows a whole-buffer model wrote (`accept`'s length), which a zeroed buffer kept for reuse
        # is zeroed again up to (`SpareBuffers`)
        self.rows_written = self.length
        self.regrowths = 0  # buffers copied to a larger one (0 when everything appended in place)
        self.appended_in_place = True  # did the last step write into the buffers it was handed?
        self._handed_over = False

    @classmethod
    def empty(cls, shapes: dict[str, tuple], dtypes: dict[str, np.dtype], capacity: int, *,
              zeroed: bool = False, spare: SpareBuffers | None = None) -> "KVCache":
        """Length-0 views of buffers with `capacity` rows, `spare`'s where they fit, else fresh;
        `shapes` give [batch, heads, 0, head_dim]."""
        spare = spare or SpareBuffers({})
        return cls({name: spare.take(name, tuple(shape), capacity, dtypes[name], zeroed)
                    for name, shape in shapes.items()}, zeroed=zeroed)

    @classmethod
    def with_capacity(cls, arrays: dict[str, np.ndarray], capacity: int, *, zeroed: bool = False,
                      spare: SpareBuffers | None = None) -> "KVCache":
        """Copies of `arrays` in buffers with room for `capacity` rows, `spare`'s where they fit
        (used after a prefill that returned exact-size arrays, or when restoring a saved state)."""
        spare = spare or SpareBuffers({})
        views = {}
        for name, array in arrays.items():
            view = views[name] = spare.take(name, array.shape, max(capacity, array.shape[SEQUENCE_AXIS]),
                                            array.dtype, zeroed)
            view[...] = array
        return cls(views, zeroed=zeroed)

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
        if length is not None:  # (a zeroed cache's rows, the model writing at each sequence's length)
            self.rows_written = max(self.rows_written, length)
        self._handed_over = False

    def spare(self) -> SpareBuffers:
        """The buffers, for the next prefill to take (`SpareBuffers`); the cache is not used after."""
        buffers = {} if self._handed_over else {name: buffer for name, buffer in self._buffers.items()
                                                 if buffer is not None}
        self.arrays, self._buffers = {}, {}
        return SpareBuffers(buffers, self.rows_written if self.zeroed else None)

    def copy_arrays(self) -> dict[str, np.ndarray]:
        """Exact-size copies of the current tensors (for saving; the buffers stay the cache's)."""
        return {name: np.ascontiguousarray(array) for name, array in self.arrays.items()}


FAULTED_ROWS = 256  # rows of a decoder's first cache faulted in at its load: a first prompt's, most often


class SpareBuffers:
    """A reset cache's buffers (or a decoder's first, made at its load: `made`), which the next
    prefill's cache takes where they are what it would allocate (shape, rows and dtype) and nothing
    else holds them.
    Why: glibc maps a fresh buffer of this size anew and hands it back when freed, so each prompt's
    first rows faulted its pages in again, one at a time: a 32-token prompt into SmolLM2's cache of
    600 rows took ~580 faults, none with its buffers taken again (1-3 ms of a two-thread prompt of
    60 ms; a decoder's first prompt, its buffers made at the load, ~360 fewer faults).
    `zeroed_rows`: the rows written since the buffers were zeroed (None: never zeroed)."""

    def __init__(self, buffers: dict[str, np.ndarray], zeroed_rows: int | None = None):
        self._buffers = dict(buffers)
        self._zeroed_rows = zeroed_rows
        self.taken = 0  # buffers reused (tests)

    @classmethod
    def made(cls, shapes: dict[str, tuple], dtypes: dict[str, np.dtype], capacity: int,
             zeroed: bool) -> SpareBuffers:
        """Buffers as `KVCache.empty` would allocate them, the pages of each sequence's first
        FAULTED_ROWS rows faulted in now (`faulted_in`): a decoder's load makes the first prompt's
        cache. Rows past those cost no memory until written, as in any fresh buffer."""
        buffers = {}
        for name, shape in shapes.items():
            buffer = buffers[name] = _allocate(tuple(shape), capacity, dtypes[name], zeroed).base
            for index in np.ndindex(buffer.shape[:SEQUENCE_AXIS]):
                faulted_in(buffer[index][:FAULTED_ROWS])
        return cls(buffers, 0 if zeroed else None)

    def take(self, name: str, shape: tuple, capacity: int, dtype, zeroed: bool) -> np.ndarray:
        """A length shape[SEQUENCE_AXIS] prefix view of the spare buffer `name` when it fits, else of
        a fresh one (`_allocate`); its rows past those written are as a fresh one's would be."""
        buffer = self._buffers.pop(name, None)
        whole = list(shape)
        whole[SEQUENCE_AXIS] = max(capacity, shape[SEQUENCE_AXIS])
        # 2: `buffer` and getrefcount's own argument; any view of it elsewhere holds one more
        if (buffer is None or sys.getrefcount(buffer) > 2 or buffer.dtype != np.dtype(dtype)
                or buffer.shape != tuple(whole) or (zeroed and self._zeroed_rows is None)):
            return _allocate(shape, capacity, dtype, zeroed)
        if zeroed:
            buffer[(slice(None),) * SEQUENCE_AXIS + (slice(0, self._zeroed_rows),)] = 0
        self.taken += 1
        return buffer[(slice(None),) * SEQUENCE_AXIS + (slice(0, shape[SEQUENCE_AXIS]),)]


def _allocate(shape: tuple, capacity: int, dtype, zeroed: bool) -> np.ndarray:
    return allocate_prefix(shape, SEQUENCE_AXIS, capacity, dtype, zeroed)


def _copy_into_buffer(array: np.ndarray, capacity: int, zeroed: bool = False) -> np.ndarray:
    view = _allocate(array.shape, capacity, array.dtype, zeroed)
    view[...] = array
    return view
