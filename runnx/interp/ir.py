"""The small IR runnx executes: graphs of nodes over integer value ids.

Each graph has its own id space. Names a subgraph reads from enclosing scopes are its *captures*:
they get local ids bound at run time from a CaptureEnv, so every graph is a closed function of
(inputs, captures) and no parent environment is ever handed down wholesale.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

MISSING = -1  # id of an omitted optional input or output


@dataclass(frozen=True, slots=True)
class ValueInfo:
    """Declared type of a graph input/output: kind is 'tensor', 'sequence', 'optional', ... ."""

    name: str
    kind: str
    elem_type: int | None  # ONNX element type of the tensor (or of the sequence/optional's tensor)
    shape: tuple | None  # None: rank unknown; entries are int, str (symbolic) or None (unknown)
    inner_kind: str = "tensor"  # of an optional: what it holds when present ('tensor' or 'sequence')


@dataclass(eq=False, slots=True)
class Node:
    index: int
    name: str
    op_type: str
    domain: str
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    attrs: dict
    subgraphs: dict  # attribute name -> Graph
    captures: tuple[int, ...] = ()  # ids (in the node's graph) of outer values its subgraphs read
    kernel: object = None  # registry.Kernel, bound at load
    since: int = 0  # since-version of the bound kernel

    def describe(self) -> str:
        domain = f"{self.domain}." if self.domain not in ("", "ai.onnx") else ""
        return f"{domain}{self.op_type} node '{self.name}'"

    def reads_shape_only(self, vid: int) -> bool:
        """Whether the node reads value `vid` only for its shape and dtype (Shape, Size, a shape
        memo's roots: the kernel's `shape_only` positions): an earlier in-place write of its data
        cannot change what such a node computes."""
        shape_only = getattr(self.kernel, "shape_only", ())
        return bool(shape_only) and vid in self.inputs and all(
            position in shape_only for position, v in enumerate(self.inputs) if v == vid)


@dataclass(eq=False)
class Graph:
    name: str
    names: list[str]  # value id -> name
    inputs: tuple[int, ...]  # formal inputs the caller (or the parent op) provides
    input_info: tuple[ValueInfo, ...]
    outputs: tuple[int, ...]
    output_info: tuple[ValueInfo, ...]
    constants: dict[int, np.ndarray]  # initializers and folded Constant nodes (read-only arrays)
    nodes: tuple[Node, ...]
    captures: tuple[str, ...] = ()  # names read from enclosing scopes
    capture_ids: tuple[int, ...] = ()
    # Initializers also listed as inputs: the caller may feed them, the initializer is only their
    # default. They are inputs, never constants, so no load-time pass (folding, shape memos,
    # fusion, read-ahead, last position) can bake their default in; a plan reads the default of
    # one not fed (planner.py). value id -> default (read-only array); the declared types below.
    defaults: dict = field(default_factory=dict)
    default_info: dict = field(default_factory=dict)  # value id -> ValueInfo
    ids: dict = field(default_factory=dict)  # name -> value id
    producer: dict = field(default_factory=dict)  # value id -> Node
    # Constants a load-time pass cut into column blocks laid in their own memory, so no longer
    # constants (fusion/split_products.py): value id -> [(block's value id, first column, end)]
    moved: dict = field(default_factory=dict)

    def value_id(self, name: str) -> int:
        return self.ids[name]

    def new_value(self, name: str) -> int:
        """The id of a new value named `name` (with underscores appended while the name is taken)."""
        while name in self.ids:
            name += "_"
        self.ids[name] = len(self.names)
        self.names.append(name)
        return self.ids[name]

    def new_constant(self, name: str, array) -> int:
        """The id of a new constant named `name` (`new_value`): a read-only copy of `array`."""
        vid = self.new_value(name)
        array = np.array(array, order="C")  # (one copy, contiguous: a column block of a weight is not)
        array.flags.writeable = False
        self.constants[vid] = array
        return vid

    def walk(self):
        """Yield (graph, node) for every node of this graph and of all nested subgraphs."""
        for node in self.nodes:
            yield self, node
            for sub in node.subgraphs.values():
                yield from sub.walk()
