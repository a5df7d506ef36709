"""runnx: an ONNX interpreter in Python that moves values instead of copying them.

    import runnx
    model = runnx.load("model.onnx")
    outputs = model.run({"x": x})                        # {name: array}
    session = runnx.InferenceSession("model.onnx")       # onnxruntime's API
    runnx.set_threads(2)                                 # BLAS, numba and decode-pool threads
    runnx.keep_freed()                                   # glibc keeps freed temporaries mapped
"""
__version__ = "0.1.0"  # before any import: the numba cache folder's name reads it (runnx/ops/_jit_cache.py)

from runnx.capture import Owned
from runnx.errors import (
    CycleError, ExternalDataError, InPlaceMismatchError, InputError, InputShapeError, InputTypeError, InvalidModelError,
    InvalidOptionError, MissingInputError, MissingValueError, ModelLoadError, NodeError, PlanError, ResourceLimitError,
    RunnxError, UnknownInputError, UnknownOutputError, UnsupportedOpError, UnsupportedOpsetError,
)
from runnx.interp.model import Model, load
from runnx.interp.options import Options
from runnx.interp.profiler import Profile
from runnx.interp.session import GraphOptimizationLevel, InferenceSession, NodeArg, SessionOptions
from runnx.runtime import keep_freed, set_threads


def __getattr__(name):
    """`with_capacity` loads numba (its module compiles a kernel): on first use, not at import.
    Op kernels register when a model first asks for them (`runnx.ops.load_families`)."""
    if name == "with_capacity":
        from runnx.capture.capacity import with_capacity
        return with_capacity
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CycleError", "ExternalDataError", "GraphOptimizationLevel", "InPlaceMismatchError", "InferenceSession",
    "InputError", "InputShapeError", "InputTypeError", "InvalidModelError", "InvalidOptionError",
    "MissingInputError", "MissingValueError", "Model", "ModelLoadError", "NodeArg", "NodeError", "Options",
    "Owned", "PlanError", "Profile", "ResourceLimitError", "RunnxError", "SessionOptions",
    "UnknownInputError", "UnknownOutputError", "UnsupportedOpError", "UnsupportedOpsetError", "keep_freed", "load",
    "set_threads", "with_capacity",
]
