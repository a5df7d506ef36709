"""Load-time fusion: recurring node patterns of exported decoders become one fused node.

Each matcher starts from an anchor node, walks its producers and checks ops, attributes and
constants; every value computed inside the pattern must be read only inside it (or, for the
repeated KV cache, only for its shape), so removing the pattern's nodes changes nothing else. The
fused kernels (`runnx/ops/fused.py`) compute what the nodes computed. Patterns: RMSNorm, the
SiLU-gated MLP activation, rotary embedding (rotate-half) and attention over a grouped-query
KV cache (the head repeat by Unsqueeze/Expand/Reshape is what it removes).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from runnx.interp.ir import MISSING, Graph, Node
from runnx.ops import registry
from runnx.ops.fused import DOMAIN

SHAPE_READERS = ("Shape", "Size")


@dataclass
class Fused:
    op_type: str
    members: list  # nodes replaced
    inputs: tuple  # value ids (MISSING for an absent optional input)
    outputs: tuple
    attrs: dict


class _Matcher:
    def __init__(self, graph: Graph):
        self.graph = graph
        self.readers: dict[int, list[Node]] = {}
        for node in graph.nodes:
            for vid in list(node.inputs) + list(node.captures):
                self.readers.setdefault(vid, []).append(node)
        self.requested = set(graph.outputs)
        self.taken: set[int] = set()

    def node(self, vid: int, op_type: str) -> Node | None:
        """The producer of `vid` if it is a standard `op_type` node not yet fused."""
        node = self.graph.producer.get(vid)
        if node is None or node.op_type != op_type or node.domain != "" or node.index in self.taken:
            return None
        return node

    def scalar(self, vid: int):
        value = self.graph.constants.get(vid)
        return value if value is not None and value.size == 1 else None

    def private(self, members: list[Node], result: int, shape_read: tuple = ()) -> bool:
        """Values made inside `members` (but `result`) are read only inside them; those in
        `shape_read` may also be read by nodes reading only their shape."""
        inside = {n.index for n in members}
        for node in members:
            for vid in node.outputs:
                if vid == MISSING or vid == result:
                    continue
                if vid in self.requested:
                    return False
                for reader in self.readers.get(vid, ()):
                    if reader.index not in inside and not (vid in shape_read and _reads_shape_only(reader, vid)):
                        return False
        return True

    def other(self, node: Node, vid: int) -> int:
        """The other input of a binary node, given one."""
        a, b = node.inputs[:2]
        return b if a == vid else a


def _reads_shape_only(node: Node, vid: int) -> bool:
    if node.op_type in SHAPE_READERS and node.domain == "":
        return True
    roots = getattr(node.kernel.fn, "roots", ())  # a shape memo node reads its roots' shapes only
    return vid in roots and vid not in getattr(node.kernel.fn, "external", ())


def _single_axis(m: _Matcher, node: Node) -> int | None:
    """The one reduction axis of a ReduceMean (attribute before opset 18, input after)."""
    axes = node.attrs.get("axes")
    if len(node.inputs) > 1 and node.inputs[1] != MISSING:
        value = m.graph.constants.get(node.inputs[1])
        axes = None if value is None else tuple(int(a) for a in value.reshape(-1))
    if axes is None or len(axes) != 1 or node.attrs.get("keepdims", 1) != 1:
        return None
    return axes[0]


def _rms_norm(m: _Matcher, power: Node) -> Fused | None:
    """Pow(x, 2) -> ReduceMean -> Add(eps) -> Sqrt -> Div(1, .) -> Mul(x, .) [-> Cast] -> Mul(w, .)"""
    x, two = power.inputs
    exponent = m.scalar(two)
    if exponent is None or float(exponent.reshape(-1)[0]) != 2.0 or len(m.readers.get(power.outputs[0], ())) != 1:
        return None
    mean = m.readers[power.outputs[0]][0]
    if mean.op_type != "ReduceMean" or mean.domain != "" or (axis := _single_axis(m, mean)) is None:
        return None
    chain = [power, mean]
    for op in ("Add", "Sqrt", "Div", "Mul"):
        readers = m.readers.get(chain[-1].outputs[0], ())
        if len(readers) != 1 or readers[0].op_type != op or readers[0].domain != "":
            return None
        chain.append(readers[0])
    add, _, divide, scale = chain[2:]
    epsilon = m.other(add, mean.outputs[0])
    one = divide.inputs[0]
    if m.scalar(epsilon) is None or m.scalar(one) is None or divide.inputs[1] != chain[3].outputs[0]:
        return None
    if m.other(scale, divide.outputs[0]) != x:
        return None
    last, to = scale, 0
    readers = m.readers.get(last.outputs[0], ())
    if len(readers) == 1 and readers[0].op_type == "Cast" and readers[0].domain == "":
        last, to = readers[0], readers[0].attrs.get("to")
        chain.append(last)
        readers = m.readers.get(last.outputs[0], ())
        if not isinstance(to, int) or to == 0:
            return None
    if len(readers) != 1 or readers[0].op_type != "Mul" or readers[0].domain != "":
        return None
    weight_mul = readers[0]
    chain.append(weight_mul)
    if not m.private(chain, weight_mul.outputs[0]):
        return None
    weight = m.other(weight_mul, last.outputs[0])
    return Fused("RMSNorm", chain, (x, epsilon, one, weight), weight_mul.outputs, {"axis": axis, "to": to})


def _silu_mul(m: _Matcher, sigmoid: Node) -> Fused | None:
    """Mul(Mul(g, Sigmoid(g)), up)"""
    gate = sigmoid.inputs[0]
    readers = m.readers.get(sigmoid.outputs[0], ())
    if len(readers) != 1 or readers[0].op_type != "Mul" or m.other(readers[0], sigmoid.outputs[0]) != gate:
        return None
    product = readers[0]
    readers = m.readers.get(product.outputs[0], ())
    if len(readers) != 1 or readers[0].op_type != "Mul" or readers[0].domain != "":
        return None
    outer = readers[0]
    chain = [sigmoid, product, outer]
    if not m.private(chain, outer.outputs[0]):
        return None
    return Fused("SiluMul", chain, (gate, m.other(outer, product.outputs[0])), outer.outputs, {})


def _slice_inputs(node: Node) -> tuple:
    return tuple(node.inputs[1:]) + (MISSING,) * (5 - len(node.inputs))


def _rotate_half(m: _Matcher, concat: Node) -> Fused | None:
    """Add(Mul(x, cos), Mul(Concat(Neg(Slice(x)), Slice(x)), sin))"""
    if len(concat.inputs) != 2 or concat.since < 4:
        return None
    negate = m.node(concat.inputs[0], "Neg")
    kept = m.node(concat.inputs[1], "Slice")
    negated = m.node(negate.inputs[0], "Slice") if negate is not None else None
    if kept is None or negated is None or kept.since < 10 or negated.since < 10:
        return None
    x = kept.inputs[0]
    if negated.inputs[0] != x:
        return None
    readers = m.readers.get(concat.outputs[0], ())
    if len(readers) != 1 or readers[0].op_type != "Mul":
        return None
    rotated_mul = readers[0]
    sin = m.other(rotated_mul, concat.outputs[0])
    readers = m.readers.get(rotated_mul.outputs[0], ())
    if len(readers) != 1 or readers[0].op_type != "Add":
        return None
    add = readers[0]
    plain_mul = m.node(m.other(add, rotated_mul.outputs[0]), "Mul")
    if plain_mul is None or x not in plain_mul.inputs[:2]:
        return None
    cos = m.other(plain_mul, x)
    chain = [negated, kept, negate, concat, rotated_mul, plain_mul, add]
    if not m.private(chain, add.outputs[0]):
        return None
    inputs = (x, cos, sin) + _slice_inputs(negated) + _slice_inputs(kept)
    return Fused("RotateHalf", chain, inputs, add.outputs, {"axis": concat.attrs["axis"]})


def _repeat(m: _Matcher, vid: int):
    """(Unsqueeze, Expand, Reshape) nodes repeating a KV cache's heads, ending in `vid`."""
    reshape = m.node(vid, "Reshape")
    expand = m.node(reshape.inputs[0], "Expand") if reshape is not None else None
    unsqueeze = m.node(expand.inputs[0], "Unsqueeze") if expand is not None else None
    if unsqueeze is None or reshape.attrs.get("allowzero", 0) or unsqueeze.since < 13:
        return None
    return unsqueeze, expand, reshape


