"""Products of one input: MatMuls reading the same value by constant 2-D matrices of one depth (a
decoder layer's query, key and value projections; its gate and up projections) become one
SharedInputMatMul node (kernel in `runnx/ops/fused_products.py`), so that a decode step hands the
decode pool one job for them, and runs one node, not three. A product whose only reader splits its heads
(SplitHeads, layer_norm_blocks.py's pattern) gives the split heads itself, and a SiluMul of two of
them (the gate and up products) gives its gated product instead of the two. A product read (with or
without a constant bias added) only by a residual add and norm becomes a MatMulAddRMSNorm or
MatMulAddLayerNorm node; one whose only reader adds a constant bias, a BiasedMatMul node. An output
projection's MatMulAddRMSNorm, the gated products reading its norm and the down product's
MatMulAddRMSNorm become one ResidualGatedMLP node (a decode step runs it natively); a LayerNorm
block's MatMulAddLayerNorm, first MLP product, ErfGelu and MatMulAddLayerNorm one ResidualGeluMLP
node. A query projection read only by its attention joins it (ProjectedHeadsAttention), and q/k/v
products whose key and value are appended to caches join the appends (ProjectedAppend): a LayerNorm
decoder layer (an encoder-decoder's) is then five nodes, each a decode step's native call (its
projections and appends, self-attention, output projection and norm, cross-attention, MLP to the
next norm). An RMSNorm decoder layer's q/k/v products join its RopeAppend (ProjectedRopeAppend,
with SplitHeadsShape stand-ins for the shape memos reading the heads): the layer is then three
nodes, a decode step's four native calls (projections, rotary embedding and cache growth; attention;
output projection to the MLP's gate; the MLP's down product to the next norm). Runs after the other
patterns: a MatMul they take stays theirs.
"""
from __future__ import annotations

import numpy as np

from runnx.interp.fusion.matcher import Fused, Matcher
from runnx.interp.ir import MISSING, Node
from runnx.ops._fused_common import DOMAIN

CONTRIB = "com.microsoft"  # onnxruntime's contrib ops


def _weight(m: Matcher, node: Node):
    """The constant 2-D right-hand side of a plain MatMul not yet taken, else None."""
    if node.op_type != "MatMul" or node.domain != "" or node.index in m.taken or len(node.inputs) != 2:
        return None
    weight = m.graph.constants.get(node.inputs[1])
    return weight if weight is not None and weight.ndim == 2 else None


def split_reader(m: Matcher, vid: int, x: int) -> Node | None:
    """The fused SplitHeads node reading `vid` (its x), when it is the value's only reader and its
    other inputs come from x and constants alone (a memo of x's shape): the fused node then needs
    nothing computed after the products (a target built from a later layer's shapes would make a
    cycle)."""
    readers = m.readers.get(vid, ())
    if len(readers) != 1 or vid in m.requested:
        return None
    split = readers[0]
    if split.op_type != "SplitHeads" or split.domain != DOMAIN or split.index in m.taken or split.inputs[0] != vid:
        return None
    return split if all(_from(m, v, x) for v in split.inputs[1:]) else None


def _from(m: Matcher, vid: int, x: int) -> bool:
    """Whether `vid` is absent, a constant, x, or made by one node from those."""
    if vid in (MISSING, x) or vid in m.graph.constants:
        return True
    producer = m.graph.producer.get(vid)
    return producer is not None and all(v in (MISSING, x) or v in m.graph.constants for v in producer.inputs)


def _shared_input(m: Matcher, matmul: Node) -> Fused | None:
    first = _weight(m, matmul)
    if first is None:
        return None
    x = matmul.inputs[0]
    group = [r for r in m.readers.get(x, ()) if r.inputs[0] == x and (w := _weight(m, r)) is not None
             and w.shape[0] == first.shape[0] and w.dtype == first.dtype]
    if len(group) < 2 or group[0] is not matmul:  # each group from its first MatMul
        return None
    members = list(group)
    outputs, split_inputs, splits = split_outputs(m, members, x)
    attrs = {"splits": tuple(splits)} if splits else {}
    outputs = with_silu_gate(m, members, outputs, attrs)
    return Fused("SharedInputMatMul", members, (x, *(n.inputs[1] for n in group), *split_inputs), tuple(outputs),
                 attrs)


