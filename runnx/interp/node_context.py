"""What an error or trace line says about a node: its name, op and its inputs' dtypes and shapes."""
from __future__ import annotations

import numpy as np

from runnx.errors import NodeError, RunnxError
from runnx.interp.ir import MISSING, Graph


def describe_value(name, value) -> str:
    if isinstance(value, np.ndarray):
        return f"{name}: {value.dtype}{list(value.shape)}"
    if value is None:
        return f"{name}: <none>"
    if isinstance(value, list):
        return f"{name}: sequence of {len(value)}"
    return f"{name}: {type(value).__name__}"


def _node_context(graph: Graph, node, args) -> str:
    names = [graph.names[v] if v != MISSING else "" for v in node.inputs]
    described = ", ".join(describe_value(n, a) for n, a in zip(names, args))
    return f"{node.describe()} (inputs {described})"


def node_error(graph: Graph, node, args, error: Exception) -> Exception:
    """The error a failing node raises: the kernel's own RunnxError type, or NodeError, naming the
    node, its op and its inputs (an error that already names its node is returned as it is)."""
    if getattr(error, "node_context", False):
        return error
    if isinstance(error, RunnxError):
        wrapped = type(error)(f"{_node_context(graph, node, args)}: {error}")
    else:
        wrapped = NodeError(f"{_node_context(graph, node, args)} failed: {type(error).__name__}: {error}")
    wrapped.node_context = True
    return wrapped
