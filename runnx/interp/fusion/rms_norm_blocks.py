"""Fusion patterns of RMSNorm decoder blocks (pre-norm decoders with rotary attention): RMSNorm, the
SiLU-gated MLP activation, rotary embedding (rotate-half), attention over a grouped-query KV cache (the head repeat
by Unsqueeze/Expand/Reshape is what it removes) and the residual add feeding an RMSNorm.
Kernels: `runnx/ops/fused_norms.py`, `fused_rotary.py` and `fused.py` (the attention).
"""
from __future__ import annotations

import numpy as np

from runnx.interp.fusion.matcher import Fused, Matcher
from runnx.interp.ir import MISSING, Node
from runnx.ops._fused_common import DOMAIN

FLOAT, FLOAT16 = 1, 10  # ONNX element types
SCORES_RANK = 4  # (batch, heads, queries, keys): what an attention's scalar constants multiply or fill


def _single_axis(m: Matcher, node: Node) -> int | None:
    """The one reduction axis of a ReduceMean (attribute before opset 18, input after)."""
    axes = node.attrs.get("axes")
    if len(node.inputs) > 1 and node.inputs[1] != MISSING:
        value = m.graph.constants.get(node.inputs[1])
        axes = None if value is None else tuple(int(a) for a in value.reshape(-1))
    if axes is None or len(axes) != 1 or node.attrs.get("keepdims", 1) != 1:
        return None
    return axes[0]


def _rms_norm(m: Matcher, power: Node) -> Fused | None:
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
    epsilon, one = (m.number(v, m.rank(x)) for v in (m.other(add, mean.outputs[0]), divide.inputs[0]))
    if epsilon is None or one is None or divide.inputs[1] != chain[3].outputs[0]:
        return None
    if m.other(scale, divide.outputs[0]) != x:
        return None
    last, casts = scale, []
    readers = m.readers.get(last.outputs[0], ())
    while len(readers) == 1 and readers[0].op_type == "Cast" and readers[0].domain == "":
        last = readers[0]
        casts.append(last.attrs.get("to"))
        chain.append(last)
        readers = m.readers.get(last.outputs[0], ())
    if len(readers) != 1 or readers[0].op_type != "Mul" or readers[0].domain != "":
        return None
    weight_mul = readers[0]
    chain.append(weight_mul)
    if not m.private(chain, weight_mul.outputs[0]):
        return None
    weight = m.other(weight_mul, last.outputs[0])
    if (to := _cast_run(m, casts, weight)) is None:
        return None
    return Fused("RMSNorm", chain, (x, weight), weight_mul.outputs,
                 {"axis": axis, "to": to, "epsilon": epsilon, "one": one})


def _cast_run(m: Matcher, casts: list, weight: int) -> int | None:
    """The one Cast (0: none) RMSNorm's `to` does for this run of Casts before its weight Mul, or None.
    Casts to float16 then one to float32 (a float16 model's rounding, widened again: float16.py)
    are the Cast to float16 when the weight is a float32 constant: the kernel's Mul promotes the
    float16 value back to float32 exactly as that last Cast did."""
    if not casts:
        return 0
    if any(not isinstance(to, int) or to == 0 for to in casts):
        return None
    if len(casts) == 1:
        return casts[0]
    value = m.graph.constants.get(weight)
    if casts[-1] != FLOAT or any(to != FLOAT16 for to in casts[:-1]) or value is None or value.dtype != np.float32:
        return None
    return FLOAT16


def _silu_mul(m: Matcher, sigmoid: Node) -> Fused | None:
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


TO_THE_END = 2 ** 31 - 1  # a Slice end at least this reaches the end of any axis (exporters write INT64_MAX)


