"""Whether this process runs numba's compiled kernels, or the numpy code each fused op already has
for the cases its kernel does not take.

numba compiles a kernel on its first call (then loads it from its on-disk cache): a decoder's
kernels took minutes of compiling on a fresh install before the first token. While `enabled` is
False, every place that would call a numba kernel from Python takes its numpy path instead (the
unfused nodes' operations: the same results, bitwise where the kernel rounds as numpy does, within
a few ulp where it reorders sums or uses its own exp or erf), and nothing is compiled. `enable()`
switches to the kernels at once, between two ops: each op reads the switch when it runs. The CLI
turns it off for a command whose kernels are not compiled yet, while a process of its own compiles
them (`runnx/background_compile.py`).

The checks read `enabled` outside any `Remembered` function: a remembered answer would keep the
numpy path after the switch.
"""
from __future__ import annotations

enabled = True


def enable() -> None:
    """Run the compiled kernels from the next op on."""
    global enabled
    enabled = True


def disable() -> None:
    """Run the numpy paths from the next op on (compiled kernels already loaded stay unused)."""
    global enabled
    enabled = False
