"""RunContext: what a kernel may need beyond its inputs (options, counters, limits, values derived
once per run)."""
from __future__ import annotations

import itertools
import math
import operator

from runnx.capture.ownership import storage_keys
from runnx.errors import ResourceLimitError
from runnx.interp.options import Options


_SERIALS = itertools.count()


class RunContext:
    """`serial` tells runs apart for good (an id may come back once a context is freed).
    `kept_storages`: the storage keys of the arrays `keep` holds, which the executor checks each
    in-place grant against (`overwriting`)."""

    __slots__ = ("options", "profile", "serial", "_kept", "kept_storages")

    def __init__(self, options: Options, profile=None):
        self.options = options
        self.profile = profile
        self.serial = next(_SERIALS)
        self._kept: dict = {}
        self.kept_storages: set = set()

    def keep(self, key, arrays: tuple, compute):
        """compute(), or what it returned earlier in this run for the same key and the same `arrays`
        (by identity; held until the run ends, so that their ids stay theirs): a value that many
        nodes derive alike from one of the run's arrays (each layer's attention bias from the mask).
        An array of the run does not change while a node reading it has still to run, but once
        its value died an in-place op may write a new value into the same object: the executor
        then calls `overwriting`, which forgets what was kept for it."""
        known = self._kept.get(key)
        if known is not None and all(map(operator.is_, known[0], arrays)):
            return known[1]
        value = compute()
        self._kept[key] = (arrays, value)
        for array in arrays:
            self.kept_storages.update(storage_keys(array))
        return value

    def overwriting(self, keys: tuple) -> None:
        """An in-place write was granted into storages `keys`: forget what `keep` kept for arrays
        holding any of them."""
        written = set(keys)
        for key, (arrays, _) in list(self._kept.items()):
            if any(not written.isdisjoint(storage_keys(array)) for array in arrays):
                del self._kept[key]
        self.kept_storages = {k for arrays, _ in self._kept.values() for a in arrays for k in storage_keys(a)}

    def count(self, name: str, amount: int = 1) -> None:
        """Add to a profile counter (free when not profiling)."""
        if self.profile is not None:
            self.profile.counters[name] += amount

    def check_elements(self, shape, what: str = "output") -> None:
        """Raise ResourceLimitError before allocating a tensor over the session's element limit."""
        count = math.prod(int(d) for d in shape)
        if count > self.options.max_tensor_elements:
            raise ResourceLimitError(
                f"{what} of shape {tuple(int(d) for d in shape)} would hold {count} elements, over the limit of "
                f"{self.options.max_tensor_elements} (Options.max_tensor_elements / RUNNX_MAX_TENSOR_ELEMENTS)")

    def check_iterations(self, count: int, what: str = "loop") -> None:
        if count > self.options.max_loop_iterations:
            raise ResourceLimitError(
                f"{what} would run {count} iterations, over the limit of {self.options.max_loop_iterations} "
                f"(Options.max_loop_iterations / RUNNX_MAX_LOOP_ITERATIONS)")
