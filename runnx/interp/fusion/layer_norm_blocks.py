"""Fusion patterns of LayerNorm transformer blocks as Optimum exports them with transformers' eager
attention (speech encoders, cross-attending decoders): attention whose heads are split from (batch,
length, hidden) by Reshape/Transpose and merged back, with the Reshape targets that
Shape/Gather/Unsqueeze/Concat chains build from other values' shapes (those chains stop running),
the erf GELU with the bias add before it, and the residual add with the LayerNormalization reading
it.
Kernels: `runnx/ops/fused_layer_norm_blocks.py`.
"""
from __future__ import annotations

from runnx.interp.fusion.matcher import Fused, Matcher
from runnx.interp.ir import MISSING, Node

SPLIT = (0, 2, 1, 3)  # (batch, length, heads, depth) <-> (batch, heads, length, depth)
KEY_LAYOUTS = ((0, 1, 3, 2), (0, 2, 3, 1))  # keys as (batch, heads, kv, depth) or (batch, kv, heads, depth)


def _ints(m: Matcher, vid: int) -> tuple | None:
    """The values of an integer constant of rank 0 or 1."""
    value = m.graph.constants.get(vid)
    if value is None or value.dtype.kind not in "iu" or value.ndim > 1:
        return None
    return tuple(int(v) for v in value.reshape(-1))


def _unsqueeze_axes(m: Matcher, node: Node) -> tuple | None:
    if node.since >= 13:
        return _ints(m, node.inputs[1]) if len(node.inputs) > 1 else None
    return node.attrs.get("axes")


def _shape_dim(m: Matcher, vid: int) -> tuple[int, int] | None:
    """(source, axis) when `vid` is the 1-element vector [dimension `axis` of source]:
    Unsqueeze(Gather(Shape(source), axis), [0]) or Gather(Shape(source), [axis])."""
    gather = m.node(vid, "Gather")
    scalar = gather is None
    if scalar:
        unsqueeze = m.node(vid, "Unsqueeze")
        if unsqueeze is None or _unsqueeze_axes(m, unsqueeze) != (0,):
            return None
        gather = m.node(unsqueeze.inputs[0], "Gather")
    if gather is None or gather.attrs.get("axis", 0) != 0:
        return None
    index = m.graph.constants.get(gather.inputs[1])
    shape = m.node(gather.inputs[0], "Shape")
    if index is None or index.ndim != (0 if scalar else 1) or index.size != 1 or index.dtype.kind not in "iu":
        return None
    if shape is None or shape.attrs.get("start", 0) != 0 or shape.attrs.get("end") is not None:
        return None
    axis = int(index.reshape(-1)[0])
    return (shape.inputs[0], axis) if axis >= 0 else None


def _reshape_target(m: Matcher, reshape: Node) -> tuple[int, int, tuple, tuple] | None:
    """(target, source, dims, axes) of a Reshape (allowzero 0). A Concat on axis 0 of constant
    vectors and dimensions of one source value is read through: the target is dims with dims[i]
    replaced by dimension axes[i] of source where axes[i] >= 0 (target MISSING; source MISSING
    when all are constants). A constant target, or one the graph proves (`_proven_target`), is dims
    only; any other (a shape memo's output) is kept."""
    if reshape.since < 5 or reshape.attrs.get("allowzero", 0):
        return None
    proven = _proven_target(m, reshape)
    if proven is not None:
        return MISSING, MISSING, proven, (-1,) * len(proven)
    kept = (reshape.inputs[1], MISSING, (), ())
    concat = m.node(reshape.inputs[1], "Concat")
    if concat is None or concat.attrs.get("axis") != 0:
        return kept
    source, dims, axes = MISSING, [], []
    for piece in concat.inputs:
        values = _ints(m, piece)
        if values is not None and m.graph.constants[piece].ndim == 1:
            dims += values
            axes += [-1] * len(values)
            continue
        found = _shape_dim(m, piece)
        if found is None or source not in (MISSING, found[0]):
            return kept
        source = found[0]
        dims.append(0)
        axes.append(found[1])
    return MISSING, source, tuple(dims), tuple(axes)


def _proven_target(m: Matcher, reshape: Node) -> tuple | None:
    """The Reshape's target as constants: a constant target itself, or one the graph proves from its
    output's dims, each a number or the input's dim at the same place (a 0, which copies it),
    whatever the run's sizes (splitting heads from (batch, length, hidden) to (batch, length,
    heads, depth) by a target computed from the input's shape: (0, 0, heads, depth))."""
    constant = m.graph.constants.get(reshape.inputs[1])
    if constant is not None and constant.ndim == 1 and constant.dtype.kind == "i":
        return tuple(int(d) for d in constant)  # (as written: Reshape's own 0 and -1)
    own, out = m.static.dim_terms(reshape.inputs[0]), m.static.dim_terms(reshape.outputs[0])
    if own is None or out is None:
        return None
    target = []
    for i, dim in enumerate(out):
        if isinstance(dim, int) and dim > 0:
            target.append(dim)
        elif i < len(own) and own[i] == dim:
            target.append(0)
        else:
            return None
    return tuple(target)


