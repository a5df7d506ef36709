"""The one error hierarchy of runnx: every failure a user can cause is a RunnxError.

Specific classes also derive from the matching built-in (KeyError, TypeError, ValueError) so that
code written against onnxruntime's loose exceptions keeps working.
"""


class RunnxError(Exception):
    """Base class of every error runnx raises on purpose."""


class ModelLoadError(RunnxError):
    """The model file or bytes cannot be read or parsed."""


class InvalidModelError(ModelLoadError):
    """The model parses but breaks the ONNX rules (duplicate names, bad attributes, undefined names)."""


class UnsupportedOpError(ModelLoadError):
    """One or more (domain, op, opset) have no kernel; the message lists all of them."""


class UnsupportedOpsetError(ModelLoadError):
    """The model imports a domain at a version newer than runnx's kernels for it (allowed with
    Options.allow_newer_opset)."""


class ExternalDataError(ModelLoadError):
    """External tensor data or a weights file is missing, malformed or points outside the model folder."""


class PlanError(RunnxError):
    """The requested outputs cannot be computed from what was provided."""


class MissingValueError(PlanError, KeyError):
    """A value needed by a node is neither provided, nor a constant, nor produced by any node."""

    def __str__(self):  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class CycleError(PlanError):
    """The graph has a cycle through the nodes needed for the requested outputs."""


class InputError(RunnxError):
    """A feed given to run() does not match the model's inputs."""


class UnknownInputError(InputError, KeyError):
    """A feed names an input the model does not have."""

    def __str__(self):
        return str(self.args[0]) if self.args else ""


class MissingInputError(InputError, MissingValueError):
    """A required model input was not fed."""

    def __str__(self):
        return str(self.args[0]) if self.args else ""


class InputTypeError(InputError, TypeError):
    """A feed has the wrong dtype (runnx never casts silently) or is not an array."""


class InputShapeError(InputError, ValueError):
    """A feed has the wrong rank or a wrong static (or inconsistent symbolic) dimension."""


class UnknownOutputError(InputError, KeyError):
    """An output name was requested that the model does not have."""

    def __str__(self):
        return str(self.args[0]) if self.args else ""


class NodeError(RunnxError):
    """A kernel failed while running a node; the message names the node, op and its inputs."""


class ResourceLimitError(RunnxError):
    """A tensor or loop would exceed the session's configured limits."""


class InvalidOptionError(RunnxError, ValueError):
    """An option (`runnx.Options`, its environment variable, SessionOptions) has a value runnx does
    not know."""


class InPlaceMismatchError(RunnxError):
    """Checking mode (check_inplace) found an in-place execution whose result differs from the
    out-of-place one: a bug in a kernel's in-place path."""


class BatchFileError(RunnxError, ValueError):
    """A batch job's prompts file, audio list or results file is malformed (the message names the line)."""
