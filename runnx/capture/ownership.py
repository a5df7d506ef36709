"""Who may write a buffer: owned vs borrowed values, tracked per storage (the root buffer).

Views (Reshape, Transpose, Slice, ...) share their input's storage, so ownership and liveness are
kept per *storage*, keyed by the root buffer behind `ndarray.base`. A value may be overwritten in
place only when its storage is owned and no other live value holds it.
"""
from __future__ import annotations

import numpy as np


class Owned:
    """Hands an array over to runnx: it may be consumed in place (e.g. a KV cache with capacity).

    After the call, the caller must treat the array's buffer as runnx's: read the outputs instead.
    """

    __slots__ = ("array",)

    def __init__(self, array):
        self.array = array

    def __repr__(self):
        shape = getattr(self.array, "shape", None)
        return f"Owned(shape={shape}, dtype={getattr(self.array, 'dtype', type(self.array).__name__)})"


def storage_root(array):
    """The object that owns the memory behind an array (the array itself when it owns it)."""
    root = array
    base = array.base
    while base is not None:
        root = base
        base = getattr(base, "base", None)
    return root


def storage_keys(value) -> tuple:
    """ids of the storages a value holds: one for an array, one per element for a sequence."""
    if type(value) is np.ndarray:
        return (id(value if value.base is None else storage_root(value)),)
    if type(value) is list:
        return tuple(id(storage_root(v)) for v in value if isinstance(v, np.ndarray))
    return ()


def read_only_view(array: np.ndarray) -> np.ndarray:
    """A view runnx can hold without ever being able to write the caller's buffer through it."""
    view = array.view()
    view.flags.writeable = False
    return view


class StorageTable:
    """Live storages of one graph execution: how many live values hold each, and whether owned."""

    __slots__ = ("count", "owned", "nbytes", "live_bytes", "peak_bytes", "track_bytes")

    def __init__(self, track_bytes: bool = False):
        self.count: dict[int, int] = {}
        self.owned: dict[int, bool] = {}
        self.nbytes: dict[int, int] = {}
        self.live_bytes = 0
        self.peak_bytes = 0
        self.track_bytes = track_bytes

    def hold(self, keys: tuple, owned: bool | None, value=None) -> None:
        """Register one more live value on `keys`; owned=None inherits the storage's flag (or,
        for a storage never seen, takes ownership when the value is writeable: fresh kernel output)."""
        count = self.count
        for key in keys:
            if key in count:
                count[key] += 1
                if owned is False:
                    self.owned[key] = False
            else:
                count[key] = 1
                if owned is None:
                    flags = getattr(value, "flags", None)
                    owned = flags is not None and bool(flags.writeable)
                self.owned[key] = owned
                if self.track_bytes:
                    size = _storage_nbytes(value)
                    self.nbytes[key] = size
                    self.live_bytes += size
                    if self.live_bytes > self.peak_bytes:
                        self.peak_bytes = self.live_bytes

    def drop(self, keys: tuple) -> None:
        count = self.count
        for key in keys:
            left = count[key] - 1
            if left:
                count[key] = left
            else:
                del count[key]
                del self.owned[key]
                if self.track_bytes:
                    self.live_bytes -= self.nbytes.pop(key, 0)

    def exclusive(self, keys: tuple) -> bool:
        """True when these storages are owned and held by exactly one live value."""
        if not keys:
            return False
        for key in keys:
            if self.count.get(key) != 1 or not self.owned.get(key):
                return False
        return True

    def is_owned(self, keys: tuple) -> bool:
        return bool(keys) and all(self.owned.get(k, False) for k in keys)


def _storage_nbytes(value) -> int:
    if isinstance(value, np.ndarray):
        root = storage_root(value)
        return root.nbytes if isinstance(root, np.ndarray) else value.nbytes
    if isinstance(value, list):
        return sum(v.nbytes for v in value if isinstance(v, np.ndarray))
    return 0