def _attention(m: _Matcher, softmax: Node) -> Fused | None:
    """Where(IsNaN(p), fill, p) @ repeat(V) with p = Softmax((q * a) @ (Transpose(repeat(K)) * b) + bias)"""
    axis = softmax.attrs.get("axis", -1 if softmax.since >= 13 else 1)
    if softmax.since < 13 and axis not in (-1, 3):
        return None
    add = m.node(softmax.inputs[0], "Add")
    if add is None:
        return None
    for position in (0, 1):
        scores = m.node(add.inputs[position], "MatMul")
        if scores is not None:
            bias = add.inputs[1 - position]
            break
    else:
        return None
    query_mul = m.node(scores.inputs[0], "Mul")
    key_mul = m.node(scores.inputs[1], "Mul")
    if query_mul is None or key_mul is None:
        return None
    query_scale = next((v for v in query_mul.inputs if m.scalar(v) is not None), None)
    key_scale = next((v for v in key_mul.inputs if m.scalar(v) is not None), None)
    if query_scale is None or key_scale is None:
        return None
    query = m.other(query_mul, query_scale)
    transpose = m.node(m.other(key_mul, key_scale), "Transpose")
    if transpose is None or transpose.attrs.get("perm") != (0, 1, 3, 2):
        return None
    key_repeat = _repeat(m, transpose.inputs[0])
    readers = m.readers.get(softmax.outputs[0], ())
    if key_repeat is None or len(readers) != 2:
        return None
    isnan = next((r for r in readers if r.op_type == "IsNaN"), None)
    where = next((r for r in readers if r.op_type == "Where"), None)
    if isnan is None or where is None or where.inputs[0] != isnan.outputs[0] or where.inputs[2] != softmax.outputs[0]:
        return None
    nan_fill = where.inputs[1]
    readers = m.readers.get(where.outputs[0], ())
    if m.scalar(nan_fill) is None or len(readers) != 1 or readers[0].op_type != "MatMul":
        return None
    output = readers[0]
    if output.inputs[0] != where.outputs[0] or (value_repeat := _repeat(m, output.inputs[1])) is None:
        return None
    chain = [*key_repeat, transpose, key_mul, query_mul, scores, add, softmax, isnan, where, *value_repeat, output]
    if not m.private(chain, output.outputs[0], shape_read=(key_repeat[2].outputs[0], value_repeat[2].outputs[0])):
        return None
    repeat_inputs = tuple(v for nodes in (key_repeat, value_repeat)
                          for v in (nodes[0].inputs[0], nodes[0].inputs[1], nodes[1].inputs[1], nodes[2].inputs[1]))
    key, *key_shape = repeat_inputs[:4]
    value, *value_shape = repeat_inputs[4:]
    inputs = (query, key, value, bias, query_scale, key_scale, nan_fill, *key_shape, *value_shape)
    return Fused("RepeatedKVAttention", chain, inputs, output.outputs, {"axis": axis})


