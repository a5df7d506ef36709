"""Cuts that change nothing: a Slice keeping every element of the axes it slices, and the empty
inputs of a Concat, go; readers of what they made read their input instead. Whether a cut is whole
or empty is worked out from the graph's static dims (static_dims.py), bounds computed from shapes
included. The nodes left unread afterwards (those bounds' computations) go too.

Why: an export of a rotary embedding over the first r columns of each head rotates x[..., :r] and
concatenates x[..., r:]; when r is the head's width (read at run time from the cos table's shape),
that is the plain rotary embedding with two Slices and a Concat around it, which hide it from the
rotary, attention and layer patterns.
"""
from __future__ import annotations

from dataclasses import replace

from runnx.interp.fusion.static_dims import StaticDims, as_int
from runnx.interp.ir import MISSING, Graph, Node


def drop_identity_cuts(graph: Graph) -> int:
    """Drop `graph`'s whole Slices and empty Concat inputs (not in its subgraphs); returns how many
    Slice and Concat nodes changed."""
    static = StaticDims(graph)
    captured = {vid for node in graph.nodes for vid in node.captures}
    alias, replaced, changed = {}, {}, 0
    for node in graph.nodes:
        if node.domain != "" or node.subgraphs or len(node.outputs) != 1 or not node.inputs:
            continue  # (a malformed node is left for the loader's and the kernel's checks)
        aliased = node.outputs[0] not in graph.outputs and node.outputs[0] not in captured  # may be read as another
        if node.op_type == "Slice" and node.since >= 10 and aliased and _whole(static, node):
            alias[node.outputs[0]] = node.inputs[0]
            changed += 1
        elif node.op_type == "Concat" and len(node.inputs) > 1:
            kept = _non_empty(static, node)
            if kept is None or len(kept) == len(node.inputs):
                continue
            if len(kept) == 1 and aliased and static.dims(kept[0]) == static.dims(node.outputs[0]) is not None:
                alias[node.outputs[0]] = kept[0]
            elif kept:
                replaced[node.index] = replace(node, inputs=tuple(kept))
            else:
                continue
            changed += 1
    if not changed:
        return 0

    def resolve(vid: int) -> int:
        while vid in alias:
            vid = alias[vid]
        return vid

    nodes = []
    for node in graph.nodes:
        if node.outputs and node.outputs[0] in alias:
            continue
        node = replaced.get(node.index, node)
        if any(v in alias for v in node.inputs):
            node = replace(node, inputs=tuple(resolve(v) for v in node.inputs))
        nodes.append(node)
    graph.nodes = _live(graph, nodes)
    graph.producer = {vid: node for node in graph.nodes for vid in node.outputs if vid != MISSING}
    return changed


def _whole(static: StaticDims, node: Node) -> bool:
    """Whether the Slice keeps every element: each sliced axis from 0 to its end, steps 1."""
    found = static.slice_ranges(node)
    if found is None:
        return False
    own, ranges = found
    for start, end, axis, step in ranges:
        start, end, axis, step = (as_int(v) for v in (start, end, axis, step))
        if axis is None or step != 1 or start is None or end is None or not -len(own) <= axis < len(own):
            return False
        dim = own[axis]
        if dim is None or range(*slice(start, end).indices(dim)) != range(dim):
            return False
    return True


def _non_empty(static: StaticDims, node: Node) -> list | None:
    """The Concat's inputs but those known to be empty along its axis (None if an input's rank is unknown)."""
    kept = []
    for vid in node.inputs:
        dims = static.dims(vid)
        if dims is None:
            return None
        if not dims or dims[node.attrs.get("axis", 0) % len(dims)] != 0:
            kept.append(vid)
    return kept


def _live(graph: Graph, nodes: list) -> tuple:
    """`nodes` without those whose results nothing reads (repeatedly: what only they read goes too)."""
    while True:
        read = set(graph.outputs)
        for node in nodes:
            read.update(node.inputs)
            read.update(node.captures)
        live = [n for n in nodes if n.subgraphs or any(v != MISSING and v in read for v in n.outputs)]
        if len(live) == len(nodes):
            return tuple(nodes)
        nodes = live
