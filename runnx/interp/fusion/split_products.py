"""Products cut into pieces: MatMul(x, W) with a constant [K, N] W (and optionally an Add of a constant
bias [N]), its result read only by Slices of the last axis (steps 1, disjoint column ranges) or by a
Split of the last axis, becomes one MatMul (+ Add) per piece, W's column block (and the bias's) a new
contiguous constant. Why: an export with fused projections (one query/key/value product cut in
three, one gate/up product cut in halves) then reads as one with separate projections, and the
patterns of the other modules (shared-input products, attention, rotary embedding, the layer
blocks) match it alike.

A rewrite into standard ops that runs before the shape memos (`rewrite` in __init__.py):
exporters compute a piece's bounds from the product's shape (Shape, Gather(-1), arithmetic), which
the memos would hide. Those bounds are worked out from the graph's static dims (static_dims.py: the
product's last dim is W's), and the shape nodes computing them go with the product. A Slice axis
given as a positive number is the last one when the product's rank is known there too.
"""
from __future__ import annotations

import bisect
import itertools

import numpy as np

from runnx.interp import model_file
from runnx.interp.fusion.static_dims import StaticDims
from runnx.interp.ir import MISSING, Graph, Node


class _Shape:
    """The product's rank (None: unknown) and last dim n."""

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
    static = StaticDims(graph)
    plans, taken = [], set()
    for node in graph.nodes:
        plan = _plan(graph, readers, static, node)
        if plan is None or any(n.index in taken for n in plan[0]):
            continue
        taken.update(n.index for n in plan[0])
        plans.append(plan)
    if not plans:
        return 0
    next_index = max(n.index for n in graph.nodes) + 1
    new_nodes = []
    in_place = _InPlace(graph, readers)
    for _, matmul, add, pieces in plans:
        weight = graph.constants[matmul.inputs[1]]
        bias = graph.constants[add.inputs[1] if add.inputs[0] == matmul.outputs[0] else add.inputs[0]] if add else None
        laid = in_place.blocks(matmul, pieces)
        for output, start, end in pieces:
            name = graph.names[output]
            block = laid[output] if laid else graph.new_constant(f"{graph.names[matmul.inputs[1]]}[:, {start}:{end}]",
                                                                  weight[:, start:end])
            product = output if add is None else graph.new_value(f"{name}/product")
            new_nodes.append(Node(next_index, f"{matmul.name}[{start}:{end}]", "MatMul", "", (matmul.inputs[0], block),
                                  (product,), dict(matmul.attrs), {}, (), matmul.kernel, matmul.since))
            next_index += 1
            if add is not None:
                piece_bias = bias if bias.size == 1 else bias[start:end]
                b = graph.new_constant(f"{name}/bias", piece_bias)
                new_nodes.append(Node(next_index, f"{add.name}[{start}:{end}]", "Add", "", (product, b), (output,),
                                      dict(add.attrs), {}, (), add.kernel, add.since))
                next_index += 1
    graph.nodes = tuple(n for n in graph.nodes if n.index not in taken) + tuple(new_nodes)
    graph.producer = {vid: node for node in graph.nodes for vid in node.outputs if vid != MISSING}
    return len(plans)


