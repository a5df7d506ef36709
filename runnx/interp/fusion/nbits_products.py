"""4-bit products of one input: onnxruntime's MatMulNBits nodes reading the same value with
constant weights of one depth and block size (a layer's query, key and value projections when
they are apart; its gate and up projections) become one SharedInputMatMulNBits node (kernel in
`runnx/ops/contrib_quantized.py`), and a fused SiluMul reading two of them (the gate and up
products) joins it, as do the SplitHeads splitting a product's heads. A decode step then hands the pool one job for them and runs one node, not
three: each column is still summed alone, in its own order, so the values are the nodes'.

A residual add and RMS norm (onnxruntime's SkipSimplifiedLayerNormalization or a fused AddRMSNorm),
the gated SharedInputMatMulNBits reading its norm, the MatMulNBits down product of its gate and the
residual add and norm of that product and the first sum become one GatedMLPNBits node (kernel in
`runnx/ops/fused_nbits_blocks.py`): a decoder layer's MLP, two native calls a decode step, the
nodes' bits.
"""
from __future__ import annotations

import numpy as np

from runnx.interp.fusion.matcher import Fused, Matcher
from runnx.interp.fusion.products import split_outputs, with_silu_gate
from runnx.interp.ir import MISSING, Node
from runnx.ops._fused_common import DOMAIN

