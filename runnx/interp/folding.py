"""Load-time constant folding: a node whose inputs are all constants runs once, at load.

Optimum exports compute things like the transposed tied embedding (lm_head) from initializers on
every run; folding turns them into contiguous read-only constants. Random ops are never folded,
and a fold that would blow up memory (e.g. Expand of a scalar to a huge tensor) is left to run; a
Cast of float16 weights to float32 (twice their bytes, `float16.py`) is folded, and so is a
DequantizeLinear of 8-bit weights (four times their bytes: a transformers.js int8 export's tied
LM head, 28 MB of uint8, was dequantized to 113 MB on every decode step), except where fusion
reads the bytes themselves: a per-tensor DequantizeLinear whose one reader is a MatMul's matrix
(`fusion/dequantized_products.py`).

Small constants of equal value then become one array: every layer of an export has its own copy
of the same slice bounds and scalars, and the facts kernels remember about constants by identity
(`runnx/ops/_remembered.py`, a run's attention bias kept for the same inputs) then hold for all
layers at once.
"""
from __future__ import annotations

import numpy as np

from runnx.interp.context import RunContext
from runnx.interp.ir import MISSING, Graph, Node
from runnx.interp.model_file import settle, weight_arena

NONDETERMINISTIC = frozenset({"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike",
                              "Bernoulli", "Multinomial", "Dropout"})
SMALL_RESULT = 1 << 20  # a folded result may always be this large, else no larger than its inputs
SHARED_BYTES = 4096  # read-only constants up to this size with equal dtype, shape and bytes become one
_FLOAT = 1  # TensorProto.FLOAT
_BYTES = (np.dtype(np.uint8), np.dtype(np.int8))


def dequantized_weight(graph: Graph, node: Node) -> bool:
    """Whether `node` is a DequantizeLinear of a constant 2-D 8-bit matrix by one float32 scale and
    one zero point of its type (or none): a float32 matrix of that many values."""
    if node.op_type != "DequantizeLinear" or node.domain != "" or len(node.inputs) < 2:
        return False
    if node.attrs.get("block_size", 0) or node.attrs.get("output_dtype", 0) not in (0, _FLOAT):
        return False
    values, scale = graph.constants.get(node.inputs[0]), graph.constants.get(node.inputs[1])
    zero = node.inputs[2] if len(node.inputs) > 2 else MISSING
    zero_point = graph.constants.get(zero)
    if zero != MISSING and (zero_point is None or zero_point.size != 1 or zero_point.dtype != getattr(values, "dtype", None)):
        return False
    return (values is not None and values.ndim == 2 and values.dtype in _BYTES and scale is not None
            and scale.size == 1 and scale.dtype == np.float32)


def read_as_weight(graph: Graph, node: Node, readers: list) -> bool:
    """Whether `node`'s output is no graph output and its only reader (`readers`) is a MatMul
    taking it as its matrix."""
    value = node.outputs[0]
    return (value not in graph.outputs and len(readers) == 1 and readers[0].op_type == "MatMul"
            and readers[0].domain == "" and len(readers[0].inputs) == 2 and readers[0].inputs[1] == value
            and readers[0].inputs[0] != value)


def _foldable(graph: Graph, node) -> bool:
    return (node.kernel is not None and not node.subgraphs and not node.captures
            and node.op_type not in NONDETERMINISTIC
            and all(v == MISSING or v in graph.constants for v in node.inputs))


def out_of_place_kwargs(node) -> dict:
    """The node's attributes and the reserved keywords that run its kernel outside the executor
    (no input overwritten; `ctx`, when the kernel takes it, is the caller's to add)."""
    kernel = node.kernel
    kwargs = dict(node.attrs)
    if kernel.inplace or kernel.inplace_from is not None:
        kwargs["overwrite"] = ()
    if kernel.wants_output_count:
        kwargs["output_count"] = len(node.outputs)
    return kwargs


def call_out_of_place(node, args: list, ctx):
    """Run one node's kernel outside the executor: no input may be overwritten."""
    kwargs = out_of_place_kwargs(node)
    if node.kernel.wants_ctx:
        kwargs["ctx"] = ctx
    return node.kernel.fn(*args, **kwargs)


_TILE = 128  # a transposed matrix's copy goes through tiles of this many rows and columns
_MAPPED_BYTES = 1 << 21  # and from this size on into a map of its own, settled into huge pages


def contiguous_copy(array: np.ndarray) -> np.ndarray:
    """A C-contiguous copy of `array`. A transposed matrix (a large one that MatMuls alone read stays
    a view: `_read_by_columns`) goes through tiles: numpy copies it along the output's rows, reading
    one float of each cache line of the input. A large one is written into a map of its own, its pages faulted
    in one call and then settled into huge pages as the weights are (`model_file.weight_arena`; a
    decode step streams it): 113 MB took a third of a second of a load, a quarter of that so."""
    if (array.ndim != 2 or abs(array.strides[0]) >= abs(array.strides[1]) or array.size < _TILE * _TILE
            or array.dtype.hasobject):
        return array.copy()
    mapped = None
    if array.nbytes >= _MAPPED_BYTES:
        (buffer,), mapped = weight_arena([array.nbytes])
        out = buffer.view(array.dtype).reshape(array.shape)
    else:
        out = np.empty(array.shape, array.dtype)
    rows, columns = array.shape
    for row in range(0, rows, _TILE):
        for column in range(0, columns, _TILE):
            out[row:row + _TILE, column:column + _TILE] = array[row:row + _TILE, column:column + _TILE]
    settle(mapped)
    return out


