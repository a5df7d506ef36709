"""onnxruntime-compatible API: code written for onnxruntime works by changing the import."""
from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

from runnx.errors import InvalidOptionError
from runnx.interp.dtypes import type_name
from runnx.interp.model import Model, load
from runnx.interp.options import Options


@dataclass(frozen=True)
class NodeArg:
    """Like onnxruntime.NodeArg: name, shape (ints, symbolic names or None) and 'tensor(float)' type."""

    name: str
    shape: list
    type: str


def _node_arg(info) -> NodeArg:
    tensor_type = type_name(info.elem_type or 0)
    if info.kind == "sequence":
        tensor_type = f"seq({tensor_type})"
    elif info.kind == "optional":
        tensor_type = f"optional({tensor_type})"
    shape = [] if info.shape is None else list(info.shape)
    return NodeArg(info.name, shape, tensor_type)


class GraphOptimizationLevel(IntEnum):
    """onnxruntime's levels, with its values; each maps to Options.optimization_level."""

    ORT_DISABLE_ALL = 0
    ORT_ENABLE_BASIC = 1
    ORT_ENABLE_EXTENDED = 2
    ORT_ENABLE_ALL = 99


_LEVELS = {GraphOptimizationLevel.ORT_DISABLE_ALL: "disabled", GraphOptimizationLevel.ORT_ENABLE_BASIC: "basic",
           GraphOptimizationLevel.ORT_ENABLE_EXTENDED: "extended", GraphOptimizationLevel.ORT_ENABLE_ALL: "all"}


class SessionOptions:
    """The onnxruntime.SessionOptions fields runnx reads; anything else is accepted and ignored."""

    def __init__(self):
        self.intra_op_num_threads = 0
        self.inter_op_num_threads = 0
        self.enable_profiling = False
        self.graph_optimization_level = None  # None: Options' default (RUNNX_OPTIMIZATION_LEVEL, else all)


def _optimization_level(level) -> dict:
    """graph_optimization_level (onnxruntime's enum, or its int value) as Options' level."""
    try:
        return {"optimization_level": _LEVELS[GraphOptimizationLevel(int(level))]}
    except (TypeError, ValueError):
        known = ", ".join(f"{member.name} ({member.value})" for member in GraphOptimizationLevel)
        raise InvalidOptionError(f"SessionOptions.graph_optimization_level {level!r} is not one of {known}") from None


def _threads(count) -> dict:
    """intra_op_num_threads, like onnxruntime's: 0 keeps the default (Options.threads / RUNNX_THREADS)."""
    return {"threads": int(count)} if count else {}


class InferenceSession:
    def __init__(self, path_or_bytes, sess_options=None, providers=None, provider_options=None, *,
                 weights=None, options: Options | None = None, **kwargs):
        if options is None:
            chosen = _threads(getattr(sess_options, "intra_op_num_threads", 0))
            if getattr(sess_options, "enable_profiling", False):
                chosen["profile"] = True
            level = getattr(sess_options, "graph_optimization_level", None)
            if level is not None:
                chosen.update(_optimization_level(level))
            options = Options(**chosen)
        self._model: Model = load(path_or_bytes, weights=weights, options=options)

    @property
    def model(self) -> Model:
        return self._model

    def get_inputs(self) -> list[NodeArg]:
        return [_node_arg(i) for i in self._model.inputs]

    def get_outputs(self) -> list[NodeArg]:
        return [_node_arg(o) for o in self._model.outputs]

    def get_providers(self) -> list[str]:
        return ["CPUExecutionProvider"]

    def run(self, output_names, input_feed, run_options=None) -> list:
        names = list(output_names) if output_names else self._model.output_names
        result = self._model.run(input_feed, names)
        return [result[name] for name in names]