CONTRIB = "com.microsoft"
MAX_PRODUCTS = 3  # three (B, scales, zero points) triples and the input: ten inputs (and SplitHeads' three each)


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
    one kind (or none): up to MAX_PRODUCTS of them, matched from the first of its readers; a product
    whose only reader splits its heads (SplitHeads, as for SharedInputMatMul) gives them itself."""
    if not _four_bit(m, first):
        return None
    x = first.inputs[0]
    shape = (first.attrs.get("K"), first.attrs.get("block_size"), _zero_points(m, first))
    group = [r for r in m.readers.get(x, ()) if r.inputs and r.inputs[0] == x and _four_bit(m, r)
             and (r.attrs.get("K"), r.attrs.get("block_size"), _zero_points(m, r)) == shape][:MAX_PRODUCTS]
    if len(group) < 2 or group[0] is not first:
        return None
    members = list(group)
    outputs, split_inputs, splits = split_outputs(m, members, x)
    inputs = [x] + [v for node in group for v in _weights(node)]
    attrs = {"K": shape[0], "block_size": shape[1], "columns": tuple(node.attrs.get("N") for node in group)}
    if splits:
        attrs["splits"] = tuple(splits)
    outputs = with_silu_gate(m, members, outputs, attrs)
    return Fused("SharedInputMatMulNBits", members, (*inputs, *split_inputs), tuple(outputs), attrs)


_NO_CAST = (0, 1)  # an AddRMSNorm's Casts the block takes: none, or to float32 (ONNX's 1) of float32 sums


def _residual_norm(m: Matcher, node: Node) -> tuple | None:
    """((addend, addend), gamma, (epsilon, one), (sum, norm), skip, (to, cast)) of a residual add and RMS norm
    not yet fused: onnxruntime's SkipSimplifiedLayerNormalization (no beta or bias, its mean and
    inverse standard deviation read by nobody: `Matcher.private` checks) or a fused AddRMSNorm over
    the last axis casting nothing or to float32 (an export's Casts of float32 values, which the
    block's float32 weights mean); a constant float32 gamma and a positive epsilon; else None."""
    constants = m.graph.constants
    if node.index in m.taken:
        return None
    if node.op_type == "SkipSimplifiedLayerNormalization" and node.domain == CONTRIB:
        inputs = tuple(node.inputs) + (MISSING,) * (5 - len(node.inputs))
        outputs = tuple(node.outputs) + (MISSING,) * (4 - len(node.outputs))
        numbers, skip = (node.attrs.get("epsilon", 1e-12), 1.0), 1
        if any(v != MISSING for v in inputs[3:5]):
            return None
        sums, casts = (outputs[3], outputs[0]), (0, 0)
    elif (node.op_type == "AddRMSNorm" and node.domain == DOMAIN and node.attrs.get("axis", -1) == -1
          and node.attrs.get("to", 0) in _NO_CAST and node.attrs.get("cast", 0) in _NO_CAST):
        epsilon, one = node.attrs["epsilon"], node.attrs["one"]
        if epsilon.dtype != np.float32 or one.dtype != np.float32:
            return None
        inputs, numbers = tuple(node.inputs[:3]), (float(epsilon), float(one))
        sums, skip = tuple(node.outputs[:2]), node.attrs.get("skip", 0)
        casts = (node.attrs.get("to", 0), node.attrs.get("cast", 0))
    else:
        return None
    gamma = constants.get(inputs[2])
    if (gamma is None or gamma.dtype != np.float32 or gamma.ndim != 1 or not numbers[0] > 0 or sums[1] == MISSING
            or inputs[0] == inputs[1]):
        return None
    return tuple(inputs[:2]), inputs[2], numbers, sums, skip, casts


def gated_mlp(m: Matcher, closing: Node) -> Fused | None:
    """GatedMLPNBits of (s, n) = a residual norm, the gated 4-bit gate and up products of n
    (SharedInputMatMulNBits of two), the down product of their gate (MatMulNBits of as many rows as
    the gate has columns, back to n's width) and `closing`, the residual norm of it and s; every
    value between read only inside, both norms of one kind, every weight in blocks of one size.
    The product giving the first norm's addend (an attention's output projection) stays its own
    node: joining it as well gained under 1% of a 4-bit decode step, for three more inputs."""
    last = _residual_norm(m, closing)
    if last is None:
        return None
    for position, product in enumerate(last[0]):
        down = m.graph.producer.get(product)
        if down is None or not _four_bit(m, down) or len(m.readers.get(product, ())) != 1:
            continue
        gated = m.graph.producer.get(down.inputs[0])
        if (gated is None or gated.op_type != "SharedInputMatMulNBits" or gated.domain != DOMAIN
                or gated.index in m.taken or len(gated.inputs) != 7 or len(gated.outputs) != 1):
            continue
        attrs = gated.attrs
        columns, width, block_size = tuple(attrs.get("columns", ())), attrs.get("K"), attrs.get("block_size")
        if (attrs.get("gated") not in ((0, 1), (1, 0)) or len(columns) != 2 or columns[0] != columns[1]
                or down.attrs.get("K") != columns[0] or down.attrs.get("N") != width
                or down.attrs.get("block_size") != block_size):
            continue
        first_node = m.graph.producer.get(gated.inputs[0])
        first = _residual_norm(m, first_node) if first_node is not None else None
        if (first is None or first[3] != (last[0][1 - position], gated.inputs[0]) or first[4:] != last[4:]
                or m.graph.constants[first[1]].shape != (width,) or m.graph.constants[last[1]].shape != (width,)):
            continue
        chain = [first_node, gated, down, closing]
        if not m.private(chain, last[3]):
            continue
        inputs = (*first[0], first[1], *gated.inputs[1:], *_weights(down), last[1])
        return Fused("GatedMLPNBits", chain, inputs, last[3],
                     {"K": width, "block_size": block_size, "columns": columns, "gated": tuple(attrs["gated"]),
                      "epsilon": first[2][0], "one": first[2][1], "down_epsilon": last[2][0],
                      "down_one": last[2][1], "skip": int(last[4]), "to": last[5][0], "cast": last[5][1]})
    return None


def _weights(node: Node) -> tuple:
    """A MatMulNBits node's (B, scales, zero points: MISSING when absent)."""
    return tuple((list(node.inputs[1:4]) + [MISSING])[:3])


PATTERNS = (("MatMulNBits", shared_input_products), ("SkipSimplifiedLayerNormalization", gated_mlp),
            ("AddRMSNorm", gated_mlp))
ROUNDS_APART = ()
