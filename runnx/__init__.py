"""runnx: an ONNX interpreter in Python that moves values instead of copying them.

    import runnx
    model = runnx.load("model.onnx")
    outputs = model.run({"x": x})                        # {name: array}
    session = runnx.InferenceSession("model.onnx")       # onnxruntime's API
"""
from runnx import _openblas  # noqa: F401  (first: OpenBLAS's thread timeout, before numpy loads it)
from runnx import ops as _ops  # registers every kernel
from runnx.capture import Owned, with_capacity
from runnx.errors import (
    CycleError, ExternalDataError, InPlaceMismatchError, InputError, InputShapeError, InputTypeError, InvalidModelError,
    MissingInputError, MissingValueError, ModelLoadError, NodeError, PlanError, ResourceLimitError,
    RunnxError, UnknownInputError, UnknownOutputError, UnsupportedOpError, UnsupportedOpsetError,
)
from runnx.interp.model import Model, load
from runnx.interp.options import Options
from runnx.interp.profiler import Profile
from runnx.interp.session import InferenceSession, NodeArg, SessionOptions

__version__ = "0.1.0"

__all__ = [
    "CycleError", "ExternalDataError", "InPlaceMismatchError", "InferenceSession", "InputError", "InputShapeError", "InputTypeError",
    "InvalidModelError", "MissingInputError", "MissingValueError", "Model", "ModelLoadError", "NodeArg",
    "NodeError", "Options", "Owned", "PlanError", "Profile", "ResourceLimitError", "RunnxError",
    "SessionOptions", "UnknownInputError", "UnknownOutputError", "UnsupportedOpError", "UnsupportedOpsetError", "load", "with_capacity",
]