def _read_by_columns(graph: Graph, node, readers: list) -> bool:
    """Whether `node` transposes a large constant matrix that only MatMuls read, as their b: its fold
    stays a view (a tied LM head's transposed embedding: MatMul reads the embedding's rows in place,
    `linalg._by_columns`), where a copy would double the matrix's memory and cost a part of the load."""
    if node.op_type != "Transpose" or len(node.inputs) != 1 or node.outputs[0] in graph.outputs or not readers:
        return False
    source = graph.constants.get(node.inputs[0])
    return (type(source) is np.ndarray and source.ndim == 2 and source.flags.c_contiguous
            and source.nbytes >= _MAPPED_BYTES and list(node.attrs.get("perm", (1, 0))) == [1, 0]
            and all(reader.op_type == "MatMul" and reader.domain == "" and list(reader.inputs[1:]) == [node.outputs[0]]
                    and reader.inputs[0] != node.outputs[0] for reader in readers))


def _evaluate(graph: Graph, node, ctx, view: bool = False) -> list | None:
    """The folded outputs of `node`, or None; `view`: a transposed input kept a view of it
    (`_read_by_columns`)."""
    args = [graph.constants[v] if v != MISSING else None for v in node.inputs]
    try:
        result = call_out_of_place(node, args, ctx)
    except Exception:  # left to fail at run time, with the executor's node context
        return None
    outputs = list(result) if type(result) is tuple else [result]
    if not all(isinstance(o, (np.ndarray, np.generic)) for o in outputs):
        return None
    budget = max(SMALL_RESULT, sum(a.nbytes for a in args if isinstance(a, np.ndarray)))
    if node.op_type == "Cast" and args[0].dtype == np.float16:  # float16 weights widened (interp/float16.py)
        budget *= 2
    elif node.op_type == "DequantizeLinear":  # 8-bit weights dequantized once, not every run
        budget *= 4
    if sum(np.asarray(o).nbytes for o in outputs) > budget:
        return None
    folded = []
    for output in outputs:
        output = np.asarray(output)
        if view and output.base is not None and output.T.flags.c_contiguous:
            output = output.view()  # a read-only view of the read-only source
        elif not output.flags.c_contiguous:  # (np.ascontiguousarray would turn a 0-D result into 1-D)
            output = contiguous_copy(output)  # its own storage (a map's, for a large one): kept as it is
        elif output.base is not None:  # a view (of an input, say): a constant of its own
            output = output.copy()
        output.flags.writeable = False
        folded.append(output)
    return folded


def fold_constants(graph: Graph, options, shared: dict | None = None) -> int:
    """Fold every foldable node of `graph` and of its subgraphs, then share their equal small
    constants (`shared`: the arrays kept so far, by value); returns how many nodes were folded."""
    shared = {} if shared is None else shared
    ctx = RunContext(options)
    folded = 0
    nodes = list(graph.nodes)
    changed = True
    while changed:  # nodes may be out of topological order
        changed = False
        kept = []
        readers = _readers(nodes)
        for node in nodes:
            if (options.fuse and dequantized_weight(graph, node)
                    and read_as_weight(graph, node, readers.get(node.outputs[0], []))):
                kept.append(node)  # a DequantizedMatMul reads its bytes
                continue
            view = bool(node.outputs) and _read_by_columns(graph, node, readers.get(node.outputs[0], []))
            outputs = _evaluate(graph, node, ctx, view) if _foldable(graph, node) else None
            if outputs is None or len(outputs) < sum(v != MISSING for v in node.outputs):
                kept.append(node)
                continue
            for vid, value in zip(node.outputs, outputs):
                if vid != MISSING:
                    graph.constants[vid] = value
            folded += 1
            changed = True
        nodes = kept
    graph.nodes = tuple(nodes)
    graph.producer = {vid: node for node in nodes for vid in node.outputs if vid != MISSING}
    for node in nodes:
        if not node.subgraphs:
            continue
        subgraphs = [g for sub in node.subgraphs.values() for g in (sub if isinstance(sub, list) else [sub])]
        for subgraph in subgraphs:
            _inline_constant_captures(graph, subgraph)
        names = []
        for subgraph in subgraphs:
            names += [name for name in subgraph.captures if name not in names]
        node.captures = tuple(graph.ids[name] for name in names)
        for subgraph in subgraphs:
            folded += fold_constants(subgraph, options, shared)
    _share_equal_constants(graph, shared)
    return folded


def _readers(nodes) -> dict:
    """{value id: the nodes reading it as an input or a capture}."""
    readers: dict = {}
    for node in nodes:
        for vid in (*node.inputs, *node.captures):
            readers.setdefault(vid, []).append(node)
    return readers


def _share_equal_constants(graph: Graph, shared: dict) -> None:
    """Each small read-only constant replaced by the first array of its value seen in the model."""
    for vid, value in graph.constants.items():
        if (type(value) is np.ndarray and value.nbytes <= SHARED_BYTES and not value.flags.writeable
                and not value.dtype.hasobject):
            graph.constants[vid] = shared.setdefault((value.dtype, value.shape, value.tobytes()), value)


def _inline_constant_captures(parent: Graph, subgraph: Graph) -> None:
    """A subgraph reading a constant of its parent (e.g. the weights an Optimum merged decoder's
    If branches read) gets it as its own constant: nothing to pass through the CaptureEnv each
    run, and nodes of the subgraph that read only constants (a transposed tied embedding) fold."""
    kept = []
    for name, local in zip(subgraph.captures, subgraph.capture_ids):
        outer = parent.ids[name]
        if outer in parent.constants:
            subgraph.constants[local] = parent.constants[outer]
        else:
            kept.append((name, local))
    subgraph.captures = tuple(name for name, _ in kept)
    subgraph.capture_ids = tuple(local for _, local in kept)
