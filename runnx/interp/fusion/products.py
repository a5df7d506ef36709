"""Products of one input: MatMuls reading the same value by constant 2-D matrices of one depth (a
decoder layer's query, key and value projections; its gate and up projections) become one
SharedInputMatMul node (kernel in `runnx/ops/linalg.py`), so that a decode step hands the decode
pool one job for them, and runs one node, not three. Runs after the other patterns: a MatMul they
take stays theirs.
"""
from __future__ import annotations

from runnx.interp.fusion.matcher import Fused, Matcher
from runnx.interp.ir import Node


def _weight(m: Matcher, node: Node):
    """The constant 2-D right-hand side of a plain MatMul not yet taken, else None."""
    if node.op_type != "MatMul" or node.domain != "" or node.index in m.taken or len(node.inputs) != 2:
        return None
    weight = m.graph.constants.get(node.inputs[1])
    return weight if weight is not None and weight.ndim == 2 else None


def _shared_input(m: Matcher, matmul: Node) -> Fused | None:
    first = _weight(m, matmul)
    if first is None:
        return None
    x = matmul.inputs[0]
    group = [r for r in m.readers.get(x, ()) if r.inputs[0] == x and (w := _weight(m, r)) is not None
             and w.shape[0] == first.shape[0] and w.dtype == first.dtype]
    if len(group) < 2 or group[0] is not matmul:  # each group from its first MatMul
        return None
    return Fused("SharedInputMatMul", group, (x, *(n.inputs[1] for n in group)), tuple(n.outputs[0] for n in group),
                 {})


PATTERNS = (("MatMul", _shared_input),)
