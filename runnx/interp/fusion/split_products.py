"""Products cut into pieces: MatMul(x, W) with a constant [K, N] W (and optionally an Add of a constant
bias [N]), its result read only by Slices of the last axis (steps 1, disjoint column ranges) or by a
Split of the last axis, becomes one MatMul (+ Add) per piece, W's column block (and the bias's) a new
contiguous constant. Why: an export with fused projections (one query/key/value product cut in
three, one gate/up product cut in halves) then reads as one with separate projections, and the
patterns of the other modules (shared-input products, attention, rotary embedding, the layer
blocks) match it alike.

A rewrite into standard ops that runs before the shape memos (`rewrite_products` in __init__.py):
exporters compute a piece's bounds from the product's shape (Shape, Gather(-1), arithmetic), which
the memos would hide. Those bounds are evaluated here knowing only the product's last dimension (N);
the shape nodes computing them go with the product. A Slice axis given as a positive number is the
last one when the product's rank is known (`_Ranks`: from the declared inputs, through the ops a
decoder's residual stream passes).
"""
from __future__ import annotations

import numpy as np

from runnx.interp.context import RunContext
from runnx.interp.folding import call_out_of_place
from runnx.interp.ir import MISSING, Graph, Node
from runnx.interp.last_position import _new_value
from runnx.interp.options import Options

_BIG = 2 ** 31 - 1  # a Slice end at or past this is "to the end"


class _Shape:
    """The product's shape as the bounds see it: its rank (None: unknown), its last dim n."""

    def __init__(self, rank: int | None, n: int):
        self.rank, self.n = rank, n

    def is_last(self, index: int) -> bool:
        return index == -1 or (self.rank is not None and index == self.rank - 1)


def split_products(graph: Graph) -> int:
    """Rewrite every cut product of `graph` (not of its subgraphs); returns how many were split."""
    readers: dict[int, list[Node]] = {}
    for node in graph.nodes:
        for vid in list(node.inputs) + list(node.captures):
            readers.setdefault(vid, []).append(node)
    ranks = _Ranks(graph)
    ctx = RunContext(Options())
    plans, taken = [], set()
    for node in graph.nodes:
        plan = _plan(graph, readers, ranks, ctx, node)
        if plan is None or any(n.index in taken for n in plan[0]):
            continue
        taken.update(n.index for n in plan[0])
        plans.append(plan)
    if not plans:
        return 0
    next_index = max(n.index for n in graph.nodes) + 1
    new_nodes = []
    for removed, matmul, add, pieces in plans:
        weight = graph.constants[matmul.inputs[1]]
        bias = graph.constants[add.inputs[1] if add.inputs[0] == matmul.outputs[0] else add.inputs[0]] if add else None
        for output, start, end in pieces:
            name = graph.names[output]
            block = _constant(graph, f"{graph.names[matmul.inputs[1]]}[:, {start}:{end}]", weight[:, start:end])
            product = output if add is None else _new_value(graph, f"{name}/product")
            new_nodes.append(Node(next_index, f"{matmul.name}[{start}:{end}]", "MatMul", "", (matmul.inputs[0], block),
                                  (product,), dict(matmul.attrs), {}, (), matmul.kernel, matmul.since))
            next_index += 1
            if add is not None:
                piece_bias = bias if bias.size == 1 else bias[start:end]
                b = _constant(graph, f"{name}/bias", piece_bias)
                new_nodes.append(Node(next_index, f"{add.name}[{start}:{end}]", "Add", "", (product, b), (output,),
                                      dict(add.attrs), {}, (), add.kernel, add.since))
                next_index += 1
    graph.nodes = tuple(n for n in graph.nodes if n.index not in taken) + tuple(new_nodes)
    graph.producer = {vid: node for node in graph.nodes for vid in node.outputs if vid != MISSING}
    return len(plans)


