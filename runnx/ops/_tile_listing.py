"""A model's 4-bit weights listed for `repack_listed` (`_kernels_nibble_layout`): each input as a byte
range of the buffer the weights lie in, each output as a byte range of one arena. Made from a
prepacking thread's items in one native call, a model's tiles need the GIL only before and after:
a tokenizer loading beside the model, which holds it for 90 ms, does not stop them half-made.

Addresses are only subtracted here, never turned back into pointers: the kernel indexes its
buffers by the offsets, each checked to lie inside its buffer."""
from __future__ import annotations

import numpy as np

from runnx.interp.model_file import fault_in, fresh_map, settle
from runnx.ops._kernels_contrib import ZERO_PACKED, ZERO_TYPED
from runnx.interp.external_data import in_file_map
from runnx.ops._kernels_nibble_layout import (BLOB, BLOCKS, CHUNKS, COLUMNS, HAND_BACK, LISTED, S_AT, S_BACK, S_SOURCE,
                                              SCALES_AT, TILE_COUNT, TILES_AT, W_AT, W_BACK, W_SOURCE, Z_AT, Z_BACK,
                                              Z_COUNT, Z_SOURCE, ZERO_MODE, ZEROS_AT)

_ALIGN = 64  # each output starts on a cache line of the arena


class Arena:
    """One uint8 buffer carved into arrays in order (`empty`, np.empty's signature): a model's tiles
    side by side, `repack_listed`'s outputs. `sized` first gives the bytes the same calls will need.
    The buffer is a map of its own, faulted in when made and settled as the weights' arena is
    (`model_file.fault_in`: huge pages only while they come fast), not numpy's: numpy advises a
    buffer this large for huge pages, which after a while idle came at the host's pace on a virtual
    machine (64 MB in 0.23-0.36 s against 0.03 in 4 KiB pages), and a first prompt waited for them.
    A prepack makes it while it plans, which the load waits for: the policy's Python between its
    madvise calls, beside a tokenizer's load holding the GIL, took 0.23 s for 30 ms of faults."""

    def __init__(self, nbytes: int):
        self.buffer = fresh_map(nbytes)
        settle(fault_in(self.buffer))
        self.used = 0

    @staticmethod
    def sized(shapes: list) -> int:
        """The bytes `empty` takes for each (shape, dtype) of shapes, in order."""
        return sum(-(-int(np.prod(shape)) * np.dtype(dtype).itemsize // _ALIGN) * _ALIGN for shape, dtype in shapes)

    def empty(self, shape, dtype) -> np.ndarray:
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        if self.used + nbytes > self.buffer.size:
            raise MemoryError("the tile arena is smaller than its planned arrays")
        array = self.buffer[self.used:self.used + nbytes].view(dtype).reshape(shape)
        self.used += -(-nbytes // _ALIGN) * _ALIGN
        return array


def listed(items: list, arena: Arena, hand_back=()) -> tuple[tuple, np.ndarray]:
    """(sources, table) for `repack_listed`: a row a `repack` item (its argument tuple), whose outputs
    are arrays of `arena`. Inputs lying in the buffers of the first item's weights, scales and zero
    points (a mapped data file, the load's weight arena, or a file a tensor) are read there; any
    other (a joined weight, scales converted to float32) is copied into a staging buffer, the last
    source. `buffers_of` groups a model's weights so that each group's lie in its own buffers.
    hand_back[k]: item k's tiles will be kept, so its inputs read from a file's map (`in_file_map`:
    never memory holding the only copy) give their pages back once it is made (`HAND_BACK`)."""
    mains = [b if b is not None else _NOWHERE for b in buffers_of(items[0])] if items else [_NOWHERE] * 3
    mapped = [bool(b.size) and in_file_map(b) for b in mains]
    staged_arrays: list[np.ndarray] = []
    staged_bytes = 0
    places: list[tuple] = []  # (source, at) of each item's weights, scales, zero points
    for weights, scales, packed, typed, mode, *_ in items:
        for array in (weights, scales, packed if mode == ZERO_PACKED else typed):
            for source, main in enumerate(mains):
                at = _offset_in(array, main)
                if at is not None:
                    places.append((source, at))
                    break
            else:
                places.append((len(mains), staged_bytes))
                staged_arrays.append(array)
                staged_bytes += array.nbytes
    staged = fresh_map(staged_bytes)  # (written once, read once: 4 KiB pages, not numpy's advised huge ones)
    at = 0
    for array in staged_arrays:
        staged[at:at + array.nbytes] = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        at += array.nbytes
    table = np.zeros((len(items), LISTED), np.int64)
    inputs = iter(places)
    for row, (weights, scales, packed, typed, mode, tiles, tile_scales, byte_zeros, float_zeros) in zip(table, items):
        (row[W_SOURCE], row[W_AT]), (row[S_SOURCE], row[S_AT]), (row[Z_SOURCE], row[Z_AT]) = (
            next(inputs), next(inputs), next(inputs))
        row[COLUMNS], row[BLOCKS], row[BLOB] = weights.shape
        row[ZERO_MODE] = mode
        row[Z_COUNT] = packed.size if mode == ZERO_PACKED else typed.size if mode == ZERO_TYPED else 0
        row[TILE_COUNT], row[CHUNKS] = tiles.shape[:2]
        row[TILES_AT], row[SCALES_AT] = _offset_in(tiles, arena.buffer), _offset_in(tile_scales, arena.buffer)
        zeros = byte_zeros if mode == ZERO_PACKED else float_zeros if mode == ZERO_TYPED else None
        row[ZEROS_AT] = 0 if zeros is None else _offset_in(zeros, arena.buffer)
    for k, row in enumerate(table):
        if k < len(hand_back) and hand_back[k]:
            row[HAND_BACK] = sum(bit for bit, source in ((W_BACK, row[W_SOURCE]), (S_BACK, row[S_SOURCE]),
                                                           (Z_BACK, row[Z_SOURCE]))
                                 if source < len(mains) and mapped[source])
    return tuple(_read_only(source) for source in (*mains, staged)), table


_NOWHERE = np.empty(0, np.uint8)  # a source no input lies in


def buffers_of(item: tuple) -> tuple:
    """The buffers (`_buffer_of`) an item's weights, scales and zero points lie in."""
    weights, scales, packed, typed, mode, *_ = item
    return tuple(_buffer_of(a) for a in (weights, scales, packed if mode == ZERO_PACKED else typed))


def buffers_key(buffers: tuple) -> tuple:
    """Which buffers these are (address and size each): weights listed together read the same."""
    return tuple(None if b is None else (_address(b), b.nbytes) for b in buffers)


def _buffer_of(array: np.ndarray) -> np.ndarray | None:
    """The whole uint8 buffer the array's memory lies in: the object its base's memoryview exposes
    (a mapped data file) or its base array (the load's weight arena); None when not contiguous."""
    root = array
    while isinstance(root.base, np.ndarray):
        root = root.base
    if isinstance(root.base, memoryview):
        try:
            return np.frombuffer(root.base.obj, np.uint8)
        except (TypeError, ValueError, BufferError):
            pass
    return root.reshape(-1).view(np.uint8) if root.flags.c_contiguous and root.size else None


def _address(array: np.ndarray) -> int:
    return array.__array_interface__["data"][0]


def _offset_in(array: np.ndarray, buffer: np.ndarray) -> int | None:
    """The byte at which a C-contiguous array starts in buffer, when all of it lies there."""
    at = _address(array) - _address(buffer) if buffer.size else -1
    if array.flags.c_contiguous and 0 <= at and at + array.nbytes <= buffer.nbytes:
        return at
    return None


def _read_only(array: np.ndarray) -> np.ndarray:
    array = array.view()
    array.flags.writeable = False
    return array
