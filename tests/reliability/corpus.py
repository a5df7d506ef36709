"""Seed models, random feeds and the model mutator shared by the reliability tests and
`scripts/fuzz.py`.

A fuzz case is a small valid model, one to three mutations (structured edits of the protobuf, or
byte-level damage of its serialization) and random feeds. Its only acceptable outcomes are a
result or a `runnx.RunnxError`: anything else (IndexError, KeyError, a numpy error escaping a
kernel unwrapped, a crash) is a bug.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import runnx
from runnx.interp.dtypes import ONNX_TO_NUMPY
from runnx.ops import registry

F, I64, BOOL = TensorProto.FLOAT, TensorProto.INT64, TensorProto.BOOL
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
# Fuzzed models run under tight limits: a mutated shape must fail fast, never allocate gigabytes.
FUZZ_OPTIONS = runnx.Options(max_tensor_elements=10**6, max_loop_iterations=1000, inplace=True)


def make_model(nodes, inputs, outputs, initializers=(), opset=18) -> onnx.ModelProto:
    """A model from nodes and (name, elem_type, shape) inputs/outputs."""
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info(n, t, s) for n, t, s in inputs],
        [helper.make_tensor_value_info(n, t, s) for n, t, s in outputs], list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)


def const(name, values, dtype=np.int64):
    return numpy_helper.from_array(np.asarray(values, dtype=dtype), name)


def _branch(name, nodes, output):
    return helper.make_graph(nodes, name, [], [helper.make_tensor_value_info(output, F, None)])


def _seed_builders():
    node = helper.make_node
    yield "elementwise", make_model([
        node("Neg", ["x"], ["a"], name="neg"),
        node("Add", ["a", "y"], ["b"], name="add"),
        node("Mul", ["b", "x"], ["c"], name="mul"),
        node("Sqrt", ["c"], ["d"], name="sqrt"),
        node("Constant", [], ["k"], value=numpy_helper.from_array(np.array(0.5, np.float32)), name="half"),
        node("Mul", ["d", "k"], ["e"], name="scale"),
        node("Sub", ["e", "y"], ["out"], name="sub"),
    ], [("x", F, ["n", 4]), ("y", F, ["n", 4])], [("out", F, ["n", 4])])
    yield "views", make_model([
        node("Reshape", ["x", "shape"], ["r"], name="reshape"),
        node("Transpose", ["r"], ["t"], perm=[1, 0], name="transpose"),
        node("Identity", ["t"], ["i"], name="identity"),
        node("Concat", ["i", "t"], ["cat"], axis=0, name="concat"),
        node("Shape", ["cat"], ["s"], name="shape"),
        node("MatMul", ["x", "w"], ["m"], name="matmul"),
        node("Add", ["m", "x"], ["out"], name="add"),
    ], [("x", F, [2, 4])], [("out", F, [2, 4]), ("cat", F, None), ("s", I64, [2])],
        [const("shape", [4, 2]), numpy_helper.from_array(np.eye(4, dtype=np.float32), "w")])
    yield "slices", make_model([
        node("Slice", ["x", "starts", "ends", "axes"], ["s"], name="slice"),
        node("Unsqueeze", ["s", "axes"], ["u"], name="unsqueeze"),
        node("Squeeze", ["u", "axes"], ["q"], name="squeeze"),
        node("Expand", ["q", "target"], ["e"], name="expand"),
        node("Tile", ["e", "repeats"], ["out"], name="tile"),
    ], [("x", F, [3, 4])], [("out", F, None)],
        [const("starts", [1]), const("ends", [3]), const("axes", [1]), const("target", [2, 3, 2]),
         const("repeats", [1, 1, 2])])
    loop_body = helper.make_graph(
        [node("Identity", ["cond"], ["cond_out"], name="body_cond"),
         node("Add", ["acc", "x"], ["acc_out"], name="body_add"),
         node("Concat", ["acc", "acc_out"], ["scan"], axis=0, name="body_concat")], "body",
        [helper.make_tensor_value_info("i", I64, []), helper.make_tensor_value_info("cond", BOOL, []),
         helper.make_tensor_value_info("acc", F, None)],
        [helper.make_tensor_value_info("cond_out", BOOL, []), helper.make_tensor_value_info("acc_out", F, None),
         helper.make_tensor_value_info("scan", F, None)])
    yield "control_flow", make_model([
        node("Neg", ["x"], ["a"], name="neg"),
        node("If", ["c"], ["branch"], name="if",
             then_branch=_branch("then", [node("Add", ["a", "x"], ["t"], name="then_add")], "t"),
             else_branch=_branch("else", [node("Mul", ["a", "a"], ["e"], name="else_mul")], "e")),
        node("Loop", ["trips", "", "branch"], ["final", "scans"], name="loop", body=loop_body),
    ], [("x", F, [2, 3]), ("c", BOOL, []), ("trips", I64, [])], [("final", F, [2, 3]), ("scans", F, None)])


def _supported(model: onnx.ModelProto) -> bool:
    opset = {entry.domain: entry.version for entry in model.opset_import}.get("", 1)

    def nodes(graph):
        for n in graph.node:
            yield n
            for attribute in n.attribute:
                for sub in ([attribute.g] if attribute.type == onnx.AttributeProto.GRAPH else attribute.graphs):
                    yield from nodes(sub)

    return all(registry.resolve(n.domain, n.op_type, opset) is not None for n in nodes(model.graph))


def seed_models() -> dict[str, onnx.ModelProto]:
    """Small models built here, of ops runnx has (all of them once the op families are complete)."""
    return {name: model for name, model in _seed_builders() if _supported(model)}


def fixture_models() -> dict[str, onnx.ModelProto]:
    """The committed fixture models (tiny exported decoders and encoders, ~1 MB each)."""
    found = sorted(FIXTURES.rglob("*.onnx")) if FIXTURES.is_dir() else []
    models = {str(path.relative_to(FIXTURES)): onnx.load(path) for path in found if path.stat().st_size < 4 * 2**20}
    return {name: model for name, model in models.items() if _supported(model)}


def random_array(rng: np.random.Generator, dtype, shape) -> np.ndarray:
    dtype = np.dtype(dtype)
    if dtype.kind == "b":
        return rng.integers(0, 2, shape).astype(bool)
    if dtype.kind in "iu":
        return rng.integers(0, 5, shape).astype(dtype)
    if dtype.kind == "O":
        return np.array(rng.choice(["a", "bc", ""], shape), dtype=object)
    array = rng.standard_normal(shape).astype(dtype)
    if array.size and rng.random() < 0.2:  # NaN / Inf inputs
        array.reshape(-1)[rng.integers(0, array.size)] = rng.choice([np.nan, np.inf, -np.inf])
    return array


def random_feeds(model: runnx.Model, rng: np.random.Generator, wrong: float = 0.05) -> dict:
    """Feeds for the model's inputs: mostly well-formed (symbolic dims 0..3, non-contiguous or
    handed over as Owned now and then), sometimes with a wrong dtype, rank, name or a missing one."""
    feeds, symbols = {}, {}
    for info in model.inputs:
        dtype = ONNX_TO_NUMPY.get(info.elem_type, np.dtype(np.float32))
        if dtype.kind not in "biufO" or rng.random() < wrong:
            dtype = rng.choice([np.float32, np.float64, np.int64, np.bool_])
        dims = [2, 3] if info.shape is None else [
            d if isinstance(d, int) else symbols.setdefault(d, int(rng.integers(0, 4))) for d in info.shape]
        if rng.random() < wrong:
            dims = list(rng.integers(0, 4, int(rng.integers(0, 4))))
        array = random_array(rng, dtype, dims)
        if array.ndim and rng.random() < 0.2:  # a non-contiguous view of a bigger buffer
            array = np.repeat(array, 2, axis=-1)[..., ::2]
        if rng.random() < wrong / 2:
            continue  # missing input
        feeds[info.name] = runnx.Owned(array) if rng.random() < 0.3 else array
    if rng.random() < wrong:
        feeds["not_an_input"] = np.zeros(1, np.float32)
    return feeds


# ---- mutations: each takes the model (mutated in place) and a numpy Generator ----------------

def _all_graphs(graph):
    yield graph
    for n in graph.node:
        for attribute in n.attribute:
            for sub in ([attribute.g] if attribute.type == onnx.AttributeProto.GRAPH else attribute.graphs):
                yield from _all_graphs(sub)


def _pick(rng, items):
    items = list(items)
    return items[int(rng.integers(0, len(items)))] if items else None


def _names(graph):
    names = [i.name for i in graph.input] + [t.name for t in graph.initializer]
    return names + [o for n in graph.node for o in n.output] + ["", "ghost"]


def _interesting_int(rng):
    return int(_pick(rng, [0, 1, -1, 2, 3, -2, 7, -100, 2**31, 10**12, -(2**63), 2**63 - 1]))


def mutate_op_type(model, rng):
    node = _pick(rng, [n for g in _all_graphs(model.graph) for n in g.node])
    if node is not None:
        node.op_type = _pick(rng, ["Add", "Neg", "Reshape", "Transpose", "Concat", "MatMul", "Shape", "Identity",
                                   "Slice", "Squeeze", "Unsqueeze", "If", "Loop", "Expand", "Tile", "Where",
                                   "Gather", "Softmax", "ConstantOfShape", "Range", "Pad", "Cast", "NoSuchOp"])


def mutate_io_name(model, rng):
    graph = _pick(rng, _all_graphs(model.graph))
    node = _pick(rng, graph.node)
    if node is None:
        return
    names = _names(graph)
    which = node.input if (rng.random() < 0.7 or not node.output) else node.output
    action = rng.integers(0, 3)
    if action == 0 and len(which):
        which[int(rng.integers(0, len(which)))] = _pick(rng, names)
    elif action == 1:
        which.append(_pick(rng, names))
    elif len(which):
        del which[int(rng.integers(0, len(which)))]


def mutate_attribute(model, rng):
    node = _pick(rng, [n for g in _all_graphs(model.graph) for n in g.node])
    if node is None:
        return
    attribute = _pick(rng, node.attribute)
    action = rng.integers(0, 4)
    if attribute is None or action == 0:
        node.attribute.append(helper.make_attribute(_pick(rng, ["axis", "perm", "to", "mode", "bogus"]),
                                                    _pick(rng, [1, 2.5, "x", [0, 1], [1.0]])))
    elif action == 1:
        node.attribute.remove(attribute)
    elif attribute.type == onnx.AttributeProto.INT:
        attribute.i = _interesting_int(rng)
    elif attribute.type == onnx.AttributeProto.INTS:
        attribute.ints[:] = [_interesting_int(rng) % 5 - 1 for _ in range(int(rng.integers(0, 4)))]
    else:
        attribute.type = int(rng.integers(0, 15))


def mutate_tensor(model, rng):
    tensor = _pick(rng, [t for g in _all_graphs(model.graph) for t in g.initializer])
    if tensor is None:
        return
    action = rng.integers(0, 4)
    if action == 0:
        tensor.dims[:] = [int(rng.integers(0, 5)) for _ in range(int(rng.integers(0, 4)))]
    elif action == 1:
        tensor.data_type = int(rng.integers(0, 30))
    elif action == 2 and tensor.raw_data:
        raw = bytearray(tensor.raw_data)
        raw[int(rng.integers(0, len(raw)))] = int(rng.integers(0, 256))
        tensor.raw_data = bytes(raw[: int(rng.integers(0, len(raw) + 1))] if rng.random() < 0.3 else raw)
    else:
        array = np.full([int(rng.integers(0, 3)) for _ in range(int(rng.integers(0, 3)))],
                        _interesting_int(rng) if rng.random() < 0.5 else rng.integers(-3, 5), np.int64)
        tensor.CopyFrom(numpy_helper.from_array(array, tensor.name))


def mutate_value_info(model, rng):
    info = _pick(rng, list(model.graph.input) + list(model.graph.output))
    if info is None:
        return
    tensor = info.type.tensor_type
    if rng.random() < 0.5:
        tensor.elem_type = int(rng.integers(0, 30))
    elif tensor.HasField("shape") and len(tensor.shape.dim) and rng.random() < 0.5:
        tensor.shape.dim[int(rng.integers(0, len(tensor.shape.dim)))].dim_value = int(rng.integers(0, 5))
    else:
        tensor.ClearField("shape")


def mutate_structure(model, rng):
    graph = _pick(rng, _all_graphs(model.graph))
    action = rng.integers(0, 5)
    if not len(graph.node):
        return
    index = int(rng.integers(0, len(graph.node)))
    if action == 0:
        del graph.node[index]
    elif action == 1:
        graph.node.append(graph.node[index])  # duplicate: outputs defined twice
    elif action == 2:
        nodes = list(graph.node)
        rng.shuffle(nodes)  # out of topological order
        del graph.node[:]
        graph.node.extend(nodes)
    elif action == 3:
        model.opset_import[0].version = int(_pick(rng, [1, 6, 7, 11, 13, 17, 21, 23, 99]))
    else:
        graph.node[index].domain = _pick(rng, ["ai.onnx", "com.microsoft", "ai.onnx.ml", "x.y"])


STRUCTURED = [mutate_op_type, mutate_io_name, mutate_attribute, mutate_tensor, mutate_value_info, mutate_structure]


def damage_bytes(data: bytes, rng) -> bytes:
    """Byte-level damage of a serialized model: truncation, flipped bytes, inserted garbage."""
    data = bytearray(data)
    action = rng.integers(0, 3)
    if action == 0:
        return bytes(data[: int(rng.integers(0, len(data)))])
    if action == 1:
        for _ in range(int(rng.integers(1, 4))):
            data[int(rng.integers(0, len(data)))] = int(rng.integers(0, 256))
        return bytes(data)
    at = int(rng.integers(0, len(data) + 1))
    return bytes(data[:at] + rng.integers(0, 256, int(rng.integers(1, 16)), dtype=np.uint8).tobytes() + data[at:])


def mutated(seed: onnx.ModelProto, rng, count: int) -> bytes:
    """`count` random mutations of a copy of `seed`, serialized (the last may damage the bytes)."""
    model = onnx.ModelProto()
    model.CopyFrom(seed)
    for _ in range(count):
        _pick(rng, STRUCTURED)(model, rng)
    try:
        data = model.SerializeToString()
    except Exception:  # protobuf refuses some edits (e.g. out-of-range enum): damage the seed instead
        data = seed.SerializeToString()
    return damage_bytes(data, rng) if rng.random() < 0.25 else data


def bits(value):
    """A value's exact content (dtype, shape, bytes; strings by value), for bitwise comparisons."""
    if isinstance(value, list):
        return [bits(v) for v in value]
    if value is None:
        return None
    return value.dtype.str, value.shape, value.tobytes() if value.dtype != object else value.tolist()


def run_case(data: bytes, rng) -> str:
    """Load and run one (possibly broken) model: 'ok' or the name of the RunnxError raised.
    Any other exception propagates: that is a bug."""
    try:
        model = runnx.load(data, options=FUZZ_OPTIONS)
        model.run(random_feeds(model, rng))
        return "ok"
    except runnx.RunnxError as error:
        return type(error).__name__