def _plan(graph: Graph, readers: dict, ranks, ctx, matmul: Node):
    """(nodes removed, the MatMul, its bias Add or None, [(piece output, first column, end column)])
    when `matmul` is a cut product, else None."""
    if matmul.op_type != "MatMul" or matmul.domain != "" or len(matmul.inputs) != 2:
        return None
    weight = graph.constants.get(matmul.inputs[1])
    if weight is None or weight.ndim != 2 or weight.dtype.kind != "f" or matmul.inputs[0] in graph.constants:
        return None
    n = weight.shape[1]
    value, add, members = matmul.outputs[0], None, [matmul]
    first = readers.get(value, ())
    if len(first) == 1 and _is_bias_add(graph, first[0], value, weight):
        add = first[0]
        members.append(add)
        value = add.outputs[0]
    if value in graph.outputs or matmul.outputs[0] in graph.outputs:
        return None
    shape = _Shape(ranks.rank(matmul.inputs[0]), n)
    cuts = [r for r in readers.get(value, ()) if r.op_type in ("Slice", "Split")]
    shapes = [r for r in readers.get(value, ()) if r.op_type == "Shape"]
    if not cuts or len(cuts) + len(shapes) != len(readers.get(value, ())):
        return None
    chain = _shape_chain(graph, readers, shapes, value)
    if chain is None:
        return None
    known = _Evaluator(graph, chain, value, shape, ctx)
    pieces = []
    for cut in cuts:
        if cut.domain != "" or cut.inputs[0] != value or value in cut.inputs[1:] or cut.captures:
            return None
        found = _slice_piece(cut, known, shape) if cut.op_type == "Slice" else _split_pieces(cut, known, shape)
        if found is None:
            return None
        pieces += found
    ranges = sorted((start, end) for _, start, end in pieces)
    if any(end <= start for start, end in ranges) or any(b[0] < a[1] for a, b in zip(ranges, ranges[1:])):
        return None
    inside = {node.index for node in [*cuts, *chain]}
    for node in chain:  # the bounds' nodes are read only by the cuts and each other
        for vid in node.outputs:
            if vid in graph.outputs or any(r.index not in inside or (r in cuts and r.inputs[0] == vid)
                                           for r in readers.get(vid, ())):
                return None
    return [*members, *cuts, *chain], matmul, add, pieces


def _is_bias_add(graph: Graph, add: Node, product: int, weight) -> bool:
    if add.op_type != "Add" or add.domain != "" or add.since < 7 or len(add.inputs) != 2 or add.inputs.count(product) != 1:
        return False
    bias = graph.constants.get(add.inputs[1] if add.inputs[0] == product else add.inputs[0])
    return bias is not None and bias.ndim == 1 and bias.shape[0] in (1, weight.shape[1]) and bias.dtype == weight.dtype


def _shape_chain(graph: Graph, readers: dict, shapes: list, value: int) -> list | None:
    """The nodes computing from `value`'s shape (the `shapes` reading it) and constants alone, or
    None when one of them also reads another computed value."""
    chain, seen, todo = [], set(), list(shapes)
    while todo:
        node = todo.pop()
        if node.index in seen:
            continue
        if node.op_type in ("Slice", "Split") and node.inputs and node.inputs[0] == value:
            continue  # a cut: its bounds are checked as such
        seen.add(node.index)
        if node.subgraphs or node.captures or node.domain != "":
            return None
        chain.append(node)
        for vid in node.outputs:
            todo += readers.get(vid, ())
    made = {vid for node in chain for vid in node.outputs}
    for node in chain:
        if any(v != MISSING and v not in made and v not in graph.constants and not (v == value and node.op_type == "Shape")
               for v in node.inputs):
            return None
    return chain