def split_outputs(m: Matcher, members: list, x: int) -> tuple[list, list, list]:
    """(outputs, split inputs, splits) of products of x (`members`, one output each): each product's
    output, or the split heads of the SplitHeads that alone reads it (`split_reader`; joining
    `members`), its (bias, target, source) in the split inputs and its (position, dims, axes) in
    the splits."""
    outputs, split_inputs, splits = [], [], []
    for position, node in enumerate(list(members)):
        split = split_reader(m, node.outputs[0], x)
        if split is None:
            outputs.append(node.outputs[0])
            continue
        members.append(split)
        outputs.append(split.outputs[0])
        split_inputs += split.inputs[1:4]  # bias, target, source
        splits.append((position, split.attrs.get("dims", ()), split.attrs.get("axes", ())))
    return outputs, split_inputs, splits


def with_silu_gate(m: Matcher, members: list, outputs: list, attrs: dict) -> list:
    """`outputs` of products fused as `members`, or, when a SiluMul gates two of them (`silu_gate`),
    the others and the gate's output, the SiluMul joining `members` and attrs["gated"] saying which."""
    gate = silu_gate(m, outputs)
    if gate is None:
        return outputs
    silu, positions = gate
    members.append(silu)
    attrs["gated"] = positions
    return [v for i, v in enumerate(outputs) if i not in positions] + [silu.outputs[0]]


def silu_gate(m: Matcher, outputs: list) -> tuple[Node, tuple[int, int]] | None:
    """(SiluMul node, (gate position, up position)) when a fused SiluMul is the only reader of two
    of `outputs` (a layer's gate and up products)."""
    for gate_position, gate in enumerate(outputs):
        readers = m.readers.get(gate, ())
        silu = readers[0] if len(readers) == 1 else None
        if (silu is None or silu.op_type != "SiluMul" or silu.domain != DOMAIN or silu.index in m.taken
                or silu.inputs[0] != gate or silu.inputs[1] not in outputs or silu.inputs[1] == gate):
            continue
        up = silu.inputs[1]
        if len(m.readers.get(up, ())) == 1 and gate not in m.requested and up not in m.requested:
            return silu, (gate_position, outputs.index(up))
    return None


def _bias(m: Matcher, add: Node, product: int, weight) -> int | None:
    """The constant 1-D bias that `add` adds to `product` (a MatMul by `weight`), else None."""
    if add.op_type != "Add" or add.domain != "" or add.since < 7 or len(add.inputs) != 2:
        return None
    bias = m.other(add, product)
    value = m.graph.constants.get(bias)
    if value is None or value.ndim != 1 or value.shape[0] not in (1, weight.shape[1]) or value.dtype != weight.dtype:
        return None
    return bias


def _biased(m: Matcher, add: Node) -> Fused | None:
    """Add(MatMul(x, W), b) with constant W and a constant 1-D bias b, the product read only there:
    a linear layer with its bias, one node."""
    for product in add.inputs:
        matmul = m.graph.producer.get(product)
        weight = _weight(m, matmul) if matmul is not None else None
        if weight is None or (bias := _bias(m, add, product, weight)) is None:
            continue
        if m.private([matmul, add], add.outputs[0]):
            return Fused("BiasedMatMul", [matmul, add], (*matmul.inputs, bias), add.outputs, {})
    return None


_NORMED = {"AddRMSNorm": "MatMulAddRMSNorm", "AddLayerNorm": "MatMulAddLayerNorm"}  # norm node -> fused op


def _normed(m: Matcher, matmul: Node) -> Fused | None:
    """AddRMSNorm / AddLayerNorm (residual, MatMul(x, W) [+ b]) with constant W and an optional
    constant 1-D bias b, the product read only there: a layer's output projection (or second MLP
    product), the residual add and the next norm as one node."""
    weight = _weight(m, matmul)
    if weight is None:
        return None
    chain, value, bias = [matmul], matmul.outputs[0], MISSING
    readers = m.readers.get(value, ())
    if len(readers) == 1 and (found := _bias(m, readers[0], value, weight)) is not None:
        chain.append(readers[0])
        value, bias = readers[0].outputs[0], found
        readers = m.readers.get(value, ())
    if len(readers) != 1:
        return None
    norm = readers[0]
    if norm.op_type == "SkipSimplifiedLayerNormalization" and norm.domain == CONTRIB:
        return _skip_normed(m, chain, norm, value, bias, weight)
    if (norm.op_type not in _NORMED or norm.domain != DOMAIN or norm.index in m.taken
            or list(norm.inputs).count(value) != 1 or value not in norm.inputs[:2]):
        return None
    chain.append(norm)
    if not m.private(chain, tuple(norm.outputs)):
        return None
    residual = norm.inputs[1] if norm.inputs[0] == value else norm.inputs[0]
    return Fused(_NORMED[norm.op_type], chain, (*matmul.inputs, bias, residual, *norm.inputs[2:]), norm.outputs,
                 norm.attrs)


