"""What a graph states about its values' shapes before anything runs: dims known from constants, the
declared inputs and the ops between them, and the small integer values (shape computations) those
dims make known. Unknown dims are None. A load-time rewrite asks for one value's dims (`dims`) or
one value's integers (`ints`); answers are worked out on demand, back through the producers.

Why: exporters compute slice bounds, reshape targets and expand targets from shapes at run time
(a rotary embedding's width is Shape(cos)[-1]), so whether a Slice keeps a whole axis, or a Concat
input is empty, is a fact of the graph that only these computations reveal.
"""
from __future__ import annotations

import operator

import numpy as np

from runnx.interp.context import RunContext
from runnx.interp.folding import call_out_of_place
from runnx.interp.ir import MISSING, Graph
from runnx.interp.options import Options
from runnx.interp.shape_cache import MEMO_DOMAIN, MEMO_OP

SAME_SHAPE = frozenset({"Cast", "CastLike", "Neg", "Sqrt", "Sigmoid", "Tanh", "Relu", "Erf", "Exp", "Log", "Abs",
                        "Reciprocal", "Softmax", "LogSoftmax", "IsNaN", "Not", "Identity", "Sin", "Cos", "Floor",
                        "Ceil", "Round", "Clip", "Gelu", "Softplus", "LayerNormalization",
                        "SimplifiedLayerNormalization", "RMSNormalization", "Dropout"})
BROADCAST = frozenset({"Add", "Sub", "Mul", "Div", "Pow", "Where", "Equal", "Less", "Greater", "LessOrEqual",
                       "GreaterOrEqual", "And", "Or", "Xor", "Max", "Min", "Mod", "PRelu"})
REDUCE = frozenset({"ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL2", "ReduceSumSquare"})
ARITHMETIC = frozenset({"Add", "Sub", "Mul", "Div", "Equal", "Where", "Cast", "Gather", "Concat", "Unsqueeze",
                        "Squeeze", "Reshape", "Slice", "Neg", "Abs", "Max", "Min", "Mod", "Less", "Greater",
                        "Identity", "ConstantOfShape", "Range", "Not", "And", "Or"})
SMALL = 1024  # integer values worked out here have at most this many elements
# what a malformed graph (or a deep one) may raise while its dims are worked out: then they are unknown
UNSURE = (RecursionError, TypeError, ValueError, IndexError, KeyError, ZeroDivisionError, OverflowError)