class _Evaluator:
    """Values of the bounds: constants, and the chain's values computed from the product's shape
    knowing only its last dim (None where that is not enough)."""

    def __init__(self, graph: Graph, chain: list, value: int, shape: _Shape, ctx):
        self.graph, self.value, self.shape, self.ctx = graph, value, shape, ctx
        self.producer = {vid: node for node in chain for vid in node.outputs}
        self.known: dict = {}

    def __call__(self, vid: int):
        if vid == MISSING:
            return None
        if vid in self.graph.constants:
            return self.graph.constants[vid]
        if vid not in self.known:
            self.known[vid] = None  # (a cycle reads as unknown)
            node = self.producer.get(vid)
            if node is not None:
                self._run(node)
        return self.known.get(vid)

    def _run(self, node: Node) -> None:
        args = [self.shape if v == self.value else self(v) for v in node.inputs]
        outputs = None
        if node.op_type == "Shape":
            start, end = node.attrs.get("start", 0), node.attrs.get("end")
            if end is None and self.shape.is_last(start):
                outputs = [np.array([self.shape.n], np.int64)]
            else:
                outputs = [self.shape]
        elif any(isinstance(a, _Shape) for a in args):
            outputs = [self._read_shape(node, args)]
        elif all(a is not None or v == MISSING for a, v in zip(args, node.inputs)):
            try:
                result = call_out_of_place(node, args, self.ctx)
            except Exception:  # noqa: BLE001 - unknown, so the product stays whole
                result = None
            outputs = list(result) if type(result) is tuple else [result]
        for vid, out in zip(node.outputs, outputs or ()):
            self.known[vid] = out if isinstance(out, (np.ndarray, np.generic, _Shape)) else None

    def _read_shape(self, node: Node, args: list):
        """Gather(shape, [-1]) or Slice(shape, -1, end): the last dim."""
        shape = args[0]
        if not isinstance(shape, _Shape) or any(isinstance(a, _Shape) for a in args[1:]):
            return None
        if node.op_type == "Gather" and node.attrs.get("axis", 0) == 0 and args[1] is not None:
            indices = np.asarray(args[1])
            if indices.size and all(shape.is_last(int(i)) for i in indices.reshape(-1)):
                return np.full(indices.shape, shape.n, np.int64)
        if node.op_type == "Slice" and node.since >= 10 and all(a is not None for a in args[1:3]):
            start, end = (np.asarray(a).reshape(-1) for a in args[1:3])
            axes, steps = args[3] if len(args) > 3 else None, args[4] if len(args) > 4 else None
            if (start.size == 1 and shape.is_last(int(start[0])) and (int(end[0]) >= _BIG or (shape.rank is not None
                    and int(end[0]) >= shape.rank)) and (axes is None or np.asarray(axes).reshape(-1).tolist() in ([0], [-1]))
                    and (steps is None or np.asarray(steps).reshape(-1).tolist() == [1])):
                return np.array([shape.n], np.int64)
        return None


def _ints(value) -> list | None:
    return None if value is None or isinstance(value, _Shape) else [int(v) for v in np.asarray(value).reshape(-1)]


def _slice_piece(cut: Node, known, shape: _Shape):
    if cut.since >= 10:
        starts, ends = _ints(known(cut.inputs[1])), _ints(known(cut.inputs[2]))
        axes = _ints(known(cut.inputs[3])) if len(cut.inputs) > 3 and cut.inputs[3] != MISSING else [0]
        steps = _ints(known(cut.inputs[4])) if len(cut.inputs) > 4 and cut.inputs[4] != MISSING else [1]
    else:
        starts, ends = list(cut.attrs.get("starts", ())), list(cut.attrs.get("ends", ()))
        axes, steps = list(cut.attrs.get("axes", range(len(starts)))), [1]
    if any(v is None or len(v) != 1 for v in (starts, ends, axes, steps)) or steps != [1] or not shape.is_last(axes[0]):
        return None
    start, end = (min(max(v + shape.n if v < 0 else v, 0), shape.n) for v in (starts[0], ends[0]))
    return [(cut.outputs[0], start, end)]


