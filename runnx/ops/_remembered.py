"""Facts about constants, remembered by their identity.

A decode step hands each fused node the same constants (weights, a norm's epsilon) and the same
kept results of shape memos (reshape targets, slice bounds) step after step, all read-only. What a
fast path's checks find from them, with the shapes of the step's own arrays, holds while they are
the same objects. Finding it again every step is not free: between kernels streaming megabytes of
weights each Python object a check reads is a cache miss, so a check costs several times more a
layer in a decode step than in a loop.
Read-only is trusted as unchanging: runnx's own read-only arrays never change, and a caller's
array reaches kernels only as a view made for its run (validation.bind_feeds), so an entry is
never found again for an object the caller may write through between runs.
"""
from __future__ import annotations

import functools
import threading
import weakref

import numpy as np

enabled = True  # False: every call computes its facts afresh (for A/B measurements)
_LIMIT = 1024  # entries per function, all dropped at once beyond: a model has a few per layer


class Remembered:
    """fn(values, *arrays), remembered by `values` (hashable: shapes, attributes) and the identity
    of `arrays` when each is None or a read-only array. An entry holds its arrays weakly and goes
    when one of them does (its id is then free for another object): a model's weights are not
    kept alive by facts about them. fn returns facts (numbers, shapes, None) that do not hold the
    arrays, never an array a caller could write. kept(values, *arrays), when given, is called once
    a result is kept for them (a weight's tiles: its own bytes are read no more)."""

    __slots__ = ("fn", "kept", "known", "_promised", "_computing")

    def __init__(self, fn=None, kept=None):
        self.fn = fn  # None: results come from each `lookup`'s compute
        self.kept = kept
        self.known: dict[tuple, tuple] = {}
        self._promised: dict[tuple, object] = {}  # key -> its maker (`promise`)
        # held while a missing entry is computed: a prepacking thread (`registry`'s prepack) and a
        # run asking for the same weight's tiles make them once; a hit never takes it
        self._computing = threading.RLock()

    def __call__(self, values, *arrays):
        return self.lookup(values, arrays, self.fn)

    def promise(self, values, arrays: tuple, make) -> None:
        """`make()` will give these values' and arrays' result, being made on another thread (a
        prepack's): the first lookup missing it calls `make` (which joins that work, or returns None:
        then its compute runs) instead of computing its own beside it."""
        self._promised[(values, *map(id, arrays))] = make

    def keep(self, values, arrays: tuple, result):
        """Keep `result` for these values and arrays (made elsewhere: a prepack's), their promise
        fulfilled; the result kept already when there is one (that one stays)."""
        with self._computing:
            self._promised.pop((values, *map(id, arrays)), None)
            return self.lookup(values, arrays, lambda *_: result)

    def withdraw(self, values, arrays: tuple) -> None:
        """Drop the promise of these values and arrays, if any (its work was refused)."""
        self._promised.pop((values, *map(id, arrays)), None)

    def knows(self, values, arrays: tuple) -> bool:
        """Whether `lookup(values, arrays, ...)` would find a result kept (without computing one)."""
        return self.known_result((values, *map(id, arrays))) is not None

    def known_result(self, key: tuple):
        """The result kept for key = (values, *ids of the arrays), or None: `lookup`'s hit without
        the call (its arrays are alive while their entry is)."""
        known = self.known.get(key) if enabled else None
        return None if known is None else known[1]

    @staticmethod
    def keeps(arrays: tuple) -> bool:
        """Whether a result for these arrays is kept: each None or a read-only array."""
        return enabled and all(a is None or (type(a) is np.ndarray and not a.flags.writeable) for a in arrays)

    def lookup(self, values, arrays: tuple, compute):
        """What compute(values, *arrays) gave for these values and arrays, or its result now."""
        key = (values, *map(id, arrays))
        known = self.known.get(key) if enabled else None
        if known is not None:  # its arrays are alive (else it would be gone), so they are these
            return known[1]
        with self._computing:
            known = self.known.get(key) if enabled else None
            if known is not None:  # made by another thread meanwhile
                return known[1]
            make = self._promised.pop(key, None)
            result = None if make is None else make()
            if result is None:
                result = compute(values, *arrays)
            if self.keeps(arrays):
                if len(self.known) >= _LIMIT:
                    self.known.clear()
                forget = functools.partial(_forget, self.known, key)
                self.known[key] = (tuple([weakref.ref(a, forget) for a in arrays if a is not None]), result)
                if self.kept is not None:
                    self.kept(values, *arrays)
        return result


def _forget(known: dict, key: tuple, _) -> None:
    """Drop an entry whose array is being freed (a weakref callback: before its id can be reused)."""
    known.pop(key, None)