def _halves_cut(m: Matcher, negated: Node, kept: Node, axis: int) -> bool:
    """Whether Slice nodes `negated` and `kept` of x cut the Concat's `axis` into x[h:] and x[:h']
    with step 1, whatever h and h' are: their ends and starts constants (to the end, from 0) and
    their axes the Concat's (of x's rank where they differ in sign); h and h' are RotateHalf's inputs,
    checked when it runs."""
    def constant(vid: int):
        value = m.scalar(vid)
        return None if value is None or value.dtype.kind not in "iu" else int(value.reshape(-1)[0])

    for node in (negated, kept):
        _, _, axes, steps = _slice_inputs(node)
        cut = constant(axes)
        if MISSING in node.inputs[1:3] or cut is None or (steps != MISSING and constant(steps) != 1):
            return False
        if cut != axis and ((rank := m.rank(node.inputs[0])) is None or cut % rank != axis % rank):
            return False
    end, start = constant(negated.inputs[2]), constant(kept.inputs[1])
    return end is not None and end >= TO_THE_END and start == 0


def _rotate_half(m: Matcher, concat: Node) -> Fused | None:
    """Add(Mul(x, cos), Mul(Concat(Neg(Slice(x, h, end)), Slice(x, 0, h)), sin))"""
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
    axis = concat.attrs["axis"]
    if not _halves_cut(m, negated, kept, axis) or not m.private(chain, add.outputs[0]):
        return None
    return Fused("RotateHalf", chain, (x, cos, sin, negated.inputs[1], kept.inputs[2]), add.outputs, {"axis": axis})


def _attention(m: Matcher, softmax: Node) -> Fused | None:
    """Where(IsNaN(p), fill, p) @ repeat(V) with p = Softmax((q * a) @ (Transpose(repeat(K)) * b) + bias),
    a, b and fill scalar constants (attributes of the fused node). A head repeat the graph proves
    (`Matcher.head_repeat`) is the attention's `repeat`: the kernel reads each cache head for its
    group of query heads; one it does not prove stays in the graph (the attention reads its output)."""
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
    query_scale = next((v for v in query_mul.inputs if m.number(v, SCORES_RANK) is not None), None)
    key_scale = next((v for v in key_mul.inputs if m.number(v, SCORES_RANK) is not None), None)
    if query_scale is None or key_scale is None:
        return None
    query = m.other(query_mul, query_scale)
    transpose = m.node(m.other(key_mul, key_scale), "Transpose")
    if transpose is None or transpose.attrs.get("perm") != (0, 1, 3, 2):
        return None
    readers = m.readers.get(softmax.outputs[0], ())
    if len(readers) != 2:
        return None
    isnan = next((r for r in readers if r.op_type == "IsNaN"), None)
    where = next((r for r in readers if r.op_type == "Where"), None)
    if isnan is None or where is None or where.inputs[0] != isnan.outputs[0] or where.inputs[2] != softmax.outputs[0]:
        return None
    nan_fill = where.inputs[1]
    readers = m.readers.get(where.outputs[0], ())
    if m.number(nan_fill, SCORES_RANK) is None or len(readers) != 1 or readers[0].op_type != "MatMul":
        return None
    output = readers[0]
    if output.inputs[0] != where.outputs[0]:
        return None
    key, value, repeat, key_repeat, value_repeat = transpose.inputs[0], output.inputs[1], 1, (), ()
    key_found, value_found = m.head_repeat(key), m.head_repeat(value)
    if key_found is None or value_found is None:
        return None  # (an attention without the repeat's nodes is layer_norm_blocks.py's)
    if key_found[1] is not None and key_found[1] == value_found[1]:
        (key_repeat, repeat), value_repeat = key_found, value_found[0]
        key, value = key_repeat[0].inputs[0], value_repeat[0].inputs[0]
    chain = [*key_repeat, transpose, key_mul, query_mul, scores, add, softmax, isnan, where, *value_repeat, output]
    repeated = tuple(nodes[2].outputs[0] for nodes in (key_repeat, value_repeat) if nodes)
    if not m.private(chain, output.outputs[0], shape_read=repeated):
        return None
    attrs = {"axis": axis, "repeat": repeat, **{name: m.number(v, SCORES_RANK) for name, v in
                                                (("query_scale", query_scale), ("key_scale", key_scale),
                                                 ("nan_fill", nan_fill))}}
    return Fused("RepeatedKVAttention", chain, (query, key, value, bias), output.outputs, attrs)