class StaticDims:
    def __init__(self, graph: Graph):
        self.graph = graph
        self.declared = {vid: tuple(d if isinstance(d, int) else None for d in info.shape)
                         for vid, info in zip(graph.inputs, graph.input_info) if info.shape is not None}
        self._dims: dict = {}
        self._ints: dict = {}
        self.ctx = RunContext(Options())
        # a shape memo's members are the standard nodes it stands for (shape_cache.py): their outputs'
        # producers, as before the memos were made
        self.producer = dict(graph.producer)
        memos = [node for node in graph.nodes if node.op_type == MEMO_OP and node.domain == MEMO_DOMAIN]
        while memos:
            for member in memos.pop().kernel.fn.members:
                if member.op_type == MEMO_OP and member.domain == MEMO_DOMAIN:
                    memos.append(member)  # (a memo of memos: the model memoizes again after fusion)
                for vid in member.outputs:
                    self.producer[vid] = member

    def dims(self, vid: int) -> tuple | None:
        """The value's dims (None where unknown), or None when its rank is unknown."""
        try:
            return self._memo(self._dims, vid, self._find_dims)
        except UNSURE:
            return None

    def ints(self, vid: int):
        """The integer value as an object array (None where unknown), or None when unknown."""
        try:
            return self._memo(self._ints, vid, self._find_ints)
        except UNSURE:
            return None

    @staticmethod
    def _memo(memo: dict, vid: int, find):
        if vid not in memo:
            memo[vid] = None  # (a cycle reads as unknown)
            memo[vid] = find(vid)
        return memo[vid]

    # -- dims -----------------------------------------------------------------------------------
    def _find_dims(self, vid: int):
        if vid == MISSING:
            return None
        if vid in self.graph.constants:
            return tuple(np.shape(self.graph.constants[vid]))
        if vid in self.declared:
            return self.declared[vid]
        node = self.producer.get(vid)
        if node is None or node.domain != "" or node.outputs[0] != vid:
            return None
        op, ins = node.op_type, node.inputs
        if op in SAME_SHAPE:
            return self.dims(ins[0])
        if op in BROADCAST:
            return _broadcast([self.dims(v) for v in ins])
        if op == "MatMul":
            return _matmul(self.dims(ins[0]), self.dims(ins[1]))
        if op == "Transpose":
            own = self.dims(ins[0])
            if own is None:
                return None
            perm = node.attrs.get("perm") or tuple(reversed(range(len(own))))
            return tuple(own[p] for p in perm) if len(perm) == len(own) else None
        if op == "Shape":  # a vector whatever its input, of the input's rank when that is known
            own = self.dims(ins[0])
            return (None,) if own is None else (len(own[slice(node.attrs.get("start", 0), node.attrs.get("end"))]),)
        if op in REDUCE and node.attrs.get("keepdims", 1) == 1:
            own, axes = self.dims(ins[0]), _axes(self, node)
            if own is None or axes is None:
                return None
            axes = {a % len(own) for a in axes} if axes else set(range(len(own)))
            return tuple(1 if i in axes else d for i, d in enumerate(own))
        if op == "Unsqueeze":
            own, axes = self.dims(ins[0]), _axes(self, node)
            if own is None or axes is None:
                return None
            rank = len(own) + len(axes)
            axes = {a % rank for a in axes}
            rest = iter(own)
            return tuple(1 if i in axes else next(rest) for i in range(rank))
        if op == "Concat":
            parts = [self.dims(v) for v in ins]
            if any(p is None for p in parts) or len({len(p) for p in parts}) != 1:
                return None
            axis = node.attrs.get("axis", 0) % len(parts[0])
            total = [p[axis] for p in parts]
            merged = _broadcast([tuple(1 if i == axis else d for i, d in enumerate(p)) for p in parts])
            if merged is None:
                return None
            return tuple((None if None in total else sum(total)) if i == axis else d for i, d in enumerate(merged))
        if op == "Reshape":
            target = self.ints(ins[1])
            if target is None:  # its length is still the rank
                length = self.dims(ins[1])
                return None if length is None or len(length) != 1 or length[0] is None else (None,) * length[0]
            return _reshaped(self.dims(ins[0]), target, node.attrs.get("allowzero", 0))
        if op == "Expand":
            target = self.ints(ins[1])
            return None if target is None else _broadcast([self.dims(ins[0]), tuple(target.reshape(-1).tolist())])
        if op == "ConstantOfShape":
            target = self.ints(ins[0])
            return None if target is None else tuple(target.reshape(-1).tolist())
        if op == "Gather":
            data, indices = self.dims(ins[0]), self.dims(ins[1])
            if data is None or indices is None:
                return None
            axis = node.attrs.get("axis", 0) % len(data)
            return data[:axis] + indices + data[axis + 1:]
        if op == "Slice" and node.since >= 10:
            return self._sliced(node)
        return None

    def slice_ranges(self, node):
        """(the sliced value's dims, [(start, end, axis, step)] as the graph states them) for a Slice
        (opset 10+) whose input rank, starts and ends are known, else None."""
        if not 3 <= len(node.inputs) <= 5:
            return None
        own = self.dims(node.inputs[0])
        bounds = [self.ints(v) if v != MISSING else None for v in (*node.inputs[1:], *(MISSING,) * (5 - len(node.inputs)))]
        starts, ends, axes, steps = bounds
        if own is None or starts is None or ends is None:
            return None
        axes = list(range(starts.size)) if axes is None else axes.reshape(-1).tolist()
        steps = [1] * starts.size if steps is None else steps.reshape(-1).tolist()
        return own, list(zip(starts.reshape(-1).tolist(), ends.reshape(-1).tolist(), axes, steps))

    def _sliced(self, node):
        found = self.slice_ranges(node)
        if found is None:
            return None
        own, ranges = found
        dims = list(own)
        for start, end, axis, step in ranges:
            if axis is None:
                return None
            axis %= len(own)
            dims[axis] = _slice_length(own[axis], start, end, step)
        return tuple(dims)

    # -- integer values ---------------------------------------------------------------------------
    def _find_ints(self, vid: int):
        if vid == MISSING:
            return None
        if vid in self.graph.constants:
            value = self.graph.constants[vid]
            return value.astype(object) if value.dtype.kind in "iub" and value.size <= SMALL else None
        node = self.producer.get(vid)
        if node is None or node.domain != "" or node.outputs[0] != vid:
            return None
        op = node.op_type
        if op == "Shape":
            own = self.dims(node.inputs[0])
            if own is None:
                return None
            return np.array(own[slice(node.attrs.get("start", 0), node.attrs.get("end"))], dtype=object)
        if op not in ARITHMETIC or node.subgraphs:
            return None
        args = [self.ints(v) if v != MISSING else None for v in node.inputs]
        if any(a is None and v != MISSING for a, v in zip(args, node.inputs)):
            return None
        if all(a is None or all(x is not None for x in a.reshape(-1)) for a in args):
            return self._run(node, args)
        return _partial(node, args)

    def _run(self, node, args):
        """The node's kernel over known integers (small results only)."""
        if node.op_type == "Range" or (node.op_type == "ConstantOfShape" and np.prod(args[0].tolist()) > SMALL):
            return None  # (a result's size is its input's value)
        arrays = [None if a is None else np.array(a.tolist()) if a.size else np.zeros(a.shape, np.int64) for a in args]
        try:
            result = call_out_of_place(node, arrays, self.ctx)
        except Exception:  # noqa: BLE001 - unknown
            return None
        result = result[0] if type(result) is tuple else result
        result = np.asarray(result)
        if result.dtype.kind not in "iub" or result.size > SMALL:
            return None
        return result.astype(object)