def _scaled(m: Matcher, vid: int) -> tuple[int, int, Node | None]:
    """(value, scalar factor, the Mul) for `vid` = Mul(value, constant scalar), else (vid, MISSING,
    None); the factor is MISSING when it is exactly 1 (multiplying by it changes nothing)."""
    mul = m.node(vid, "Mul")
    if mul is not None:
        for position in (0, 1):
            factor = m.scalar(mul.inputs[position])
            if factor is not None:
                return mul.inputs[1 - position], MISSING if factor.reshape(-1)[0] == 1 else mul.inputs[position], mul
    return vid, MISSING, None


def _absorb_bias(m: Matcher, vid: int, chain: list, result: int) -> tuple[int, int]:
    """(x, bias) when `vid` = Add(x, constant vector) (a linear layer's bias) whose output is read
    only inside `chain` (then the Add joins it), else (vid, MISSING)."""
    add = m.node(vid, "Add")
    for position in (0, 1) if add is not None else ():
        constant = m.graph.constants.get(add.inputs[position])
        if constant is not None and constant.ndim == 1 and m.private(chain + [add], result):
            chain.append(add)
            return add.inputs[1 - position], add.inputs[position]
    return vid, MISSING


def _transpose(m: Matcher, vid: int, perms) -> Node | None:
    node = m.node(vid, "Transpose")
    return node if node is not None and node.attrs.get("perm") in perms else None


def _only_reader(m: Matcher, node: Node, op_type: str) -> Node | None:
    readers = m.readers.get(node.outputs[0], ())
    if len(readers) != 1 or readers[0].op_type != op_type or readers[0].domain != "":
        return None
    return readers[0]


def _attention(m: Matcher, softmax: Node) -> Fused | None:
    """Reshape(Transpose(P @ V, SPLIT), target) with P = Softmax(q @ k [+ bias]) [NaN -> fill],
    q = Transpose(Reshape(query [+ query bias] [* s], target), SPLIT) [* s], k = Transpose(key,
    KEY_LAYOUTS) [* s], V = value or a private Transpose(value, SPLIT); the scales and the fill
    float constants of one element (attributes)."""
    if softmax.since < 13 or softmax.attrs.get("axis", -1) not in (-1, 3):
        return None
    scores, bias, add = m.node(softmax.inputs[0], "MatMul"), MISSING, None
    if scores is None:
        add = m.node(softmax.inputs[0], "Add")
        for position in (0, 1) if add is not None else ():
            scores = m.node(add.inputs[position], "MatMul")
            if scores is not None:
                bias = add.inputs[1 - position]
                break
        if scores is None:
            return None
    heads, head_scale, head_mul = _scaled(m, scores.inputs[0])
    query_transpose = _transpose(m, heads, (SPLIT,))
    query_reshape = m.node(query_transpose.inputs[0], "Reshape") if query_transpose is not None else None
    query_target = _reshape_target(m, query_reshape) if query_reshape is not None else None
    keys, key_scale, key_mul = _scaled(m, scores.inputs[1])
    key_transpose = _transpose(m, keys, KEY_LAYOUTS)
    if query_target is None or key_transpose is None:
        return None
    key, key_perm = key_transpose.inputs[0], key_transpose.attrs["perm"]
    if key_perm == KEY_LAYOUTS[1]:  # a first decoder step: read the keys from the split-heads present output
        split = next((r for r in m.readers.get(key, ()) if r.op_type == "Transpose" and r.domain == ""
                      and r.attrs.get("perm") == SPLIT and r.index not in m.taken), None)
        if split is not None:
            key, key_perm = split.outputs[0], KEY_LAYOUTS[0]
    query, query_scale, query_mul = _scaled(m, query_reshape.inputs[0])
    readers = m.readers.get(softmax.outputs[0], ())
    probabilities, nan_fill, nan_nodes = softmax.outputs[0], MISSING, []
    if len(readers) == 2:
        isnan = next((r for r in readers if r.op_type == "IsNaN" and r.domain == ""), None)
        where = next((r for r in readers if r.op_type == "Where" and r.domain == ""), None)
        if isnan is None or where is None or where.inputs[0] != isnan.outputs[0] or where.inputs[2] != probabilities:
            return None
        if m.scalar(where.inputs[1]) is None:
            return None
        probabilities, nan_fill, nan_nodes = where.outputs[0], where.inputs[1], [isnan, where]
        readers = m.readers.get(probabilities, ())
    if len(readers) != 1 or readers[0].op_type != "MatMul" or readers[0].inputs[0] != probabilities:
        return None
    output = readers[0]
    value, value_perm, value_nodes = output.inputs[1], (0, 1, 2, 3), []
    value_transpose = _transpose(m, value, (SPLIT,))
    if value_transpose is not None and len(m.readers.get(value, ())) == 1 and value not in m.requested:
        value, value_perm, value_nodes = value_transpose.inputs[0], SPLIT, [value_transpose]
    merge = _only_reader(m, output, "Transpose")
    if merge is None or merge.attrs.get("perm") != SPLIT:
        return None
    output_reshape = _only_reader(m, merge, "Reshape")
    output_target = _reshape_target(m, output_reshape) if output_reshape is not None else None
    if output_target is None:
        return None
    chain = [n for n in (query_mul, query_reshape, query_transpose, head_mul, key_transpose, key_mul, scores, add,
                         softmax, *nan_nodes, *value_nodes, output, merge, output_reshape) if n is not None]
    if not m.private(chain, output_reshape.outputs[0]):
        return None
    # (the query's scale multiplies it before its heads are split; the others the 4-d heads or scores)
    numbers = {name: m.number(vid, rank) for name, vid, rank in
               (("query_scale", query_scale, 1), ("head_scale", head_scale, 4), ("key_scale", key_scale, 4),
                ("nan_fill", nan_fill, 4)) if vid != MISSING}
    if None in numbers.values():
        return None
    query, query_bias = _absorb_bias(m, query, chain, output_reshape.outputs[0])
    inputs = (query, query_bias, key, value, bias, *query_target[:2], *output_target[:2])
    attrs = {"query_dims": query_target[2], "query_axes": query_target[3], "output_dims": output_target[2],
             "output_axes": output_target[3], "key_perm": key_perm, "value_perm": value_perm,
             **numbers}
    return Fused("HeadsAttention", chain, inputs, output_reshape.outputs, attrs)