def _skip_normed(m: Matcher, chain: list, norm: Node, value: int, bias: int, weight) -> Fused | None:
    """MatMulAddRMSNorm (skip=1) of onnxruntime's SkipSimplifiedLayerNormalization(residual, MatMul(x, W)
    [+ b], gamma) with a float32 W and a constant float32 gamma, no bias of its own, its mean and
    inverse standard deviation outputs unread: an onnxruntime-genai layer's output projection (or
    down product), residual add and next norm, as the other layouts' MatMul + AddRMSNorm. Its
    epsilon (and the `one` RMSNorm's arithmetic would read) become attributes."""
    inputs = tuple(norm.inputs) + (MISSING,) * (4 - len(norm.inputs))
    residual, skip, gamma, own_bias = inputs[:4]
    outputs = tuple(norm.outputs) + (MISSING,) * (4 - len(norm.outputs))
    epsilon = norm.attrs.get("epsilon", 1e-12)
    scale = m.graph.constants.get(gamma)
    if (norm.index in m.taken or skip != value or residual in (value, MISSING) or own_bias != MISSING
            or weight.dtype != np.float32 or scale is None or scale.dtype != np.float32
            or scale.shape != weight.shape[1:] or not epsilon > 0 or outputs[0] == MISSING):
        return None
    summed, normed = outputs[3], outputs[0]
    if any(v != MISSING and (v in m.requested or m.readers.get(v)) for v in outputs[1:3]):
        return None
    chain.append(norm)
    if not m.private(chain, (summed, normed)):
        return None
    return Fused("MatMulAddRMSNorm", chain, (*chain[0].inputs, bias, residual, gamma), (summed, normed),
                 {"axis": -1, "to": 0, "cast": 0, "skip": 1, "epsilon": np.float32(epsilon), "one": np.float32(1)})


def _residual_gated_mlp(m: Matcher, down: Node) -> Fused | None:
    """MatMulAddRMSNorm(SharedInputMatMul(n, gate, up; gated), down weight, s) after (s, n) =
    MatMulAddRMSNorm(x, ...), the first's outputs and the gated product read only there: a decoder
    layer from its attention's output projection to the next layer's norm, one node."""
    gated = m.graph.producer.get(down.inputs[0])
    if (gated is None or gated.op_type != "SharedInputMatMul" or gated.domain != DOMAIN or gated.index in m.taken
            or len(gated.inputs) != 3 or gated.attrs.get("splits") or gated.attrs.get("gated") not in ((0, 1), (1, 0))):
        return None
    first = m.graph.producer.get(gated.inputs[0])
    if (first is None or first.op_type != "MatMulAddRMSNorm" or first.domain != DOMAIN or first.index in m.taken
            or tuple(first.outputs) != (down.inputs[3], gated.inputs[0])):
        return None
    chain = [first, gated, down]
    if first.attrs.get("skip", 0) != down.attrs.get("skip", 0) or not m.private(chain, tuple(down.outputs)):
        return None
    gate, up = (gated.inputs[1 + p] for p in gated.attrs["gated"])
    norms = {name: tuple(node.attrs.get(a, d) for a, d in (("axis", -1), ("to", 0), ("cast", 0)))
             for name, node in (("norm", first), ("down_norm", down))}
    numbers = {"epsilon": first.attrs["epsilon"], "one": first.attrs["one"], "down_epsilon": down.attrs["epsilon"],
               "down_one": down.attrs["one"]}
    return Fused("ResidualGatedMLP", chain, (*first.inputs, gate, up, *down.inputs[1:3], down.inputs[4]),
                 down.outputs, {**norms, **numbers, **({"skip": 1} if first.attrs.get("skip", 0) else {})})