class _InPlace:
    """Column blocks laid in their weight's own memory: when the product is the weight's only
    reader in a graph no other graph reads (no captures, no subgraphs), its blocks cover its
    columns, each 64-byte aligned there, and its bytes are runnx's own (`model_file.owned_bytes`)
    and no other constant's: the blocks then take none of the memory and none of the fresh pages
    a copy would (an export with fused projections loaded in the memory of one without). The
    weight stops being a constant (`Graph.moved`: an unrewritten plan rebuilds it)."""

    def __init__(self, graph: Graph, readers: dict):
        self.graph, self.readers = graph, readers
        self.alone = not graph.captures and not any(node.subgraphs for node in graph.nodes)
        self.bounds = self.highest = None  # every constant's bytes, when first asked (`_shared`)
        self.scratch = np.empty(0, np.uint8)  # the weight's bytes while its blocks are laid

    def blocks(self, matmul: Node, pieces: list) -> dict | None:
        """{piece's output: its block's value id}, laid in place, or None (then nothing changed)."""
        graph, vid = self.graph, matmul.inputs[1]
        weight = graph.constants[vid]
        readers = self.readers.get(vid, ())
        if not self.alone or len(readers) != 1 or readers[0] is not matmul or vid in graph.outputs or weight.ndim != 2:
            return None
        depth, width = weight.shape
        ordered = sorted(pieces, key=lambda piece: piece[1])
        if [start for _, start, _ in ordered] != [0] + [end for _, _, end in ordered[:-1]] or ordered[-1][2] != width:
            return None
        if any(depth * start * weight.itemsize % 64 for _, start, _ in ordered):
            return None
        owned = model_file.owned_bytes(weight)
        if owned is None or self._shared(weight):
            return None
        if self.scratch.size < weight.nbytes:
            self.scratch = np.empty(weight.nbytes, np.uint8)
        source = self.scratch[:weight.nbytes].view(weight.dtype).reshape(weight.shape)
        source[...] = weight
        region, laid, moved = owned.view(weight.dtype), {}, []
        for output, start, end in ordered:
            block = region[depth * start:depth * end].reshape(depth, end - start)
            block[...] = source[:, start:end]
            block.flags.writeable = False
            laid[output] = graph.new_value(f"{graph.names[vid]}[:, {start}:{end}]")
            graph.constants[laid[output]] = block
            moved.append((laid[output], start, end))
        del graph.constants[vid]
        graph.moved[vid] = moved
        return laid

    def _shared(self, weight) -> bool:
        """Whether another constant's bytes overlap the weight's (a folded view of it)."""
        if self.bounds is None:  # (low, high, id) by low, and the highest high up to each
            self.bounds = sorted((*_byte_bounds(c), id(c)) for c in self.graph.constants.values()
                                 if isinstance(c, np.ndarray) and c.size)
            self.highest = list(itertools.accumulate([high for _, high, _ in self.bounds], max))
        low, high = _byte_bounds(weight)
        index = bisect.bisect_left(self.bounds, (high,)) - 1  # those before start below high
        while index >= 0 and self.highest[index] > low:
            start, end, other = self.bounds[index]
            if other != id(weight) and end > low:
                return True
            index -= 1
        return False


def _byte_bounds(array: np.ndarray) -> tuple[int, int]:
    """The first and past-the-last addresses of a non-empty array's bytes."""
    low = high = array.ctypes.data
    for size, stride in zip(array.shape, array.strides):
        if stride < 0:
            low += (size - 1) * stride
        else:
            high += (size - 1) * stride
    return low, high + array.itemsize


def rejoined(graph: Graph) -> dict:
    """graph's constants with the weights `_InPlace` moved rebuilt from their blocks (new arrays):
    for a plan of the unrewritten graph, whose nodes read them."""
    constants = dict(graph.constants)
    for vid, blocks in graph.moved.items():
        constants[vid] = np.concatenate([graph.constants[block] for block, _, _ in blocks], axis=1)
        constants[vid].flags.writeable = False
    return constants


def _plan(graph: Graph, readers: dict, static: StaticDims, matmul: Node):
    """(nodes removed, the MatMul, its bias Add or None, [(piece output, first column, end column)])
    when `matmul` is a cut product, else None."""
    if matmul.op_type != "MatMul" or matmul.domain != "" or len(matmul.inputs) != 2 or len(matmul.outputs) != 1:
        return None
    weight = graph.constants.get(matmul.inputs[1])
    if weight is None or weight.ndim != 2 or weight.dtype.kind != "f" or matmul.inputs[0] in graph.constants:
        return None
    n = weight.shape[1]
    value, add, members = matmul.outputs[0], None, [matmul]
    first = readers.get(value, ())
    if len(first) == 1 and len(first[0].outputs) == 1 and _is_bias_add(graph, first[0], value, weight):
        add = first[0]
        members.append(add)
        value = add.outputs[0]
    if value in graph.outputs or matmul.outputs[0] in graph.outputs:
        return None
    cuts = [r for r in readers.get(value, ()) if r.op_type in ("Slice", "Split")]
    shapes = [r for r in readers.get(value, ()) if r.op_type == "Shape"]
    if not cuts or len(cuts) + len(shapes) != len(readers.get(value, ())):
        return None
    dims = static.dims(matmul.inputs[0])  # (after the readers: working dims out goes back through the graph)
    shape = _Shape(None if dims is None else len(dims), n)
    chain = _shape_chain(graph, readers, shapes, value)
    if chain is None:
        return None
    known = static.ints
    pieces = []
    for cut in cuts:
        if cut.domain != "" or cut.inputs[0] != value or value in cut.inputs[1:] or cut.captures or not cut.outputs \
                or (cut.op_type == "Slice" and cut.since >= 10 and not 3 <= len(cut.inputs) <= 5):
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


def _ints(value) -> list | None:
    """Known integers as a list, else None."""
    if value is None or any(v is None for v in value.reshape(-1)):
        return None
    return [int(v) for v in value.reshape(-1)]


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


ROUNDS_APART = (split_products,)  # a prefill's BLAS product may block a narrower N differently
