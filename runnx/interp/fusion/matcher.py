"""The pattern matcher's vocabulary: a fused node to be, and a view of the graph with each value's
readers, for matchers walking producers from an anchor node.

Each matcher starts from an anchor node, walks its producers and checks ops, attributes and
constants; every value computed inside the pattern must be read only inside it (or, for
values whose stand-ins keep their shape, only for their shape), so removing the pattern's nodes
changes nothing else.
"""
from __future__ import annotations

from dataclasses import dataclass

from runnx.interp.ir import MISSING, Graph, Node
from runnx.ops import registry
from runnx.ops._fused_common import DOMAIN

@dataclass
class Fused:
    op_type: str
    members: list  # nodes replaced
    inputs: tuple  # value ids (MISSING for an absent optional input)
    outputs: tuple
    attrs: dict
    domain: str = DOMAIN  # runnx's fused ops; a standard op's own domain where one fits (com.microsoft)


def fused_node(index: int, name: str, op_type: str, inputs: tuple, outputs: tuple, attrs: dict,
               domain: str = DOMAIN) -> Node:
    """A new node of `op_type` in `domain` (runnx's fused ops by default), its kernel bound."""
    kernel = registry.resolve(domain, op_type, 1)
    return Node(index, name, op_type, domain, tuple(inputs), tuple(outputs), attrs, {}, (), kernel, kernel.since)


class Matcher:
    def __init__(self, graph: Graph, static=None):
        self.graph = graph
        self.readers: dict[int, list[Node]] = {}
        for node in graph.nodes:
            for vid in list(node.inputs) + list(node.captures):
                self.readers.setdefault(vid, []).append(node)
        self.requested = set(graph.outputs)
        self.taken: set[int] = set()
        self._static = static

    @property
    def static(self):
        """What the graph states about shapes (`StaticDims`; given by `fuse`, shared by its passes:
        facts about values, which keep their ids through fusion)."""
        if self._static is None:
            from runnx.interp.fusion.static_dims import StaticDims  # (it imports the folding kernels)
            self._static = StaticDims(self.graph)
        return self._static

    def rank(self, vid: int) -> int | None:
        """The rank the graph states for `vid` before anything runs, or None."""
        dims = self.static.dims(vid)
        return None if dims is None else len(dims)

    def node(self, vid: int, op_type: str) -> Node | None:
        """The producer of `vid` if it is a standard `op_type` node not yet fused."""
        node = self.graph.producer.get(vid)
        if node is None or node.op_type != op_type or node.domain != "" or node.index in self.taken:
            return None
        return node

    def scalar(self, vid: int):
        value = self.graph.constants.get(vid)
        return value if value is not None and value.size == 1 else None

    def number(self, vid: int, rank: int | None = 1):
        """A float constant of one element as a numpy scalar of its dtype, for a fused node's
        attribute (numpy promotes it as it does the constant, so the arithmetic is the same), when
        its rank cannot raise that of the value it meets (`rank`, None: unknown; a rank of 1 never
        does); else None."""
        value = self.scalar(vid)
        if value is None or value.dtype.kind != "f" or value.ndim > max(1, rank or 0):
            return None
        return value.reshape(())[()]

    def private(self, members: list[Node], result: int | tuple, shape_read: tuple = ()) -> bool:
        """Values made inside `members` (but `result`, one value id or several) are read only
        inside them; those in `shape_read` may also be read by nodes reading only their shape."""
        inside = {n.index for n in members}
        results = result if isinstance(result, tuple) else (result,)
        for node in members:
            for vid in node.outputs:
                if vid == MISSING or vid in results:
                    continue
                if vid in self.requested:
                    return False
                for reader in self.readers.get(vid, ()):
                    if reader.index not in inside and not (vid in shape_read and reader.reads_shape_only(vid)):
                        return False
        return True

    def head_repeat(self, vid: int) -> tuple | None:
        """((Unsqueeze, Expand, Reshape), r) for nodes ending in `vid` shaped as transformers exports
        `repeat_kv`, r when they repeat each head of a KV cache (batch, heads, length, depth) r times
        in place: Reshape(Expand(Unsqueeze(kv, 2), (b, h, r, n, d)), (b, h * r, n, d)), the targets
        proven from the cache's own dims (`StaticDims.dim_terms`), so no kernel checks them at run
        time; r None when the graph does not prove that. None without such nodes."""
        reshape = self.node(vid, "Reshape")
        expand = self.node(reshape.inputs[0], "Expand") if reshape is not None else None
        unsqueeze = self.node(expand.inputs[0], "Unsqueeze") if expand is not None else None
        if unsqueeze is None or reshape.attrs.get("allowzero", 0) or unsqueeze.since < 13:
            return None
        return (unsqueeze, expand, reshape), self._proven_repeat(unsqueeze, expand, reshape)

    def _proven_repeat(self, unsqueeze: Node, expand: Node, reshape: Node) -> int | None:
        kv, axes = self.static.dim_terms(unsqueeze.inputs[0]), self.static.ints(unsqueeze.inputs[1])
        expanded, reshaped = self.static.dim_terms(expand.outputs[0]), self.static.dim_terms(reshape.outputs[0])
        if kv is None or len(kv) != 4 or axes is None or [a % 5 for a in axes.tolist() if a is not None] != [2]:
            return None
        repeat = expanded[2] if expanded is not None and len(expanded) == 5 else None
        if not isinstance(repeat, int) or repeat < 1 or expanded != (*kv[:2], repeat, *kv[2:]):
            return None
        heads = kv[1] * repeat if isinstance(kv[1], int) else kv[1] if repeat == 1 else None
        return repeat if heads is not None and reshaped == (kv[0], heads, *kv[2:]) else None

    def other(self, node: Node, vid: int) -> int:
        """The other input of a binary node, given one."""
        a, b = node.inputs[:2]
        return b if a == vid else a

