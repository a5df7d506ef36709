"""What a graph states about its values' shapes before anything runs: dims known from constants, the
declared inputs and the ops between them, and the small integer values (shape computations) those
dims make known. Unknown dims are None. A load-time rewrite asks for one value's dims (`dims`) or
one value's integers (`ints`); answers are worked out on demand, back through the producers.

`dim_terms` and `terms` say the same with names for what is unknown: an unknown dim is a `Dim`
named by where it comes from (dim 1 of value 7), carried through the ops that pass dims on, so
that two computations from the same Shape are seen to agree (an Expand's target built from the
dims of the cache it expands repeats that cache's heads: a fact the graph states, not one a
kernel must check at run time).

Why: exporters compute slice bounds, reshape targets and expand targets from shapes at run time
(a rotary embedding's width is Shape(cos)[-1]), so whether a Slice keeps a whole axis, or a Concat
input is empty, is a fact of the graph that only these computations reveal.
"""
from __future__ import annotations

import math
import operator
from collections import Counter
from dataclasses import dataclass

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


@dataclass(frozen=True)
class Dim:
    """An unknown dim (at least 0), named by where it is: dim `axis` of value `vid`."""
    vid: int
    axis: int


class StaticDims:
    def __init__(self, graph: Graph):
        self.graph = graph
        self.declared = {vid: tuple(d if isinstance(d, int) else None for d in info.shape)
                         for vid, info in zip(graph.inputs, graph.input_info) if info.shape is not None}
        self._dims: dict = {}
        self._ints: dict = {}
        self._dim_terms: dict = {}
        self._terms: dict = {}
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

    def dim_terms(self, vid: int) -> tuple | None:
        """The value's dims as ints where known, else `Dim`s (the same object wherever the graph
        shows the dims agree), or None when its rank is unknown."""
        try:
            return self._memo(self._dim_terms, vid, self._find_dim_terms)
        except UNSURE:
            return None

    def terms(self, vid: int):
        """The integer value (`ints`) with the unknown dims it holds as `Dim`s (None elsewhere
        unknown), or None when unknown."""
        try:
            return self._memo(self._terms, vid, self._find_terms)
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
        return self._from_producer(node, self.dims, self.ints)

    def _from_producer(self, node, dims_of, values_of):
        """The dims of the node's (first) output from its inputs' dims (`dims_of`: `dims`, or
        `dim_terms` with names) and integer values (`values_of`: `ints` or `terms`)."""
        op, ins = node.op_type, node.inputs
        if op in SAME_SHAPE:
            return dims_of(ins[0])
        if op in BROADCAST:
            return _broadcast([dims_of(v) for v in ins])
        if op == "MatMul":
            return _matmul(dims_of(ins[0]), dims_of(ins[1]))
        if op == "Transpose":
            own = dims_of(ins[0])
            if own is None:
                return None
            perm = node.attrs.get("perm") or tuple(reversed(range(len(own))))
            return tuple(own[p] for p in perm) if len(perm) == len(own) else None
        if op == "Shape":  # a vector whatever its input, of the input's rank when that is known
            own = self.dims(ins[0])
            return (None,) if own is None else (len(own[slice(node.attrs.get("start", 0), node.attrs.get("end"))]),)
        if op in REDUCE and node.attrs.get("keepdims", 1) == 1:
            own, axes = dims_of(ins[0]), _axes(self, node)
            if own is None or axes is None:
                return None
            axes = {a % len(own) for a in axes} if axes else set(range(len(own)))
            return tuple(1 if i in axes else d for i, d in enumerate(own))
        if op == "Unsqueeze":
            own, axes = dims_of(ins[0]), _axes(self, node)
            if own is None or axes is None:
                return None
            rank = len(own) + len(axes)
            axes = {a % rank for a in axes}
            rest = iter(own)
            return tuple(1 if i in axes else next(rest) for i in range(rank))
        if op == "Concat":
            parts = [dims_of(v) for v in ins]
            if any(p is None for p in parts) or len({len(p) for p in parts}) != 1:
                return None
            axis = node.attrs.get("axis", 0) % len(parts[0])
            total = [p[axis] for p in parts]
            merged = _broadcast([tuple(1 if i == axis else d for i, d in enumerate(p)) for p in parts])
            if merged is None:
                return None
            known = all(isinstance(t, int) for t in total)
            return tuple((sum(total) if known else None) if i == axis else d for i, d in enumerate(merged))
        if op == "Reshape":
            target = values_of(ins[1])
            if target is None:  # its length is still the rank
                length = self.dims(ins[1])
                return None if length is None or len(length) != 1 or length[0] is None else (None,) * length[0]
            return _reshaped(dims_of(ins[0]), target, node.attrs.get("allowzero", 0))
        if op == "Expand":
            target = values_of(ins[1])
            return None if target is None else _broadcast([dims_of(ins[0]), tuple(target.reshape(-1).tolist())])
        if op == "ConstantOfShape":
            target = values_of(ins[0])
            return None if target is None else tuple(target.reshape(-1).tolist())
        if op == "Gather":
            data, indices = dims_of(ins[0]), dims_of(ins[1])
            if data is None or indices is None:
                return None
            axis = node.attrs.get("axis", 0) % len(data)
            return data[:axis] + indices + data[axis + 1:]
        if op == "Slice" and node.since >= 10 and dims_of == self.dims:
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

    # -- named unknown dims -------------------------------------------------------------------------
    def _find_dim_terms(self, vid: int):
        dims = self.dims(vid)
        if dims is None:
            return None
        passed = self._passed_dims(vid)
        if passed is None or len(passed) != len(dims):
            passed = (None,) * len(dims)
        return tuple(d if d is not None else p if p is not None else Dim(vid, i)
                     for i, (d, p) in enumerate(zip(dims, passed)))

    def _passed_dims(self, vid: int):
        """The dims the value's producer passes on from its inputs (None where it makes a new one)."""
        node = self.producer.get(vid)
        if node is None or node.domain != "" or node.outputs[0] != vid:
            return None
        return self._from_producer(node, self.dim_terms, self.terms)

    def _find_terms(self, vid: int):
        known = self.ints(vid)
        if known is not None and all(x is not None for x in known.reshape(-1)):
            return known
        node = self.producer.get(vid)
        if node is None or node.domain != "" or node.outputs[0] != vid:
            return known
        if node.op_type == "Shape":
            own = self.dim_terms(node.inputs[0])
            if own is None:
                return known
            return _objects(own[slice(node.attrs.get("start", 0), node.attrs.get("end"))])
        if node.op_type not in ARITHMETIC or node.subgraphs:
            return known
        args = [self.terms(v) if v != MISSING else None for v in node.inputs]
        if any(a is None and v != MISSING for a, v in zip(args, node.inputs)):
            return known
        if not any(isinstance(x, Dim) for a in args if a is not None for x in a.reshape(-1)):
            return known
        return _partial(node, args)


