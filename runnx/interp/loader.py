"""Loading: ONNX protobuf (file, bytes or ModelProto) -> IR graphs with every node bound to a kernel.

Everything that can be checked without data is checked here, once: unsupported ops (all listed
in one error), attribute names and types, duplicate or undefined value names, subgraph captures.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import AttributeProto

from runnx.errors import InvalidModelError, ModelLoadError, RunnxError, UnsupportedOpError, UnsupportedOpsetError
from runnx.interp.dtypes import onnx_type, type_name
from runnx.interp.external_data import ExternalData, read_safetensors
from runnx.interp.ir import MISSING, Graph, Node, ValueInfo
from runnx.interp.model_file import read_model_file
from runnx.interp.tensors import tensor_to_array
from runnx.ops import registry


@dataclass
class LoadedModel:
    graph: Graph
    opsets: dict
    ir_version: int
    producer: str
    path: str | None


def read_model(source, skip=frozenset()) -> tuple[onnx.ModelProto, str | None, dict]:
    """Parse the protobuf; external data stays on disk (resolved lazily, safely). From a file, the
    top-level initializers' raw bytes come apart ({name: bytes}, `model_file.py`), but for the
    names in `skip` (replaced by a weights file: never read)."""
    if isinstance(source, onnx.ModelProto):
        return source, None, {}
    if isinstance(source, (bytes, bytearray, memoryview)):
        try:
            return onnx.load_from_string(bytes(source)), None, {}
        except Exception as error:
            raise ModelLoadError(f"the bytes are not an ONNX model: {error}") from None
    path = os.fspath(source)
    if not os.path.isfile(path):
        raise ModelLoadError(f"model file not found: {path}")
    try:
        read = read_model_file(path, skip)
    except OSError as error:
        raise ModelLoadError(f"cannot read '{path}': {error}") from None
    if read is not None:
        try:
            return onnx.load_from_string(read[0]), path, read[1]
        except Exception:  # the parse of the whole file below says what is wrong
            pass
    try:
        return onnx.load(path, load_external_data=False), path, {}
    except Exception as error:
        raise ModelLoadError(f"'{path}' is not an ONNX model: {error}") from None


def load_model(source, weights=None, allow_newer_opset=False) -> LoadedModel:
    overrides = read_safetensors(os.fspath(weights)) if weights is not None else {}
    proto, path, raw = read_model(source, frozenset(overrides))
    if not proto.HasField("graph"):
        where = (f"'{path}' ({os.path.getsize(path)} bytes)" if path else "the ModelProto given"
                 if isinstance(source, onnx.ModelProto) else f"the bytes given ({len(source)})")
        raise ModelLoadError(f"{where} has no graph: an empty or truncated file is not an ONNX model")
    if proto.functions:
        try:
            proto = onnx.inliner.inline_local_functions(proto)
        except Exception as error:
            raise InvalidModelError(f"cannot inline the model's local functions: {error}") from None
    opsets = {}
    for entry in proto.opset_import:
        opsets[registry._canonical_domain(entry.domain)] = entry.version
    if "" not in opsets and proto.ir_version < 3:
        opsets[""] = 1
    if not allow_newer_opset:
        check_opsets(opsets)
    external = ExternalData(os.path.dirname(os.path.abspath(path))) if path else None
    if external is not None:
        streamed = _streamed_names(proto.graph) - set(overrides)  # (a weight the weights file gives is never read)
        external.read_ahead([t for t in proto.graph.initializer if t.name in streamed])
    builder = _GraphBuilder(opsets, external, overrides, raw)
    graph = builder.build(proto.graph, top=True)
    builder.finish()
    unused = set(overrides) - builder.used_overrides
    if unused:
        raise InvalidModelError(f"weights file has tensors the model does not use: {sorted(unused)[:10]}")
    return LoadedModel(graph, opsets, proto.ir_version, proto.producer_name, path)  # the protobuf is freed


# Inputs read otherwise than streamed as stored, a step: (domain, op type) -> positions. A table a
# Gather looks rows up in (an embedding: a few rows a step), a quantized one's data and scales
# likewise, and a 4-bit weight's bytes, scales and zero points, which runnx repacks into tiles of its
# own at load (`ops/nibble_tiles.py`: its products never read them again).
_NOT_STREAMED = {("", "Gather"): (0,), ("com.microsoft", "GatherBlockQuantized"): (0, 1, 2),
                 ("com.microsoft", "MatMulNBits"): (1, 2, 3)}


def _streamed_names(graph) -> set[str]:
    """The values some node of `graph` (or of its subgraphs) reads streamed as stored (not as
    `_NOT_STREAMED` says): only those are worth reading into huge pages whole
    (`ExternalData.read_ahead`); the others stay mapped. (Reading a 4-bit build's 17 MB of scales
    ahead delayed the tiles' prepacking past the first token, 55 -> 80-130 ms at 2 threads.)"""
    names: set[str] = set()
    for node in graph.node:
        skipped = _NOT_STREAMED.get(("" if node.domain == "ai.onnx" else node.domain, node.op_type), ())
        names.update(name for position, name in enumerate(node.input) if name and position not in skipped)
        for attribute in node.attribute:
            for subgraph in (*([attribute.g] if attribute.type == AttributeProto.GRAPH else ()), *attribute.graphs):
                names |= _streamed_names(subgraph)
    return names


def check_opsets(opsets: dict) -> None:
    """Refuse a domain imported at a version newer than runnx's kernels know: its ops may mean
    something else there, and the newest kernels would run silently (domains runnx has no kernel
    for are left to the unsupported-operator check)."""
    for domain, version in sorted(opsets.items()):
        newest = registry.newest_opset(domain)
        if newest is not None and version > newest:
            raise UnsupportedOpsetError(
                f"the model imports {domain or 'ai.onnx'} opset {version}, but runnx supports it up to opset "
                f"{newest} (allow_newer_opset=True or RUNNX_ALLOW_NEWER_OPSET=1 runs it with the newest kernels)")


def value_info(proto) -> ValueInfo:
    """ValueInfo from a ValueInfoProto (tensor, sequence, optional, map, sparse)."""
    return _type_info(proto.name, proto.type)


def _type_info(name, type_proto) -> ValueInfo:
    which = type_proto.WhichOneof("value")
    if which == "tensor_type" or which == "sparse_tensor_type":
        tensor = getattr(type_proto, which)
        shape = None
        if tensor.HasField("shape"):
            shape = tuple(
                d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tensor.shape.dim)
        return ValueInfo(name, "tensor" if which == "tensor_type" else "sparse", tensor.elem_type or None, shape)
    if which == "sequence_type":
        inner = _type_info(name, type_proto.sequence_type.elem_type)
        return ValueInfo(name, "sequence", inner.elem_type, inner.shape)
    if which == "optional_type":
        inner = _type_info(name, type_proto.optional_type.elem_type)
        return ValueInfo(name, "optional", inner.elem_type, inner.shape, inner.kind)
    if which == "map_type":
        return ValueInfo(name, "map", None, None)
    return ValueInfo(name, "unknown", None, None)


class _GraphBuilder:
    def __init__(self, opsets, external, overrides, raw):
        self.opsets = opsets
        self.external = external
        self.overrides = overrides
        self.raw = raw  # the top-level initializers' raw_data, read apart from the protobuf
        self.used_overrides: set[str] = set()
        self.unsupported: dict[tuple, list[str]] = {}
        self.node_count = 0

    def finish(self):
        if self.unsupported:
            lines = []
            for (domain, op, opset), nodes in sorted(self.unsupported.items()):
                shown = ", ".join(f"'{n}'" for n in nodes[:5]) + (f" and {len(nodes) - 5} more" if len(nodes) > 5 else "")
                known = registry.known_versions(domain, op)
                hint = f" (runnx has it from opset {known[0]})" if known else ""
                lines.append(f"  {domain or 'ai.onnx'}::{op} at opset {opset}{hint}: nodes {shown}")
            raise UnsupportedOpError("unsupported operators:\n" + "\n".join(lines))

    def build(self, proto, top=False, owner="the model") -> Graph:
        names: list[str] = []
        ids: dict[str, int] = {}
        where: dict[str, str] = {}

        def define(name, origin):
            if name in capture_users:  # read before its producer (nodes out of order): local after all
                captures.remove(name)
                del capture_users[name]
                where[name] = origin
                return ids[name]
            if name in ids:
                raise InvalidModelError(f"value '{name}' is defined twice in {owner}'s graph: by {where[name]} and by {origin}")
            _check_text(name, origin)
            ids[name] = len(names)
            names.append(name)
            where[name] = origin
            return ids[name]

        captures: list[str] = []
        capture_users: dict[str, str] = {}

        def use(name, user):
            if name == "":
                return MISSING
            if name not in ids:
                _check_text(name, user)
                ids[name] = len(names)
                names.append(name)
                where[name] = "an enclosing graph"
                captures.append(name)
                capture_users[name] = user
            return ids[name]

        constants: dict[int, np.ndarray] = {}
        initializer_names = set()
        for tensor in proto.initializer:
            vid = define(tensor.name, f"initializer '{tensor.name}'")
            initializer_names.add(tensor.name)
            if tensor.name in self.overrides:
                constants[vid] = self.overrides[tensor.name]
                self.used_overrides.add(tensor.name)
            else:
                constants[vid] = tensor_to_array(tensor, self.external, self.raw.get(tensor.name) if top else None)
        for sparse in proto.sparse_initializer:
            name = sparse.values.name
            vid = define(name, f"sparse initializer '{name}'")
            initializer_names.add(name)
            constants[vid] = _sparse_to_dense(sparse)
        inputs, input_info, defaults, default_info = [], [], {}, {}
        for info in proto.input:
            if info.name in initializer_names:  # overridable: an input with a default, never a constant
                vid = ids[info.name]
                defaults[vid] = constants.pop(vid)
                default_info[vid] = _default_info(info, defaults[vid])
                if top:  # a subgraph's formal inputs are positional: the op feeds this one too
                    continue
                input_info.append(default_info[vid])
                inputs.append(vid)
                continue
            inputs.append(define(info.name, f"input '{info.name}'"))
            input_info.append(value_info(info))
        nodes = []
        for index, node_proto in enumerate(proto.node):
            nodes.append(self._node(node_proto, index, define, use, owner))
        outputs = tuple(use(o.name, f"{owner}'s output '{o.name}'") for o in proto.output)
        graph = Graph(
            name=proto.name, names=names, inputs=tuple(inputs), input_info=tuple(input_info), outputs=outputs,
            output_info=tuple(value_info(o) for o in proto.output), constants=constants, nodes=(),
            captures=tuple(captures), capture_ids=tuple(ids[c] for c in captures),
            defaults=defaults, default_info=default_info, ids=ids)
        self._fold_constants(graph, nodes)
        if top and captures:
            missing = captures[0]
            raise InvalidModelError(f"{capture_users[missing]} uses '{missing}', which is not an input, initializer "
                                    f"or output of any node")
        return graph

    def _node(self, proto, index, define, use, owner) -> Node:
        self.node_count += 1
        for text in (proto.op_type, proto.domain, proto.name):
            _check_text(text, f"node {index} of {owner}'s graph")
        name = proto.name or f"{proto.op_type}_{self.node_count}"
        label = f"{proto.op_type} node '{name}'"
        domain = registry._canonical_domain(proto.domain)
        subgraphs, attrs = {}, {}
        for attribute in proto.attribute:
            if attribute.type in (AttributeProto.GRAPH, AttributeProto.GRAPHS):
                graphs = [self.build(g, owner=label) for g in
                          ([attribute.g] if attribute.type == AttributeProto.GRAPH else attribute.graphs)]
                subgraphs[attribute.name] = graphs[0] if attribute.type == AttributeProto.GRAPH else graphs
                attrs[attribute.name] = subgraphs[attribute.name]
            else:
                attrs[attribute.name] = self._attribute(attribute, label)
        inputs = tuple(use(n, label) for n in proto.input)
        capture_names = []
        for sub in subgraphs.values():
            for graph in (sub if isinstance(sub, list) else [sub]):
                capture_names += [c for c in graph.captures if c not in capture_names]
        captures = tuple(use(n, label) for n in capture_names)
        outputs = tuple(define(n, label) if n else MISSING for n in proto.output)
        node = Node(index, name, proto.op_type, domain, inputs, outputs, attrs, subgraphs, captures)
        self._bind(node)
        return node

    def _bind(self, node: Node) -> None:
        opset = self.opsets.get(node.domain)
        if opset is None:
            raise InvalidModelError(f"{node.describe()} uses domain '{node.domain}', which the model does not import "
                                    f"(opset_import has {sorted(self.opsets)})")
        kernel = registry.resolve(node.domain, node.op_type, opset)
        if kernel is None:
            self.unsupported.setdefault((node.domain, node.op_type, opset), []).append(node.name)
            return
        node.kernel, node.since = kernel, kernel.since
        least, most = kernel.arity
        if not least <= len(node.inputs) <= (most if most is not None else len(node.inputs)):
            takes = f"{least}" if least == most else f"{least} to {most}" if most is not None else f"at least {least}"
            raise InvalidModelError(f"{node.describe()} has {len(node.inputs)} inputs, {node.op_type}-{kernel.since} "
                                    f"takes {takes}")
        for attr_name, value in node.attrs.items():
            problem = registry.check_attribute(kernel, attr_name, value)
            if problem:
                raise InvalidModelError(f"{node.describe()}: {problem}")
        for attr_name, (_, default) in kernel.attrs.items():
            if default is registry.REQUIRED and attr_name not in node.attrs:
                raise InvalidModelError(f"{node.describe()}: required attribute '{attr_name}' is missing")

    def _fold_constants(self, graph: Graph, nodes: list[Node]) -> None:
        """Constant nodes become constants at load: no dispatch per run."""
        kept = []
        for node in nodes:
            if node.op_type == "Constant" and node.domain == "" and node.kernel is not None:
                if len(node.outputs) != 1:
                    raise InvalidModelError(f"{node.describe()} has {len(node.outputs)} outputs, Constant has one")
                try:
                    value = node.kernel.fn(**node.attrs)
                except RunnxError as error:
                    raise InvalidModelError(f"{node.describe()}: {error}") from None
                except Exception as error:
                    raise InvalidModelError(f"{node.describe()}: cannot build its value: {error}") from None
                value = np.asarray(value)
                value.flags.writeable = False
                if node.outputs[0] != MISSING:
                    graph.constants[node.outputs[0]] = value
            else:
                kept.append(node)
        graph.nodes = tuple(kept)
        graph.producer = {vid: node for node in kept for vid in node.outputs if vid != MISSING}

    def _tensor(self, tensor):
        return tensor_to_array(tensor, self.external)

    def _attribute(self, attribute, label):
        kind = attribute.type
        try:
            if kind == AttributeProto.INT:
                return int(attribute.i)
            if kind == AttributeProto.FLOAT:
                return float(attribute.f)
            if kind == AttributeProto.STRING:
                return attribute.s.decode("utf-8")
            if kind == AttributeProto.INTS:
                return tuple(int(v) for v in attribute.ints)
            if kind == AttributeProto.FLOATS:
                return tuple(float(v) for v in attribute.floats)
            if kind == AttributeProto.STRINGS:
                return tuple(s.decode("utf-8") for s in attribute.strings)
            if kind == AttributeProto.TENSOR:
                return self._tensor(attribute.t)
            if kind == AttributeProto.SPARSE_TENSOR:
                return _sparse_to_dense(attribute.sparse_tensor)
            if kind == AttributeProto.TYPE_PROTO:
                return attribute.tp
            if kind == AttributeProto.TENSORS:
                return tuple(self._tensor(t) for t in attribute.tensors)
            if kind == AttributeProto.TYPE_PROTOS:
                return tuple(attribute.type_protos)
        except UnicodeDecodeError:
            raise InvalidModelError(f"{label}: attribute '{attribute.name}' is not valid UTF-8") from None
        except ModelLoadError as error:  # a tensor attribute that cannot be decoded
            raise type(error)(f"{label}: attribute '{attribute.name}': {error}") from None
        raise InvalidModelError(f"{label}: attribute '{attribute.name}' has an unknown or unset type ({kind})")


def _default_info(info, default: np.ndarray) -> ValueInfo:
    """The declared type of an overridable initializer, which its default must have: a feed is
    checked against it. Undeclared, the default's dtype and shape."""
    declared = value_info(info)
    elem_type = _elem_type(default.dtype)
    if declared.kind != "tensor" or declared.elem_type is None:
        return ValueInfo(info.name, "tensor", elem_type, default.shape)
    if elem_type is not None and declared.elem_type != elem_type:
        raise InvalidModelError(f"input '{info.name}' is declared {type_name(declared.elem_type)}, but its "
                                f"initializer (its default) is {type_name(elem_type)}")
    return declared


def _elem_type(dtype):
    try:
        return onnx_type(dtype)
    except KeyError:
        return None


def _check_text(text, where) -> None:
    """protobuf hands out invalid UTF-8 in string fields as bytes: refuse it before it becomes a name."""
    if type(text) is not str:
        raise InvalidModelError(f"{where}: name {text!r} is not valid UTF-8")


def _sparse_to_dense(sparse) -> np.ndarray:
    values = tensor_to_array(sparse.values)
    indices = tensor_to_array(sparse.indices).astype(np.int64)
    shape = tuple(sparse.dims)
    if any(d < 0 for d in shape):
        raise InvalidModelError(f"sparse tensor '{sparse.values.name}' has a negative dimension: {shape}")
    size = int(np.prod(shape, dtype=np.int64))
    try:
        flat = indices.reshape(-1) if indices.ndim == 1 else np.ravel_multi_index(indices.T, shape)
        if flat.size != values.size or (flat.size and not 0 <= flat.min() <= flat.max() < size):
            raise ValueError(f"{values.size} values at indices outside [0, {size}) or of another count")
    except ValueError as error:
        raise InvalidModelError(f"sparse tensor '{sparse.values.name}' of shape {shape}: {error}") from None
    dense = np.zeros(size, dtype=values.dtype)
    dense[flat] = values.reshape(-1)
    dense = dense.reshape(shape)
    dense.flags.writeable = False
    return dense