def _split_heads(m: Matcher, transpose: Node) -> Fused | None:
    """Transpose(Reshape(x [+ bias], target), SPLIT) with a private Reshape: heads split from (batch,
    length, hidden), as a contiguous array (a KV cache entry, a first step's cross-attention keys)."""
    if transpose.attrs.get("perm") != SPLIT:
        return None
    reshape = m.node(transpose.inputs[0], "Reshape")
    target = _reshape_target(m, reshape) if reshape is not None else None
    chain = [reshape, transpose]
    if target is None or not m.private(chain, transpose.outputs[0]):
        return None
    x, bias = _absorb_bias(m, reshape.inputs[0], chain, transpose.outputs[0])
    attrs = {"dims": target[2], "axes": target[3]}
    return Fused("SplitHeads", chain, (x, bias, *target[:2]), transpose.outputs, attrs)


def _gelu(m: Matcher, erf: Node) -> Fused | None:
    """Mul(Mul(v, Add(Erf(Div(v, c)), one)), half) with v = x or a private Add(x, constant bias); c,
    one and half float constants of one element (attributes)."""
    divide = m.node(erf.inputs[0], "Div")
    if divide is None or m.scalar(divide.inputs[1]) is None:
        return None
    v = divide.inputs[0]
    add = _only_reader(m, erf, "Add")
    if add is None or m.scalar(one := m.other(add, erf.outputs[0])) is None:
        return None
    product = _only_reader(m, add, "Mul")
    if product is None or m.other(product, add.outputs[0]) != v:
        return None
    outer = _only_reader(m, product, "Mul")
    if outer is None or m.scalar(half := m.other(outer, product.outputs[0])) is None:
        return None
    chain = [divide, erf, add, product, outer]
    if not m.private(chain, outer.outputs[0]):
        return None
    x, bias = _absorb_bias(m, v, chain, outer.outputs[0])
    rank = m.rank(v)
    numbers = {"divisor": m.number(divide.inputs[1], rank), "one": m.number(one, rank), "half": m.number(half, rank)}
    if None in numbers.values():
        return None
    return Fused("ErfGelu", chain, (x, bias), outer.outputs, numbers)


def _add_layer_norm(m: Matcher, norm: Node) -> Fused | None:
    """LayerNormalization(Add(a, b), scale, bias) with only its first output read: the residual add
    and the norm (pre-norm transformer layers); the sum stays an output (the next residual add)."""
    if norm.since < 17 or len(norm.inputs) < 3 or norm.inputs[2] == MISSING:
        return None
    add = m.node(norm.inputs[0], "Add")
    if add is None or len(add.inputs) != 2 or MISSING in add.inputs or add.since < 7:
        return None
    if not m.private([add, norm], (add.outputs[0], norm.outputs[0])):
        return None
    attrs = {name: norm.attrs[name] for name in ("axis", "epsilon", "stash_type") if name in norm.attrs}
    return Fused("AddLayerNorm", [add, norm], (*add.inputs, *norm.inputs[1:3]), (add.outputs[0], norm.outputs[0]),
                 attrs)


PATTERNS = (("Softmax", _attention), ("Transpose", _split_heads), ("Erf", _gelu),
            ("LayerNormalization", _add_layer_norm))
# Kernels that round apart from the nodes they replace (attention's blocked products and softmax,
# GELU's erf); the split heads and the residual add + LayerNorm are bitwise their nodes.
ROUNDS_APART = (_attention, _gelu)