def _residual_gelu_mlp(m: Matcher, down: Node) -> Fused | None:
    """MatMulAddLayerNorm(ErfGelu(MatMul(n, up weight), ...), down weight, s) after (s, n) =
    MatMulAddLayerNorm(x, ...), the first's outputs and the GELU's input and output read only there:
    a LayerNorm layer from its last attention's output projection to the next layer's norm."""
    gelu = m.graph.producer.get(down.inputs[0])
    if gelu is None or gelu.op_type != "ErfGelu" or gelu.domain != DOMAIN or gelu.index in m.taken:
        return None
    up = m.graph.producer.get(gelu.inputs[0])
    if up is None or _weight(m, up) is None:
        return None
    first = m.graph.producer.get(up.inputs[0])
    if (first is None or first.op_type != "MatMulAddLayerNorm" or first.domain != DOMAIN or first.index in m.taken
            or tuple(first.outputs) != (down.inputs[3], up.inputs[0])):
        return None
    chain = [first, up, gelu, down]
    if not m.private(chain, tuple(down.outputs)):
        return None
    norms = {name: tuple(node.attrs.get(a, d) for a, d in (("axis", -1), ("epsilon", 1e-5), ("stash_type", 1)))
             for name, node in (("norm", first), ("down_norm", down))}
    return Fused("ResidualGeluMLP", chain, (*first.inputs, up.inputs[1], gelu.inputs[1], *down.inputs[1:3],
                                            *down.inputs[4:]), down.outputs, {**norms, **gelu.attrs})


def _appended(m: Matcher, shared: Node) -> Fused | None:
    """SharedInputMatMul(x; three products, two split into heads) whose split products are each
    read only by a Concat appending them to a cache: a layer's query, key and value projections and
    its KV cache growth as one ProjectedAppend node (a decoder's self-attention), which a decode step
    runs natively, writing the new rows into the caches' buffers."""
    splits = shared.attrs.get("splits", ())
    if (shared.domain != DOMAIN or len(shared.inputs) != 10 or shared.attrs.get("gated") or len(splits) != 2
            or len(shared.outputs) != 3):
        return None
    concats = []
    for position, _, _ in splits:
        split = shared.outputs[position]
        readers = m.readers.get(split, ())
        concat = readers[0] if len(readers) == 1 else None
        if (concat is None or concat.op_type != "Concat" or concat.domain != "" or concat.index in m.taken
                or len(concat.inputs) != 2 or concat.inputs[1] != split or concat.inputs[0] in shared.outputs):
            return None
        concats.append(concat)
    (query,) = {0, 1, 2} - {position for position, _, _ in splits}
    chain = [shared, *concats]
    outputs = (shared.outputs[query], *(c.outputs[0] for c in concats))
    if not m.private(chain, outputs):
        return None
    x, weights = shared.inputs[0], shared.inputs[1:4]
    attrs = {"key_dims": splits[0][1], "key_axes": splits[0][2], "value_dims": splits[1][1],
             "value_axes": splits[1][2], "key_axis": concats[0].attrs.get("axis"),
             "value_axis": concats[1].attrs.get("axis")}
    inputs = (x, concats[0].inputs[0], concats[1].inputs[0], weights[query], weights[splits[0][0]],
              weights[splits[1][0]], *shared.inputs[4:])
    return Fused("ProjectedAppend", chain, inputs, outputs, attrs)


def _projected_query(m: Matcher, attention: Node) -> Fused | None:
    """HeadsAttention(MatMul(x, W), ...) with constant W, the product read only as its query (the
    targets from another value's shape, e.g. the norm's before the projection): attention with its
    query projection, one node (a decoder's cross-attention; a decode step runs it natively)."""
    if attention.domain != DOMAIN:
        return None
    matmul = m.graph.producer.get(attention.inputs[0])
    if (matmul is None or _weight(m, matmul) is None or matmul.outputs[0] in attention.inputs[1:]
            or not m.private([matmul, attention], attention.outputs[0])):
        return None
    return Fused("ProjectedHeadsAttention", [matmul, attention], (*matmul.inputs, *attention.inputs[1:]),
                 attention.outputs, attention.attrs)