def _partial(node, args):
    """Element by element over integers some of which are unknown (None)."""
    op, attrs = node.op_type, node.attrs
    try:
        if op in ("Add", "Sub", "Mul", "Div", "Equal", "Max", "Min"):
            a, b = np.broadcast_arrays(args[0], args[1])
            func = {"Add": lambda x, y: x + y, "Sub": lambda x, y: x - y, "Mul": lambda x, y: x * y,
                    "Div": lambda x, y: int(x / y) if y else None, "Equal": lambda x, y: x == y,
                    "Max": max, "Min": min}[op]
            return np.array([None if x is None or y is None else func(x, y) for x, y in zip(a.reshape(-1), b.reshape(-1))],
                            dtype=object).reshape(a.shape)
        if op == "Where":
            c, a, b = np.broadcast_arrays(*args[:3])
            return np.array([None if x is None else (y if x else z) for x, y, z in
                             zip(c.reshape(-1), a.reshape(-1), b.reshape(-1))], dtype=object).reshape(c.shape)
        if op in ("Cast", "Identity"):
            return args[0]
        if op == "Neg":
            return np.array([None if x is None else -x for x in args[0].reshape(-1)], dtype=object).reshape(args[0].shape)
        if op == "Concat":
            return np.concatenate([a.reshape(a.shape) for a in args], axis=attrs.get("axis", 0))
        if op == "Gather":
            indices = args[1]
            if any(i is None for i in indices.reshape(-1)):
                return None
            return np.array(np.take(args[0], np.array(indices.tolist(), dtype=np.int64), axis=attrs.get("axis", 0)),
                            dtype=object)
        if op == "Unsqueeze":
            axes = attrs.get("axes") if node.since < 13 else args[1]
            if axes is None or any(a is None for a in np.reshape(axes, -1)):
                return None
            return np.expand_dims(args[0], tuple(int(a) for a in np.reshape(axes, -1)))
        if op == "Reshape":
            shape = args[1]
            if any(s is None for s in shape.reshape(-1)):
                return None
            return args[0].reshape([int(s) if s != 0 else args[0].shape[i] for i, s in enumerate(shape.tolist())])
        if op == "Squeeze":
            axes = attrs.get("axes") if node.since < 13 else (args[1] if len(args) > 1 else None)
            axes = None if axes is None else tuple(int(a) for a in np.reshape(axes, -1))
            return np.squeeze(args[0], axis=axes)
    except (ValueError, IndexError, TypeError, KeyError):
        return None
    return None


def _axes(static: StaticDims, node):
    """A node's axes (attribute before opset 13/18, input after), () for none given, None if unknown."""
    if "axes" in node.attrs:
        return tuple(node.attrs["axes"])
    if len(node.inputs) > 1 and node.inputs[1] != MISSING:
        value = static.ints(node.inputs[1])
        return None if value is None or None in value.reshape(-1).tolist() else tuple(int(a) for a in value.reshape(-1))
    return ()


def _broadcast(shapes: list):
    if any(s is None for s in shapes):
        return None
    rank = max(len(s) for s in shapes)
    out = []
    for i in range(rank):
        dims = [s[i - rank + len(s)] for s in shapes if i - rank + len(s) >= 0]
        big = {d for d in dims if d is not None and d != 1}
        if len(big) > 1:
            return None
        if big:
            out.append(big.pop())
        elif all(d == 1 for d in dims):
            out.append(1)
        else:
            out.append(None)
    return tuple(out)


def _matmul(a, b):
    if a is None or b is None or not a or not b:
        return None
    if len(b) == 1:
        return a[:-1]
    if len(a) == 1:
        return b[:-2] + b[-1:]
    batch = _broadcast([a[:-2], b[:-2]])
    return None if batch is None else batch + (a[-2], b[-1])


def _reshaped(own, target, allowzero):
    if target is None:
        return None
    dims = []
    for i, d in enumerate(target.reshape(-1).tolist()):
        if d == 0 and not allowzero:
            d = own[i] if own is not None and i < len(own) else None
        dims.append(d)
    if -1 in dims:
        known = [d for d in dims if d != -1]
        if own is None or None in own or None in known:
            dims = [None if d == -1 else d for d in dims]
        else:
            dims = [int(np.prod(own)) // max(int(np.prod(known)), 1) if d == -1 else d for d in dims]
    return tuple(dims)


def _slice_length(dim, start, end, step):
    start, end, step = (as_int(v) for v in (start, end, step))
    if dim is None or start is None or end is None or step is None or step == 0:
        return None
    return len(range(*slice(start, end, step).indices(dim)))


def as_int(value) -> int | None:
    """A known integer as an int, else None (unknown, or not an integer)."""
    try:
        return operator.index(value)
    except TypeError:
        return None
