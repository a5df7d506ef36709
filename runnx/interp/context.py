"""RunContext: what a kernel may need beyond its inputs (options, counters, limits)."""
from __future__ import annotations

import math

from runnx.errors import ResourceLimitError
from runnx.interp.options import Options


class RunContext:
    __slots__ = ("options", "profile")

    def __init__(self, options: Options, profile=None):
        self.options = options
        self.profile = profile

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