def shape_stand_ins(m: Matcher, fused: Fused) -> list[Fused]:
    """Nodes giving the removed repeated caches to readers of their shape (a zero-stride view)."""
    stand_ins = []
    if fused.op_type != "RepeatedKVAttention" or any(n.domain == DOMAIN for n in fused.members):
        return stand_ins  # only for the attention's own match, not when it grows (merged heads, mask)
    if fused.members[0].op_type != "Unsqueeze":
        return stand_ins  # (a repeat it did not prove stays in the graph)
    inside = {n.index for n in fused.members}
    for kv, reshape in ((fused.inputs[1], fused.members[2]), (fused.inputs[2], fused.members[-2])):
        if any(r.index not in inside for r in m.readers.get(reshape.outputs[0], ())):
            stand_ins.append(Fused("RepeatedKVShape", [], (kv,), reshape.outputs, {"repeat": fused.attrs["repeat"]}))
    return stand_ins


def _add_rms_norm(m: Matcher, add: Node) -> Fused | None:
    """Add(a, b) [-> Cast] -> RMSNorm: the residual add and the (already fused) norm reading it;
    the sum stays an output (the next residual add reads it)."""
    if len(add.inputs) != 2 or MISSING in add.inputs:
        return None
    last, cast = add, 0
    readers = m.readers.get(add.outputs[0], ())
    if len(readers) == 1 and readers[0].op_type == "Cast" and readers[0].domain == "":
        last, cast = readers[0], readers[0].attrs.get("to")
        if not isinstance(cast, int) or cast == 0:
            return None
        readers = m.readers.get(last.outputs[0], ())
    residual = last.outputs[0]
    norm = next((r for r in readers if r.op_type == "RMSNorm" and r.domain == DOMAIN and r.index not in m.taken
                 and r.inputs[0] == residual and residual not in r.inputs[1:]), None)
    if norm is None:
        return None
    chain = [add, last, norm] if cast else [add, norm]
    if not m.private(chain, (residual, norm.outputs[0])):
        return None
    return Fused("AddRMSNorm", chain, (*add.inputs, norm.inputs[1]), (residual, norm.outputs[0]),
                 {**norm.attrs, "cast": cast})


def _fused(m: Matcher, vid: int, op_type: str) -> Node | None:
    """The producer of `vid` if it is a fused `op_type` node not yet taken by another pattern."""
    node = m.graph.producer.get(vid)
    if node is None or node.op_type != op_type or node.domain != DOMAIN or node.index in m.taken:
        return None
    return node


def _rope_append(m: Matcher, key_concat: Node) -> Fused | None:
    """RotateHalf(query), Concat(past_key, RotateHalf(key)), Concat(past_value, value) around one
    RepeatedKVAttention: a layer's rotary embedding and KV cache growth."""
    if len(key_concat.inputs) != 2 or MISSING in key_concat.inputs:
        return None
    rotated_key = _fused(m, key_concat.inputs[1], "RotateHalf")
    present_key = key_concat.outputs[0]
    attention = next((r for r in m.readers.get(present_key, ()) if r.op_type == "RepeatedKVAttention"
                      and r.domain == DOMAIN and r.inputs[1] == present_key), None)
    if rotated_key is None or attention is None:
        return None
    value_concat = m.node(attention.inputs[2], "Concat")
    rotated_query = _fused(m, attention.inputs[0], "RotateHalf")
    if value_concat is None or rotated_query is None or len(value_concat.inputs) != 2 or MISSING in value_concat.inputs:
        return None
    chain = [rotated_query, rotated_key, key_concat, value_concat]
    outputs = (rotated_query.outputs[0], present_key, value_concat.outputs[0])
    if not m.private(chain, outputs):
        return None
    query, *query_rest = rotated_query.inputs
    key, *key_rest = rotated_key.inputs
    inputs = (query, key, value_concat.inputs[1], key_concat.inputs[0], value_concat.inputs[0], *query_rest, *key_rest)
    return Fused("RopeAppend", chain, inputs, outputs,
                 {"query_axis": rotated_query.attrs["axis"], "key_axis": rotated_key.attrs["axis"],
                  "key_cache_axis": key_concat.attrs["axis"], "value_cache_axis": value_concat.attrs["axis"]})


