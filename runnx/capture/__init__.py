"""Value ownership, CaptureEnv for subgraphs, and capacity buffers for in-place growth.

The capacity helpers load with their module (`capacity.py`, which compiles a numba kernel) when
first asked for: `import runnx` does not import numba.
"""
from runnx.capture.env import CaptureEnv, Subgraph
from runnx.capture.ownership import Owned

_CAPACITY = ("spare_capacity", "with_capacity")


def __getattr__(name):
    if name in _CAPACITY:
        from runnx.capture import capacity
        return getattr(capacity, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["CaptureEnv", "Owned", "Subgraph", "spare_capacity", "with_capacity"]