def _rope_projected(m: Matcher, rope: Node) -> Fused | None:
    """RopeAppend whose query, key and value are the three products of one SharedInputMatMul, each
    split into heads and read only there: an RMSNorm layer's projections, rotary embedding and KV
    cache growth as one ProjectedRopeAppend node (a decode step runs it natively). The splits'
    targets must be constants (`layer_norm_blocks._reshape_target` proves them from the graph's
    dims), the query and the key rotate with the same cos and sin, and the rotation's slice bounds
    are numbers the graph states (`StaticDims.ints`): all attributes, none checked at run time."""
    shared = m.graph.producer.get(rope.inputs[0])
    if (rope.domain != DOMAIN or shared is None or shared.op_type != "SharedInputMatMul" or shared.domain != DOMAIN
            or shared.index in m.taken or len(shared.outputs) != 3 or shared.attrs.get("gated")
            or len(shared.attrs.get("splits", ())) != 3 or len(rope.inputs) != 13):
        return None
    positions = [shared.outputs.index(v) if v in shared.outputs else -1 for v in rope.inputs[:3]]
    if sorted(positions) != [0, 1, 2] or not m.private([shared, rope], tuple(rope.outputs), tuple(rope.inputs[:3])):
        return None
    query_cos, query_sin, *query_bounds = rope.inputs[5:9]
    key_cos, key_sin, *key_bounds = rope.inputs[9:13]
    bounds = [_number_of(m, v) for v in (*query_bounds, *key_bounds)]
    if (query_cos, query_sin) != (key_cos, key_sin) or None in bounds:
        return None
    splits = {position: (n, dims, axes) for n, (position, dims, axes) in enumerate(shared.attrs["splits"])}
    biases, attrs = [], {**rope.attrs, "query_bounds": tuple(bounds[:2]), "key_bounds": tuple(bounds[2:])}
    for name, position in zip(("query", "key", "value"), positions):
        n, dims, axes = splits[position]
        bias, target, source = shared.inputs[4 + 3 * n:7 + 3 * n]
        if target != MISSING or source != MISSING or any(a != -1 for a in axes):
            return None  # (a target known only at run time)
        biases.append(bias)
        attrs[f"{name}_dims"] = dims
    inputs = (shared.inputs[0], *(shared.inputs[1 + p] for p in positions), *biases, *rope.inputs[3:7])
    return Fused("ProjectedRopeAppend", [shared, rope], inputs, rope.outputs, attrs)


def _number_of(m: Matcher, vid: int) -> int | None:
    """The one integer a value holds whatever the run (a constant, or a shape computation the graph's
    dims decide), or None."""
    value = m.static.ints(vid)
    if value is None or value.size != 1:
        return None
    number = value.reshape(-1)[0]
    return number if isinstance(number, int) else None


def shape_stand_ins(m: Matcher, fused: Fused) -> list[Fused]:
    """Nodes giving values computed inside a fused node to readers of their shape (zero-strided
    views): ProjectedRopeAppend's split heads (SplitHeadsShape of x and the product's weight)."""
    if fused.op_type != "ProjectedRopeAppend" or len(fused.members) != 2:
        return []
    rope = fused.members[1]
    x, weights = fused.inputs[0], fused.inputs[1:4]
    stand_ins = []
    for n, (name, heads) in enumerate(zip(("query", "key", "value"), rope.inputs[:3])):
        if _read_outside(m, fused, heads):
            dims = fused.attrs[f"{name}_dims"]
            stand_ins.append(Fused("SplitHeadsShape", [], (x, weights[n], MISSING, MISSING), (heads,),
                                   {"dims": dims, "axes": (-1,) * len(dims)}))
    return stand_ins


def _read_outside(m: Matcher, fused: Fused, vid: int) -> bool:
    """Whether a node outside `fused` reads `vid` (for its shape only: the matcher made sure)."""
    inside = {n.index for n in fused.members}
    return any(r.index not in inside for r in m.readers.get(vid, ()))


PATTERNS = (("MatMul", _shared_input), ("MatMul", _normed), ("Add", _biased),
            ("MatMulAddRMSNorm", _residual_gated_mlp), ("MatMulAddLayerNorm", _residual_gelu_mlp),
            ("HeadsAttention", _projected_query), ("SharedInputMatMul", _appended),
            ("RopeAppend", _rope_projected))
# The blocks holding an attention round as their attention does, apart from the nodes they replace
# (a GELU MLP's as its ErfGelu); the products, biases and norms round as numpy does.
ROUNDS_APART = (_residual_gelu_mlp, _projected_query)
