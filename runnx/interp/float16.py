"""Float16 arithmetic computes in float32: float16 is how a model stores values, not how runnx sums.

A float16 model (onnxruntime's `convert_float_to_float16`, an Optimum `--dtype fp16` export) says
every value is float16, squares in a norm included: a small LM's hidden states pass 256, whose square
overflows float16 (65504) and turns a whole row into NaN. onnxruntime's CPU provider has no float16
kernel for most arithmetic and computes it in float32 between Casts it inserts, removing the Casts
between two such nodes. runnx does the same at load, before any other pass: each arithmetic node
(`WIDENED`) reading float16 reads it cast to float32 (or its float16 producer's float32 result
directly) and its result is rounded to float16 only where another node reads it as float16: data
movement (Reshape, Transpose, Concat into a float16 KV cache, ...), a graph output, any other op.
Weights cast to float32 are constants that folding computes once; so a float16 file decodes at
float32 speed, with its values rounded where onnxruntime rounds them.

Data movement (`MOVES`: Reshape, Transpose, Slice, Concat, Neg, Where, ...) whose results only widened
nodes read (directly or through more such movement) moves float32 copies of its float16 inputs
instead: Cast(x, float32) of a float16 x is exact and movement commutes with it, so every value is
the one the float16 nodes made, rounded where they rounded it. The chain from a rounding to the
arithmetic then reads as a float32 export's (a rotary embedding's Slices and the Mul reading the
same value), and the fusion patterns match it. An export's Cast to float32 is a Cast of float16 to
float16 once converted: it goes, its widened readers reading the value rounded all the same.
"""
from __future__ import annotations

import numpy as np

from runnx.interp.ir import MISSING, Graph, Node
from runnx.ops import registry

FLOAT, FLOAT16 = 1, 10  # ONNX element types
# arithmetic whose every output has its float inputs' type: computed in float32 when they are float16
# (not Relu, Abs, Neg: exact in float16, their float16 kernels keep numpy's signed zeros)
WIDENED = frozenset({
    "Add", "Sub", "Mul", "Div", "Pow", "Sqrt", "Reciprocal", "Exp", "Log", "Tanh", "Sigmoid",
    "Softmax", "LogSoftmax", "ReduceMean", "ReduceSum", "ReduceSumSquare", "ReduceL2", "ReduceLogSumExp",
    "MatMul", "Gemm", "Sin", "Cos", "Erf", "LeakyRelu", "Elu", "Gelu", "HardSigmoid", "Softplus",
    "Sum", "Mean", "Conv", "ConvTranspose", "LayerNormalization", "InstanceNormalization",
    "BatchNormalization"})
# ops whose first output is float16 when the input at (index) is: data movement and selection
_PASSES = {"Reshape": 0, "Transpose": 0, "Squeeze": 0, "Unsqueeze": 0, "Flatten": 0, "Slice": 0, "Gather": 0,
           "GatherElements": 0, "GatherND": 0, "Concat": 0, "Split": 0, "Expand": 0, "Identity": 0, "Tile": 0,
           "Pad": 0, "Where": 1, "Min": 0, "Max": 0, "ReduceMax": 0, "ReduceMin": 0, "Clip": 0, "Floor": 0,
           "Ceil": 0, "Round": 0, "ScatterElements": 0, "ScatterND": 0, "Trilu": 0}
# data movement that commutes with an exact Cast to float32: op -> input positions carrying the data
MOVES = {"Reshape": (0,), "Transpose": (0,), "Squeeze": (0,), "Unsqueeze": (0,), "Flatten": (0,), "Slice": (0,),
         "Gather": (0,), "Concat": None, "Split": (0,), "Expand": (0,), "Identity": (0,), "Tile": (0,), "Neg": (0,),
         "Where": (1, 2)}


