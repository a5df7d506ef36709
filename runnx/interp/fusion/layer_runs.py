"""Runs of layer boundaries: AttentionGatedMLPRopeAppend nodes in a row, each reading the one
before's rotated query, grown caches and sum (and nothing else of them), become one GatedLayersRun
node (kernel in `runnx/ops/decoder_layers.py`), which a decode step runs in native loops over them,
where each node cost tens of microseconds of Python between native calls.

Runs after the patterns (`fusion.fuse`), over the nodes they made. Outside the run, the sums and
rotated queries it keeps inside may be read only for their shape, and the caches it grows only for
their shape or as graph outputs. Those shape readers (the memos making the next layer's head
repeat targets from its grown cache's shape) would make the run read what it computes, so they
read stand-ins made from the run's inputs instead: a grown cache's shape is GrownCacheShape of the
cache the node grows and the run's first query (a node grows its caches along axis 2 by its query's
positions: its Concat's shape), a sum's and a rotated query's LayerNormShape of the run's first
residual and query (the same shape and dtype, node after node).
"""
from __future__ import annotations

from dataclasses import replace

from runnx.interp.fusion.matcher import Matcher, fused_node
from runnx.interp.ir import MISSING, Graph, Node
from runnx.ops._fused_common import DOMAIN

_BOUNDARY_OP = "AttentionGatedMLPRopeAppend"


def layer_runs(graph: Graph) -> int:
    """Make `graph`'s runs of layer boundaries GatedLayersRun nodes (not in its subgraphs); returns
    how many runs."""
    from runnx.ops.decoder_layers import BOUNDARY as AT  # (its inputs by name; the ops only once a graph fuses)
    view = Matcher(graph)  # each value's readers, the graph's outputs
    readers, requested = view.readers, view.requested
    runs = []
    for node in graph.nodes:
        if not _boundary(node) or _after(graph.producer.get(node.inputs[AT.chained[0]]), readers, AT) is node:
            continue  # (a run is found from its first node)
        members = [node]
        while (after := _after(members[-1], readers, AT)) is not None:
            members.append(after)
        if len(members) > 1 and _read_outside_for_shape(members, readers, requested):
            runs.append(members)
    if not runs:
        return 0
    replaced: dict[int, int] = {}  # value id -> the stand-in's, for readers outside a run
    added: list[Node] = []
    removed = set()
    next_index = max(n.index for n in graph.nodes) + 1
    for members in runs:
        first = members[0]
        query, _, _, residual = AT.chained
        for member in members:
            for grown, past in zip(member.outputs[2:4], AT.grown):
                stand_in = graph.new_value(f"{graph.names[grown]}/shape")
                index = next_index + len(added)
                added.append(fused_node(index, f"GrownCacheShape({index})", "GrownCacheShape",
                                        (member.inputs[past], first.inputs[query]), (stand_in,), {}))
                replaced[grown] = stand_in
        for member in members[:-1]:
            for vid, like in zip(member.outputs[:2], (first.inputs[residual], first.inputs[query])):
                if any(r not in members for r in readers.get(vid, ())):
                    index = next_index + len(added)
                    added.append(fused_node(index, f"LayerNormShape({index})", "LayerNormShape", (like,), (vid,), {}))
        inputs = list(first.inputs)
        for member in members[1:]:
            inputs += [MISSING if p in AT.chained else v for p, v in enumerate(member.inputs)]
        outputs = (*[v for n in members for v in n.outputs[2:4]], *members[-1].outputs[:2])
        run = fused_node(max(n.index for n in members), f"GatedLayersRun({first.name}, {len(members)} nodes)",
                         "GatedLayersRun", inputs, outputs, {**first.attrs, "members": len(members)})
        added.append(run)
        removed.update(n.index for n in members)
    inside = {id(n) for members in runs for n in members}
    nodes = []
    for node in graph.nodes:
        if node.index in removed:
            continue
        if id(node) not in inside and any(v in replaced and node.reads_shape_only(v) for v in node.inputs):
            node = replace(node, inputs=tuple(replaced[v] if v in replaced and node.reads_shape_only(v) else v
                                              for v in node.inputs))
        nodes.append(node)
    graph.nodes = tuple(nodes) + tuple(added)
    graph.producer = {vid: node for node in graph.nodes for vid in node.outputs if vid != MISSING}
    return len(runs)


def _boundary(node: Node | None) -> bool:
    return (node is not None and node.op_type == _BOUNDARY_OP and node.domain == DOMAIN and len(node.outputs) == 4
            and node.attrs.get("key_cache_axis") in (2, -2) and node.attrs.get("value_cache_axis") in (2, -2))


def _after(before: Node | None, readers: dict, at) -> Node | None:
    """The boundary reading `before`'s (one too) sum, rotated query and grown caches as its
    residual, query, keys and values, and nothing else of them, with `before`'s attributes."""
    if not _boundary(before):
        return None
    found = readers.get(before.outputs[1], ())
    after = found[0] if len(found) == 1 else None
    if not _boundary(after) or len(after.inputs) != at.width or after.attrs != before.attrs:
        return None
    summed, rotated, grown_key, grown_value = before.outputs
    query, key, value, residual = at.chained
    places = {query: rotated, key: grown_key, value: grown_value, residual: summed}
    if any(after.inputs[p] != v for p, v in places.items()):
        return None
    if any(v in before.outputs for p, v in enumerate(after.inputs) if p not in places):
        return None
    return after


def _read_outside_for_shape(members: list, readers: dict, requested: set) -> bool:
    """Whether the values the run's nodes but the last compute are read outside it only as the
    module docstring allows (the last node's, the run's outputs, by anything)."""
    inside = {id(n) for n in members}
    for member in members[:-1]:
        for vid in member.outputs:
            if vid in member.outputs[:2] and vid in requested:
                return False
            for reader in readers.get(vid, ()):
                if id(reader) not in inside and not reader.reads_shape_only(vid):
                    return False
    return True
