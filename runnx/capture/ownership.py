"""Who may write a buffer: owned vs borrowed values, tracked per storage (the root buffer).

Views (Reshape, Transpose, Slice, ...) share their input's storage, so ownership and liveness are
kept per *storage*, keyed by the root buffer behind `ndarray.base`. A value may be overwritten in
place only when its storage is owned and no other live value holds it.

The rules are these functions and `StorageTable`'s methods; the interpreted loop
(interp/executor.py) calls them, and plans compiled to Python (interp/compiled.py) call them too,
except for the one common case each rule states beside itself as the expression generated code
inlines (`may_write_inline`, `BOOKKEEPING`).
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
                    self._count_bytes(key, value)

    def hold_array(self, array: np.ndarray) -> tuple:
        """`hold(storage_keys(array), None, array)` for a kernel's ndarray output, in one call: one
        more live value on its storage, a storage never seen owned when the array is writeable (a
        fresh output; a view of a read-only array is not writeable). Returns its keys."""
        key = id(array) if array.base is None else id(storage_root(array))
        count = self.count
        held = count.get(key)
        if held is None:
            count[key] = 1
            self.owned[key] = array.flags.writeable
            if self.track_bytes:
                self._count_bytes(key, array)
        else:
            count[key] = held + 1
        return (key,)

    def _count_bytes(self, key: int, value) -> None:
        """Profiled runs: the bytes of a new storage, and the peak of live ones."""
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


def may_write(table: StorageTable, keys: tuple, ctx) -> bool:
    """The grant rule, for an input dying at its node whose value holds storages `keys`: it may be
    written in place when they are owned and no other live value holds them. A write into a storage
    the run keeps something of (`ctx.kept_storages`, interp/context.py) is told to `ctx` first."""
    if not table.exclusive(keys):
        return False
    kept = ctx.kept_storages
    if kept and not kept.isdisjoint(keys):
        ctx.overwriting(keys)
    return True


def may_write_inline(keys: str) -> str:
    """`may_write`'s common case as an expression of generated code, for the input whose keys are
    the local `keys`: one storage, owned, held once, nothing kept this run (read through the locals
    `BOOKKEEPING` binds, and `ctx`). Where it is false, `may_write` decides."""
    return f"len({keys}) == 1 and count_get({keys}[0]) == 1 and owned_get({keys}[0]) and not ctx.kept_storages"


# The first line of generated code keeping a `table`: the locals the inline rules read, and the
# methods its steps call (`hold` counts a kernel's ndarray output, `drop` releases a dead value).
BOOKKEEPING = "count_get, owned_get, hold, drop = table.count.get, table.owned.get, table.hold_array, table.drop"


def _storage_nbytes(value) -> int:
    if isinstance(value, np.ndarray):
        root = storage_root(value)
        return root.nbytes if isinstance(root, np.ndarray) else value.nbytes
    if isinstance(value, list):
        return sum(v.nbytes for v in value if isinstance(v, np.ndarray))
    return 0
