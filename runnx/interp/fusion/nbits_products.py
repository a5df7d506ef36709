"""4-bit products of one input: onnxruntime's MatMulNBits nodes reading the same value with
constant weights of one depth and block size (a layer's query, key and value projections when
they are apart; its gate and up projections) become one SharedInputMatMulNBits node (kernel in
`runnx/ops/contrib_quantized.py`), and a fused SiluMul reading two of them (the gate and up
products) joins it. A decode step then hands the pool one job for them and runs one node, not
three: each column is still summed alone, in its own order, so the values are the nodes'.
"""
from __future__ import annotations

from runnx.interp.fusion.matcher import Fused, Matcher
from runnx.interp.fusion.products import with_silu_gate
from runnx.interp.ir import MISSING, Node

CONTRIB = "com.microsoft"
MAX_PRODUCTS = 3  # three (B, scales, zero points) triples and the input: ten inputs


def _four_bit(m: Matcher, node: Node) -> bool:
    """Whether `node` is a MatMulNBits not yet fused, 4-bit in blocks of 32 or more, with constant
    B, scales and zero points (or none), no g_idx and no bias."""
    if node.op_type != "MatMulNBits" or node.domain != CONTRIB or node.index in m.taken:
        return False
    attrs = node.attrs
    if (attrs.get("bits", 4) != 4 or not isinstance(attrs.get("block_size"), int) or attrs["block_size"] < 32
            or not isinstance(attrs.get("K"), int) or not isinstance(attrs.get("N"), int)):
        return False
    weights, extra = node.inputs[1:4], node.inputs[4:]
    constants = m.graph.constants
    return (len(weights) >= 2 and all(v in constants for v in weights[:2])
            and (len(weights) < 3 or weights[2] == MISSING or weights[2] in constants)
            and all(v == MISSING for v in extra))


def _zero_points(m: Matcher, node: Node):
    """The dtype of the node's zero points, None without them."""
    vid = node.inputs[3] if len(node.inputs) > 3 else MISSING
    return None if vid == MISSING else m.graph.constants[vid].dtype


def shared_input_products(m: Matcher, first: Node) -> Fused | None:
    """MatMulNBits nodes reading `first`'s input with equal K and block_size and zero points of
    one kind (or none): up to MAX_PRODUCTS of them, matched from the first of its readers."""
    if not _four_bit(m, first):
        return None
    x = first.inputs[0]
    shape = (first.attrs.get("K"), first.attrs.get("block_size"), _zero_points(m, first))
    group = [r for r in m.readers.get(x, ()) if r.inputs and r.inputs[0] == x and _four_bit(m, r)
             and (r.attrs.get("K"), r.attrs.get("block_size"), _zero_points(m, r)) == shape][:MAX_PRODUCTS]
    if len(group) < 2 or group[0] is not first:
        return None
    members, outputs = list(group), [node.outputs[0] for node in group]
    inputs = [x]
    for node in group:
        inputs += (list(node.inputs[1:4]) + [MISSING])[:3]
    attrs = {"K": shape[0], "block_size": shape[1], "columns": tuple(node.attrs.get("N") for node in group)}
    outputs = with_silu_gate(m, members, outputs, attrs)
    return Fused("SharedInputMatMulNBits", members, tuple(inputs), tuple(outputs), attrs)


PATTERNS = (("MatMulNBits", shared_input_products),)
ROUNDS_APART = ()
