"""Load-time fusion: recurring node patterns of exported models become one fused node.

Pattern modules each give PATTERNS, (anchor op, matcher) pairs, the anchor a standard op, an
onnxruntime contrib op or a fused one that an earlier pattern made; a matcher returns a `Fused` whose kernel (domain `runnx.fused`,
`runnx/ops/fused*.py`, `linalg.py`; or a standard fused op's own: onnxruntime's MatMulIntegerToFloat)
computes what the replaced nodes computed. Patterns run in
order, each over the graph the previous ones left.

Most fused kernels compute bitwise what their nodes do; those listed in a module's ROUNDS_APART
(attention, GELU, the blocks holding them) sum in another order, a few units in the last place
apart. A graph that quantizes values it computes (`quantizes_computed_values`) takes only the
bitwise patterns: a quantizer rounds a tensor to a grid whose step is its range / 255, so a
difference of one unit in the last place moves a value a whole step now and then, and each such
step is an error as large as the quantization's own, which the layers after amplify (a dynamically
quantized decoder's greedy tokens change).
"""
from __future__ import annotations

from runnx.interp.fusion import (dequantized_products, integer_products, layer_norm_blocks, nbits_products,
                                 products, repeated_kv_products, rms_norm_blocks, split_products)
from runnx.interp.fusion.identity_cuts import drop_identity_cuts
from runnx.interp.fusion.matcher import Matcher, fused_node
from runnx.interp.ir import MISSING, Graph
from runnx.ops._fused_common import DOMAIN

PATTERNS = (dequantized_products.PATTERNS + integer_products.PATTERNS + rms_norm_blocks.PATTERNS
            + layer_norm_blocks.PATTERNS + repeated_kv_products.PATTERNS + nbits_products.PATTERNS
            + products.PATTERNS)  # products last: see products.py
ROUNDS_APART = frozenset(rms_norm_blocks.ROUNDS_APART + layer_norm_blocks.ROUNDS_APART + products.ROUNDS_APART
                         + split_products.ROUNDS_APART + integer_products.ROUNDS_APART + nbits_products.ROUNDS_APART
                         + dequantized_products.ROUNDS_APART + repeated_kv_products.ROUNDS_APART)
# the domains of anchor nodes: standard ops, runnx's fused ones, onnxruntime's contrib ops
ANCHOR_DOMAINS = ("", DOMAIN, "com.microsoft")
# Rewrites into standard ops, run before the shape memos (which would hide the shape nodes they
# evaluate) so that the patterns then match the graph they leave
REWRITES = (split_products.split_products, drop_identity_cuts)
STAND_INS = (rms_norm_blocks.shape_stand_ins, products.shape_stand_ins, repeated_kv_products.shape_stand_ins)
# Ops rounding a float input they may be given computed to an integer grid: (domain, op type)
QUANTIZERS = frozenset({("", "QuantizeLinear"), ("", "DynamicQuantizeLinear"), ("com.microsoft", "QuantizeLinear"),
                        ("com.microsoft", "DynamicQuantizeMatMul"), ("com.microsoft", "DynamicQuantizeLSTM"),
                        ("com.microsoft", "QAttention")})


def quantizes_computed_values(graph: Graph) -> bool:
    """Whether a quantizer of `graph` reads a value that is not a constant (an activation)."""
    return any((node.domain, node.op_type) in QUANTIZERS and node.inputs and node.inputs[0] != MISSING
               and node.inputs[0] not in graph.constants for node in graph.nodes)


def rewrite(graph: Graph, bitwise: bool = False) -> dict[str, int]:
    """Apply REWRITES to `graph` (not to its subgraphs); returns {rewrite: count}. bitwise: only
    those computing bitwise what the graph did (not ROUNDS_APART)."""
    counts = {}
    for apply in REWRITES:
        if not (bitwise and apply in ROUNDS_APART) and (count := apply(graph)):
            counts[apply.__name__] = count
    return counts


def fuse(graph: Graph, bitwise: bool = False) -> dict[str, int]:
    """Rewrite the patterns of `graph` (not of its subgraphs) into fused nodes; returns {fused op: count}.
    bitwise: only the patterns whose kernels compute bitwise what their nodes do (not ROUNDS_APART)."""
    from runnx.interp.fusion.static_dims import StaticDims  # (it imports the folding kernels)
    counts: dict[str, int] = {}
    static = StaticDims(graph)  # of the graph before fusion: what it states about its values holds after
    for anchor_op, matcher in PATTERNS:
        if bitwise and matcher in ROUNDS_APART:
            continue
        m = Matcher(graph, static)
        found = []
        for node in graph.nodes:
            if node.op_type != anchor_op or node.domain not in ANCHOR_DOMAINS or node.index in m.taken:
                continue
            fused = matcher(m, node)
            if fused is None or any(n.index in m.taken for n in fused.members):
                continue
            m.taken.update(n.index for n in fused.members)
            found.append(fused)
            for stand_ins in STAND_INS:
                found += stand_ins(m, fused)
        if not found:
            continue
        next_index = max(n.index for n in graph.nodes) + 1
        new_nodes = []
        for fused in found:
            index = max((n.index for n in fused.members), default=next_index)
            if not fused.members:
                next_index += 1
            name = fused.members[-1].name if fused.members else graph.names[fused.outputs[0]]
            new_nodes.append(fused_node(index, f"{fused.op_type}({name})", fused.op_type, fused.inputs, fused.outputs,
                                        fused.attrs, fused.domain))
            grown = any(n.op_type == fused.op_type and n.domain == fused.domain for n in fused.members)  # counted once
            counts[fused.op_type] = counts.get(fused.op_type, 0) + (1 if fused.members and not grown else 0)
        graph.nodes = tuple(n for n in graph.nodes if n.index not in m.taken) + tuple(new_nodes)
        graph.producer = {vid: node for node in graph.nodes for vid in node.outputs if vid != MISSING}
    return {op: count for op, count in counts.items() if count}