def _partial(node, args):
    """Element by element over integers some of which are unknown (None)."""
    op, attrs = node.op_type, node.attrs
    try:
        if op in ("Add", "Sub", "Mul", "Div", "Equal", "Max", "Min"):
            a, b = np.broadcast_arrays(args[0], args[1])
            func = {"Add": lambda x, y: x + y, "Sub": lambda x, y: x - y, "Mul": lambda x, y: x * y,
                    "Div": lambda x, y: int(x / y) if y else None, "Equal": lambda x, y: x == y,
                    "Max": max, "Min": min}[op]
            return np.array([None if x is None or y is None else _named(op, x, y)
                             if Dim in (type(x), type(y)) else func(x, y)
                             for x, y in zip(a.reshape(-1), b.reshape(-1))], dtype=object).reshape(a.shape)
        if op == "Where":
            c, a, b = np.broadcast_arrays(*args[:3])
            return np.array([None if x is None or isinstance(x, Dim) else (y if x else z) for x, y, z in
                             zip(c.reshape(-1), a.reshape(-1), b.reshape(-1))], dtype=object).reshape(c.shape)
        if op in ("Cast", "Identity"):
            return args[0]
        if op == "Neg":
            return np.array([None if x is None or isinstance(x, Dim) else -x for x in args[0].reshape(-1)],
                            dtype=object).reshape(args[0].shape)
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
        if op == "Slice" and node.since >= 10 and args[0].ndim == 1:  # (a shape's entries: shape[0:2])
            bounds = [None if a is None else a.reshape(-1).tolist() for a in args[1:5]] + [None] * (5 - len(args))
            starts, ends, axes, steps = bounds[:4]
            if (starts is None or ends is None or len(starts) != 1 or len(ends) != 1 or axes not in (None, [0], [-1])
                    or steps not in (None, [1]) or not all(isinstance(b, int) for b in starts + ends)):
                return None
            return args[0][slice(starts[0], ends[0])]
        if op == "Squeeze":
            axes = attrs.get("axes") if node.since < 13 else (args[1] if len(args) > 1 else None)
            axes = None if axes is None else tuple(int(a) for a in np.reshape(axes, -1))
            return np.squeeze(args[0], axis=axes)
    except (ValueError, IndexError, TypeError, KeyError):
        return None
    return None


