"""runnx: an ONNX interpreter in Python that moves values instead of copying them.

    import runnx
    model = runnx.load("model.onnx")
    outputs = model.run({"x": x})                        # {name: array}
    session = runnx.InferenceSession("model.onnx")       # onnxruntime's API
"""
import os as _os

# OpenBLAS's threads spin for 2**28 cycles (~0.1 s) after each call, on the core the decode pool's
# worker needs: a decode step right after a prefill or an encoder ran 2-3x slower. 2**4 cycles:
# they sleep at once (waking costs microseconds, next to a GEMM's milliseconds). Read when numpy
# loads OpenBLAS: this takes effect when runnx is imported first (the CLI); an explicit setting wins.
_os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")

from runnx import ops as _ops  # registers every kernel  # noqa: E402
from runnx.capture import Owned, with_capacity
from runnx.errors import (
    CycleError, ExternalDataError, InPlaceMismatchError, InputError, InputShapeError, InputTypeError, InvalidModelError,
    MissingInputError, MissingValueError, ModelLoadError, NodeError, PlanError, ResourceLimitError,
    RunnxError, UnknownInputError, UnknownOutputError, UnsupportedOpError,
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
    "SessionOptions", "UnknownInputError", "UnknownOutputError", "UnsupportedOpError", "load", "with_capacity",
]