def widen_float16(graph: Graph, outer: frozenset = frozenset()) -> int:
    """Rewrite `graph` and its subgraphs as above; `outer`: names of float16 values a subgraph
    captures. Returns how many nodes compute in float32 instead of float16."""
    half = {vid for vid, info in zip(graph.inputs, graph.input_info) if info.elem_type == FLOAT16}
    half |= {vid for vid, value in {**graph.constants, **graph.defaults}.items() if value.dtype == np.float16}
    half |= {vid for vid in graph.capture_ids if graph.names[vid] in outer}
    wide: dict[int, int] = {}  # float16 value id -> the float32 value it was rounded from
    casts: dict[int, int] = {}  # float16 value id -> a float32 copy made for widened readers
    new_nodes: list[Node] = []
    rounding: set[int] = set()  # indices of the Casts back to float16 added here
    next_index = max((n.index for n in graph.nodes), default=-1) + 1
    widened = 0
    moved_wide = _moves_read_wide(graph)
    wide_copies: set[int] = set()  # float32 values standing for float16 ones, exactly (moved copies)
    same: dict[int, int] = {}  # the result of a Cast to float16 of a float16 value -> that value
    kept = set(graph.outputs) | {vid for node in graph.nodes for vid in node.captures}

    def add_cast(source: int, to: int, target: int | None = None) -> int:
        nonlocal next_index
        if target is None:
            target = len(graph.names)
            graph.names.append(f"{graph.names[source]}/float32")
            graph.ids[graph.names[target]] = target
        kernel = registry.resolve("", "Cast", 13)
        if to == FLOAT16:
            rounding.add(next_index)
        new_nodes.append(Node(next_index, f"Cast({graph.names[source]})", "Cast", "", (source,), (target,),
                              {"to": to}, {}, (), kernel, kernel.since))
        next_index += 1
        return target

    def as_float32(vid: int) -> int:
        if vid in wide:
            return wide[vid]
        if vid not in casts:
            casts[vid] = add_cast(vid, FLOAT)
        return casts[vid]

    def exact_float32(vid: int) -> int:
        """Cast(vid, float32): the float16 value itself, rounded (not a widened producer's result)."""
        if vid not in casts:
            casts[vid] = add_cast(vid, FLOAT)
        wide_copies.add(casts[vid])
        return casts[vid]

    for node in graph.nodes:
        for sub in node.subgraphs.values():
            for g in sub if isinstance(sub, list) else [sub]:
                widened += widen_float16(g, frozenset(graph.names[v] for v in half))
        if any(vid in same for vid in node.inputs):
            exact = node.domain == "" and node.kernel is not None and (node.index in moved_wide or (
                node.op_type in WIDENED and sum(o != MISSING for o in node.outputs) == 1))
            node.inputs = tuple((exact_float32(same[vid]) if exact else same[vid]) if vid in same else vid
                                for vid in node.inputs)
        if node.domain != "" or node.kernel is None:
            new_nodes.append(node)
            continue
        if node.op_type == "Cast" and node.attrs.get("to") == FLOAT16 and node.inputs[0] in half \
                and node.outputs[0] not in kept:  # an identity: its readers read the value (widened: rounded)
            same[node.outputs[0]] = same.get(node.inputs[0], node.inputs[0])
            continue
        reads_half = [vid for vid in node.inputs if vid in half]
        if node.index in moved_wide and (reads_half or any(v in wide_copies for v in node.inputs)):
            data = _data_positions(node)
            node.inputs = tuple(exact_float32(vid) if vid in half and i in data else vid
                                for i, vid in enumerate(node.inputs))
            wide_copies.update(o for o in node.outputs if o != MISSING)
            new_nodes.append(node)
            continue
        reads_half = reads_half or [vid for vid in node.inputs if vid in wide_copies]
        if node.op_type in WIDENED and reads_half and sum(o != MISSING for o in node.outputs) == 1:
            node.inputs = tuple(as_float32(vid) if vid in half else vid for vid in node.inputs)
            out = next(o for o in node.outputs if o != MISSING)
            twin = len(graph.names)
            graph.names.append(f"{graph.names[out]}/float32")
            graph.ids[graph.names[twin]] = twin
            node.outputs = tuple(twin if o == out else o for o in node.outputs)
            new_nodes.append(node)
            add_cast(twin, FLOAT16, out)
            wide[out] = twin
            half.add(out)
            widened += 1
            continue
        new_nodes.append(node)
        if node.op_type == "Cast":
            if node.attrs.get("to") == FLOAT16:
                half.add(node.outputs[0])
        elif node.op_type in _PASSES and len(node.inputs) > _PASSES[node.op_type] \
                and node.inputs[_PASSES[node.op_type]] in half:
            half.update(o for o in node.outputs if o != MISSING)
        elif node.op_type in WIDENED and reads_half:  # float16 still (several outputs)
            half.update(o for o in node.outputs if o != MISSING)
    if widened or same:
        graph.nodes = _without_unread(graph, new_nodes, rounding)
        graph.producer = {vid: node for node in graph.nodes for vid in node.outputs if vid != MISSING}
    return widened


def _data_positions(node: Node) -> range | tuple:
    positions = MOVES[node.op_type]
    return range(len(node.inputs)) if positions is None else positions


def _moves_read_wide(graph: Graph) -> set[int]:
    """Indices of the MOVES nodes whose every result is read only by single-output WIDENED nodes
    or by other such nodes, at a data position (never a graph output, a capture or a shape input)."""
    readers: dict[int, list] = {}
    for node in graph.nodes:
        for i, vid in enumerate(node.inputs):
            readers.setdefault(vid, []).append((node, i))
        for vid in node.captures:
            readers.setdefault(vid, []).append((node, -1))
    outputs = set(graph.outputs)
    found: set[int] = set()
    for node in reversed(graph.nodes):  # readers first
        if node.op_type not in MOVES or node.domain != "" or node.kernel is None or node.subgraphs:
            continue
        results = [o for o in node.outputs if o != MISSING]
        if results and all(o not in outputs and readers.get(o) and all(
                (r.op_type in WIDENED and r.domain == "" and r.kernel is not None and not r.subgraphs and i >= 0
                 and sum(v != MISSING for v in r.outputs) == 1)
                or (r.index in found and i in _data_positions(r)) for r, i in readers[o]) for o in results):
            found.add(node.index)
    return found


def _without_unread(graph: Graph, nodes: list[Node], rounding: set[int]) -> tuple[Node, ...]:
    """The nodes but the Casts back to float16 that nothing reads any more (their widened readers
    take the float32 value): fusion takes a value read outside its pattern for one it must keep."""
    read = set(graph.outputs)
    for node in nodes:
        read.update(node.inputs)
        read.update(node.captures)
    return tuple(n for n in nodes if n.index not in rounding or n.outputs[0] in read)