def _named(op: str, x, y):
    """A binary op with a named dim: what is known whatever its size (None otherwise)."""
    if op == "Equal":
        if x == y:
            return True
        number = y if isinstance(x, Dim) else x
        return False if isinstance(number, int) and number < 0 else None  # (a dim is never negative)
    if op in ("Mul", "Div") and (y == 1 or (op == "Mul" and x == 1)):
        return x if y == 1 else y
    if op in ("Add", "Sub") and (y == 0 or (op == "Add" and x == 0)):
        return x if y == 0 else y
    return None


def _objects(values) -> np.ndarray:
    array = np.empty(len(values), dtype=object)
    array[:] = list(values)
    return array


def _quotient(numerator, denominator):
    """The product of `numerator`'s terms over `denominator`'s when every named dim cancels (or one
    is left, times 1), or None."""
    if None in numerator or None in denominator:
        return None
    named = Counter(d for d in numerator if isinstance(d, Dim))
    named.subtract(d for d in denominator if isinstance(d, Dim))
    top = math.prod(d for d in numerator if not isinstance(d, Dim))
    bottom = math.prod(d for d in denominator if not isinstance(d, Dim))
    left = [d for d, count in named.items() if count]
    if bottom == 0 or top % bottom or any(count < 0 for count in named.values()):
        return None
    if not left:
        return top // bottom
    return left[0] if len(left) == 1 and named[left[0]] == 1 and top == bottom else None


def _axes(static: StaticDims, node):
    """A node's axes (attribute before opset 13/18, input after), () for none given, None if unknown."""
    if "axes" in node.attrs:
        return tuple(node.attrs["axes"])
    if len(node.inputs) > 1 and node.inputs[1] != MISSING:
        value = static.ints(node.inputs[1])
        return None if value is None or None in value.reshape(-1).tolist() else tuple(int(a) for a in value.reshape(-1))
    return ()


def _broadcast(shapes: list):
    """The dims of shapes broadcast together (ints, `Dim`s or None), or None when they cannot be."""
    if any(s is None for s in shapes):
        return None
    rank = max(len(s) for s in shapes)
    out = []
    for i in range(rank):
        dims = [s[i - rank + len(s)] for s in shapes if i - rank + len(s) >= 0]
        numbers = {d for d in dims if d is not None and not isinstance(d, Dim) and d != 1}
        if len(numbers) > 1:
            return None
        others = {d for d in dims if d != 1}  # named dims and unknowns: one of them, or 1 where all are
        out.append(numbers.pop() if numbers else 1 if not others else others.pop() if len(others) == 1 else None)
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
            fill = None
        elif any(isinstance(d, Dim) for d in (*own, *known)):
            fill = _quotient(own, known)
        else:
            fill = int(np.prod(own)) // max(int(np.prod(known)), 1)
        dims = [fill if d == -1 else d for d in dims]
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
