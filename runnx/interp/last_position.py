"""Outputs for the last position only: a decoder's logits when only the next token is wanted.

Generation reads the logits of the last position, but Optimum's decoders compute the LM head for
every position of the prompt: a sixth of a small LM's 512-token prefill, and a
speech decoder's head over its prompt rows on every window's first step. With
`Options.last_position` naming such outputs (`generate.decoder.load_decoder` names "logits"), a
named graph output computed by MatMul(h, W) from a constant matrix W (or one dequantized from a
constant, `fusion/dequantized_products.py`), or by a block-quantized
product of h (MatMulNBits, MatMulBnb4: onnxruntime-genai's and transformers.js's 4-bit heads), in
the graph itself or in each branch of the If producing it, and read by no node reads
LastPosition(h) instead (h[..., -1:, :],
`runnx.fused`): the output keeps its rank with one position. Outputs produced any other way are left
as they are.
"""
from __future__ import annotations

from runnx.interp.folding import dequantized_weight
from runnx.interp.ir import Graph, Node
from runnx.ops import registry
from runnx.ops._fused_common import DOMAIN


def keep_last_position(graph: Graph, names) -> int:
    """Rewrite the outputs of `graph` named in `names` (see the module docstring); returns how many
    products now read the last position."""
    kernel = registry.resolve(DOMAIN, "LastPosition", 1)
    return sum(_rewrite(graph, graph.ids[name], kernel) for name in names
               if name in graph.ids and graph.ids[name] in graph.outputs)


def _rewrite(graph: Graph, vid: int, kernel) -> int:
    node = graph.producer.get(vid)
    if node is None:
        return 0
    if node.op_type == "If" and node.domain == "":
        position = node.outputs.index(vid)
        return sum(_rewrite(branch, branch.outputs[position], kernel) for branch in node.subgraphs.values())
    declared = graph.output_info[graph.outputs.index(vid)].shape
    hidden, weight = node.inputs[:2] if (node.domain, node.op_type) in _PRODUCTS and len(node.inputs) >= 2 else (None, None)
    dequantized = graph.producer.get(weight)
    if dequantized is not None and dequantized_weight(graph, dequantized):  # its bytes kept (folding.py)
        weight = dequantized.inputs[0]
    if weight not in graph.constants or declared is None or len(declared) < 2 \
            or (node.op_type == "MatMul" and (len(node.inputs) != 2 or graph.constants[weight].ndim != 2)):
        return 0
    if any(vid in other.inputs or vid in other.captures for other in graph.nodes):
        return 0  # other nodes read every position
    last = graph.new_value(f"{graph.names[hidden]}/last_position")
    index = max(n.index for n in graph.nodes) + 1
    graph.nodes += (Node(index, f"{node.name}/last_position", "LastPosition", DOMAIN, (hidden,), (last,), {}, {}, (),
                         kernel, kernel.since),)
    graph.producer[last] = graph.nodes[-1]
    node.inputs = (last,) + node.inputs[1:]
    return 1


# products of each row of their first input by a constant matrix (their second): a position's logits
# depend on its own row only
_PRODUCTS = frozenset({("", "MatMul"), ("com.microsoft", "MatMulNBits"), ("com.microsoft", "MatMulBnb4")})
