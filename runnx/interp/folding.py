"""Load-time constant folding: a node whose inputs are all constants runs once, at load.

Optimum exports compute things like the transposed tied embedding (lm_head) from initializers on
every run; folding turns them into contiguous read-only constants. Random ops are never folded,
and a fold that would blow up memory (e.g. Expand of a scalar to a huge tensor) is left to run; a
Cast of float16 weights to float32 (twice their bytes, `float16.py`) is folded, and so is a
DequantizeLinear of 8-bit weights (four times their bytes: a transformers.js int8 export's tied
LM head, 28 MB of uint8, was dequantized to 113 MB on every decode step).

Small constants of equal value then become one array: every layer of an export has its own copy
of the same slice bounds and scalars, and the facts kernels remember about constants by identity
(`runnx/ops/_remembered.py`, a run's attention bias kept for the same inputs) then hold for all
layers at once.
"""
from __future__ import annotations

import numpy as np

from runnx.interp.context import RunContext
from runnx.interp.ir import MISSING, Graph

NONDETERMINISTIC = frozenset({"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike",
                              "Bernoulli", "Multinomial", "Dropout"})
SMALL_RESULT = 1 << 20  # a folded result may always be this large, else no larger than its inputs
SHARED_BYTES = 4096  # read-only constants up to this size with equal dtype, shape and bytes become one


def _foldable(graph: Graph, node) -> bool:
    return (node.kernel is not None and not node.subgraphs and not node.captures
            and node.op_type not in NONDETERMINISTIC
            and all(v == MISSING or v in graph.constants for v in node.inputs))


def out_of_place_kwargs(node) -> dict:
    """The node's attributes and the reserved keywords that run its kernel outside the executor
    (no input overwritten; `ctx`, when the kernel takes it, is the caller's to add)."""
    kernel = node.kernel
    kwargs = dict(node.attrs)
    if kernel.inplace or kernel.inplace_from is not None:
        kwargs["overwrite"] = ()
    if kernel.wants_output_count:
        kwargs["output_count"] = len(node.outputs)
    return kwargs


def call_out_of_place(node, args: list, ctx):
    """Run one node's kernel outside the executor: no input may be overwritten."""
    kwargs = out_of_place_kwargs(node)
    if node.kernel.wants_ctx:
        kwargs["ctx"] = ctx
    return node.kernel.fn(*args, **kwargs)


def _evaluate(graph: Graph, node, ctx) -> list | None:
    args = [graph.constants[v] if v != MISSING else None for v in node.inputs]
    try:
        result = call_out_of_place(node, args, ctx)
    except Exception:  # left to fail at run time, with the executor's node context
        return None
    outputs = list(result) if type(result) is tuple else [result]
    if not all(isinstance(o, (np.ndarray, np.generic)) for o in outputs):
        return None
    budget = max(SMALL_RESULT, sum(a.nbytes for a in args if isinstance(a, np.ndarray)))
    if node.op_type == "Cast" and args[0].dtype == np.float16:  # float16 weights widened (interp/float16.py)
        budget *= 2
    elif node.op_type == "DequantizeLinear":  # 8-bit weights dequantized once, not every run
        budget *= 4
    if sum(np.asarray(o).nbytes for o in outputs) > budget:
        return None
    folded = []
    for output in outputs:
        output = np.asarray(output)
        if not output.flags.c_contiguous:  # (np.ascontiguousarray would turn a 0-D result into 1-D)
            output = output.copy()
        if output.base is not None or output.flags.writeable:
            output = output.copy() if output.base is not None else output
        output.flags.writeable = False
        folded.append(output)
    return folded


def fold_constants(graph: Graph, options, shared: dict | None = None) -> int:
    """Fold every foldable node of `graph` and of its subgraphs, then share their equal small
    constants (`shared`: the arrays kept so far, by value); returns how many nodes were folded."""
    shared = {} if shared is None else shared
    ctx = RunContext(options)
    folded = 0
    nodes = list(graph.nodes)
    changed = True
    while changed:  # nodes may be out of topological order
        changed = False
        kept = []
        for node in nodes:
            outputs = _evaluate(graph, node, ctx) if _foldable(graph, node) else None
            if outputs is None or len(outputs) < sum(v != MISSING for v in node.outputs):
                kept.append(node)
                continue
            for vid, value in zip(node.outputs, outputs):
                if vid != MISSING:
                    graph.constants[vid] = value
            folded += 1
            changed = True
        nodes = kept
    graph.nodes = tuple(nodes)
    graph.producer = {vid: node for node in nodes for vid in node.outputs if vid != MISSING}
    for node in nodes:
        if not node.subgraphs:
            continue
        subgraphs = [g for sub in node.subgraphs.values() for g in (sub if isinstance(sub, list) else [sub])]
        for subgraph in subgraphs:
            _inline_constant_captures(graph, subgraph)
        names = []
        for subgraph in subgraphs:
            names += [name for name in subgraph.captures if name not in names]
        node.captures = tuple(graph.ids[name] for name in names)
        for subgraph in subgraphs:
            folded += fold_constants(subgraph, options, shared)
    _share_equal_constants(graph, shared)
    return folded


def _share_equal_constants(graph: Graph, shared: dict) -> None:
    """Each small read-only constant replaced by the first array of its value seen in the model."""
    for vid, value in graph.constants.items():
        if (type(value) is np.ndarray and value.nbytes <= SHARED_BYTES and not value.flags.writeable
                and not value.dtype.hasobject):
            graph.constants[vid] = shared.setdefault((value.dtype, value.shape, value.tobytes()), value)


def _inline_constant_captures(parent: Graph, subgraph: Graph) -> None:
    """A subgraph reading a constant of its parent (e.g. the weights an Optimum merged decoder's
    If branches read) gets it as its own constant: nothing to pass through the CaptureEnv each
    run, and nodes of the subgraph that read only constants (a transposed tied embedding) fold."""
    kept = []
    for name, local in zip(subgraph.captures, subgraph.capture_ids):
        outer = parent.ids[name]
        if outer in parent.constants:
            subgraph.constants[local] = parent.constants[outer]
        else:
            kept.append((name, local))
    subgraph.captures = tuple(name for name, _ in kept)
    subgraph.capture_ids = tuple(local for _, local in kept)