def _shape_stand_ins(m: _Matcher, fused: Fused) -> list[Fused]:
    """Nodes giving the removed repeated caches to readers of their shape (a zero-stride view)."""
    stand_ins = []
    if fused.op_type != "RepeatedKVAttention":
        return stand_ins
    inside = {n.index for n in fused.members}
    for kv, axes, expand, target, reshape in ((*fused.inputs[1:2], *fused.inputs[7:10], fused.members[2]),
                                               (*fused.inputs[2:3], *fused.inputs[10:13], fused.members[-2])):
        if any(r.index not in inside for r in m.readers.get(reshape.outputs[0], ())):
            stand_ins.append(Fused("RepeatedKVShape", [], (kv, axes, expand, target), reshape.outputs, {}))
    return stand_ins


PATTERNS = (("Pow", _rms_norm), ("Sigmoid", _silu_mul), ("Concat", _rotate_half), ("Softmax", _attention))


def fuse(graph: Graph) -> dict[str, int]:
    """Rewrite the top-level graph's patterns into fused nodes; returns {fused op: count}."""
    counts: dict[str, int] = {}
    for anchor_op, matcher in PATTERNS:
        m = _Matcher(graph)
        found = []
        for node in graph.nodes:
            if node.op_type != anchor_op or node.domain != "" or node.index in m.taken:
                continue
            fused = matcher(m, node)
            if fused is None or any(n.index in m.taken for n in fused.members):
                continue
            m.taken.update(n.index for n in fused.members)
            found.append(fused)
            found += _shape_stand_ins(m, fused)
        if not found:
            continue
        next_index = max(n.index for n in graph.nodes) + 1
        new_nodes = []
        for fused in found:
            kernel = registry.resolve(DOMAIN, fused.op_type, 1)
            index = max((n.index for n in fused.members), default=next_index)
            if not fused.members:
                next_index += 1
            name = fused.members[-1].name if fused.members else graph.names[fused.outputs[0]]
            new_nodes.append(Node(index, f"{fused.op_type}({name})", fused.op_type, DOMAIN, tuple(fused.inputs),
                                  tuple(fused.outputs), fused.attrs, {}, (), kernel, kernel.since))
            counts[fused.op_type] = counts.get(fused.op_type, 0) + (1 if fused.members else 0)
        graph.nodes = tuple(n for n in graph.nodes if n.index not in m.taken) + tuple(new_nodes)
        graph.producer = {vid: node for node in graph.nodes for vid in node.outputs if vid != MISSING}
    return {op: count for op, count in counts.items() if count}
