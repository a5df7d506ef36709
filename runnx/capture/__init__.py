"""Value ownership, CaptureEnv for subgraphs, and capacity buffers for in-place growth."""
from runnx.capture.capacity import spare_capacity, with_capacity
from runnx.capture.env import CaptureEnv, Subgraph
from runnx.capture.ownership import Owned

__all__ = ["CaptureEnv", "Owned", "Subgraph", "spare_capacity", "with_capacity"]