def _merged_heads(m: Matcher, transpose: Node) -> Fused | None:
    """Reshape(Transpose(RepeatedKVAttention(...), (0, 2, 1, 3)), target): the attention's heads
    merged back into (batch, length, hidden), by the attention node itself."""
    attention = _fused(m, transpose.inputs[0], "RepeatedKVAttention")
    readers = m.readers.get(transpose.outputs[0], ())
    if (attention is None or len(attention.inputs) != 4 or transpose.attrs.get("perm") != (0, 2, 1, 3)
            or len(readers) != 1 or readers[0].op_type != "Reshape" or readers[0].domain != ""
            or readers[0].attrs.get("allowzero", 0)):
        return None
    reshape = readers[0]
    chain = [attention, transpose, reshape]
    if not m.private(chain, reshape.outputs[0]):
        return None
    return Fused("RepeatedKVAttention", chain, (*attention.inputs, reshape.inputs[1]), reshape.outputs, attention.attrs)


def _masked_attention(m: Matcher, where: Node) -> Fused | None:
    """Where(Slice(mask, 0, end, axis), then, else), then and else scalar constants, the slice's
    start 0, step 1 and axis constants, read only as the bias of a RepeatedKVAttention: the layer's
    additive mask, computed by the attention node itself (inputs mask and end; no end where the
    graph proves it the key's length)."""
    if len(where.inputs) != 3:
        return None
    then, otherwise = (m.number(v, SCORES_RANK) for v in where.inputs[1:3])
    cut = m.node(where.inputs[0], "Slice") if then is not None and otherwise is not None else None
    readers = m.readers.get(where.outputs[0], ())
    if cut is None or cut.since < 10 or len(readers) != 1:
        return None
    starts, end, axes_given, steps_given = _slice_inputs(cut)
    start, axes, steps = (m.scalar(v) for v in (starts, axes_given, steps_given))  # (None for MISSING)
    if (end == MISSING or start is None or int(start.reshape(-1)[0]) != 0 or axes is None
            or (steps_given != MISSING and (steps is None or int(steps.reshape(-1)[0]) != 1))):
        return None
    attention = readers[0]
    if (attention.op_type != "RepeatedKVAttention" or attention.domain != DOMAIN or attention.index in m.taken
            or attention.inputs[3] != where.outputs[0] or where.outputs[0] in attention.inputs[4:]):
        return None
    chain = [cut, where, attention]
    if not m.private(chain, attention.outputs[0]):
        return None
    merged = attention.inputs[4:5] or (MISSING,)
    ends = () if _keys_end(m, end, attention.inputs[1]) else (end,)  # (none: the keys' count, when it runs)
    inputs = (*attention.inputs[:3], MISSING, *merged, cut.inputs[0], *ends)
    attrs = {**attention.attrs, "mask_axis": int(axes.reshape(-1)[0]), "masked_then": then,
             "masked_else": otherwise}
    return Fused("RepeatedKVAttention", chain, inputs, attention.outputs, attrs)


def _keys_end(m: Matcher, end: int, key: int) -> bool:
    """Whether the graph proves `end` (a 1-element vector) is the key's length, its dim 2: a mask
    cut to the keys by a bound computed from the repeated cache's shape, as transformers exports it."""
    terms, dims = m.static.terms(end), m.static.dim_terms(key)
    return terms is not None and terms.size == 1 and dims is not None and len(dims) == 4 and (
        terms.reshape(-1)[0] == dims[2])


# AddRMSNorm matches the RMSNorm nodes the first pattern made
PATTERNS = (("Pow", _rms_norm), ("Sigmoid", _silu_mul), ("Concat", _rotate_half), ("Softmax", _attention),
            ("Add", _add_rms_norm), ("Concat", _rope_append), ("Transpose", _merged_heads),
            ("Where", _masked_attention))
# Kernels that round apart from the nodes they replace (the scales folded into one, grouped heads, a
# softmax of its own); every other pattern here computes bitwise what its nodes do.
ROUNDS_APART = (_attention,)