def _split_pieces(cut: Node, known, shape: _Shape):
    if not shape.is_last(cut.attrs.get("axis", 0)):
        return None
    count = len(cut.outputs)
    sizes = cut.attrs.get("split") if cut.since < 13 else (
        _ints(known(cut.inputs[1])) if len(cut.inputs) > 1 and cut.inputs[1] != MISSING else None)
    if sizes is None:
        if "num_outputs" in cut.attrs:  # opset 18: equal pieces, the last smaller
            size = -(-shape.n // cut.attrs["num_outputs"])
            sizes = [min(size, max(shape.n - i * size, 0)) for i in range(count)]
        elif shape.n % count == 0:
            sizes = [shape.n // count] * count
        else:
            return None
    if len(sizes) != count or sum(sizes) != shape.n:
        return None
    pieces, start = [], 0
    for output, size in zip(cut.outputs, sizes):
        if output != MISSING:
            pieces.append((output, start, start + size))
        start += size
    return pieces


def _constant(graph: Graph, name: str, array) -> int:
    vid = _new_value(graph, name)
    array = np.ascontiguousarray(array).copy()
    array.flags.writeable = False
    graph.constants[vid] = array
    return vid


_SAME_RANK = frozenset({"Cast", "CastLike", "Neg", "Sqrt", "Sigmoid", "Tanh", "Relu", "Erf", "Exp", "Log", "Abs",
                        "Reciprocal", "Softmax", "LogSoftmax", "IsNaN", "Not", "Identity", "Transpose", "Slice",
                        "LayerNormalization", "SimplifiedLayerNormalization", "RMSNormalization", "Gelu", "Elu",
                        "LeakyRelu", "HardSigmoid", "Softplus", "Sin", "Cos", "Floor", "Ceil", "Round", "Clip",
                        "Dropout"})
_BROADCAST = frozenset({"Add", "Sub", "Mul", "Div", "Pow", "Where", "Equal", "Less", "Greater", "LessOrEqual",
                        "GreaterOrEqual", "And", "Or", "Xor", "Max", "Min", "Sum", "Mod", "PRelu"})
_REDUCE = frozenset({"ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL2",
                     "ReduceSumSquare", "ReduceLogSumExp"})


class _Ranks:
    """Ranks of values where the graph states enough: declared inputs, constants, and the common
    ops (elementwise, broadcasting, MatMul, Gather, Reshape to a target of known length, ...)."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self.memo: dict = {}
        self.declared = {vid: len(info.shape) for vid, info in zip(graph.inputs, graph.input_info)
                         if info.shape is not None}

    def rank(self, vid: int) -> int | None:
        try:
            return self._rank(vid)
        except RecursionError:
            return None

    def _rank(self, vid: int) -> int | None:
        if vid in self.graph.constants:
            return self.graph.constants[vid].ndim
        if vid in self.declared:
            return self.declared[vid]
        if vid not in self.memo:
            self.memo[vid] = None  # (a cycle reads as unknown)
            node = self.graph.producer.get(vid)
            self.memo[vid] = self._node_rank(node) if node is not None and node.domain == "" and node.outputs[0] == vid \
                else None
        return self.memo[vid]

    def _node_rank(self, node: Node) -> int | None:
        op, inputs = node.op_type, [v for v in node.inputs if v != MISSING]
        if op in _SAME_RANK or (op in _REDUCE and node.attrs.get("keepdims", 1) == 1):
            return self._rank(inputs[0]) if inputs else None
        if op in _BROADCAST:
            ranks = [self._rank(v) for v in inputs]
            return None if None in ranks or not ranks else max(ranks)
        if op == "MatMul":
            a, b = (self._rank(v) for v in inputs[:2])
            if a is None or b is None:
                return None
            return a - 1 if b == 1 else (b - 1 if a == 1 else max(a, b))
        if op == "Gather":
            a, b = (self._rank(v) for v in inputs[:2])
            return None if a is None or b is None else a - 1 + b
        if op in ("Reshape", "ConstantOfShape", "Expand"):
            length = self._length(inputs[-1])
            if op == "Expand" and length is not None:
                own = self._rank(inputs[0])
                return None if own is None else max(own, length)
            return length
        if op == "Unsqueeze":
            axes = node.attrs.get("axes") if node.since < 13 else _ints(self.graph.constants.get(inputs[1]))
            own = self._rank(inputs[0])
            return None if own is None or axes is None else own + len(axes)
        if op in ("Shape", "Range", "NonZero"):
            return 1 if op != "NonZero" else 2
        if op == "Concat":
            return next((r for r in map(self._rank, inputs) if r is not None), None)
        return None

    def _length(self, vid: int) -> int | None:
        """The static length of a 1-D value (a shape), else None."""
        value = self.graph.constants.get(vid)
        if value is not None:
            return value.size if value.ndim == 1 else None
        node = self.graph.producer.get(vid)
        if node is None or node.domain != "":
            return None
        if node.op_type == "Concat":
            lengths = [self._length(v) for v in node.inputs]
            return None if None in lengths else sum(lengths)
        if node.op_type == "Unsqueeze" and self._rank(node.inputs[0]) == 0:
            return 1
        if node.op_type == "Shape" and "start" not in node.attrs and "end" not in node.attrs:
            return self._rank(node.inputs[0])
        if node.op_type in ("Cast", "Identity"):
            return self._length(node.inputs[0])
        return None


ROUNDS_APART = (split_products,)  # a prefill's BLAS product may block a narrower N differently
