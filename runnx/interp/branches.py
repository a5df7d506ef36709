"""Branch specialization: a model that is one If on one of its inputs runs the branch that input
picks as a top-level graph of its own.

Optimum's merged decoders are exactly that: `If(use_cache_branch)` whose branches read the
model's inputs and weights as captures. Through the If, every step builds a CaptureEnv of ~120
captures, binds them into the branch, and the model's plan stays interpreted (plans holding
subgraph nodes do, compiled.py); as a graph of its own the chosen branch binds the feeds directly
and its plan compiles, weights and all. Nothing is decided differently: a feed handed over
(`runnx.Owned`) is owned by the branch's plan as it was when the If, its only reader, moved it
into the CaptureEnv, and the model's weights stay read-only constants.

The branch graphs share the If's branches' nodes (fused kernels and shape memos included) and
their value ids; `Branch.ids` maps the model's input and output ids to them.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from runnx.interp.ir import MISSING, Graph


@dataclass(frozen=True, eq=False)  # hashed by identity: a key of the model's plans
class Branch:
    graph: Graph
    ids: dict  # the model graph's input and output value ids -> this graph's


@dataclass(frozen=True)
class BranchChoice:
    condition: int  # the model input the If reads
    branches: tuple  # (else Branch, then Branch): indexed by the condition's truth

    def pick(self, bound: dict, output_vids: tuple) -> Branch | None:
        """The branch the fed condition selects, or None (the If then runs as a node: a condition
        not fed or not one element gets its error there, intermediate values exist only there)."""
        fed = bound.get(self.condition)
        if fed is None or type(fed[0]) is not np.ndarray or fed[0].size != 1:
            return None
        branch = self.branches[bool(fed[0].reshape(-1)[0])]
        ids = branch.ids
        return branch if all(v in ids for v in output_vids) else None


def specialize_branches(graph: Graph) -> BranchChoice | None:
    """A BranchChoice when `graph` is one If whose condition is one of its inputs and whose
    outputs are the graph's; otherwise None."""
    if len(graph.nodes) != 1:
        return None
    (node,) = graph.nodes
    if node.op_type != "If" or node.domain not in ("", "ai.onnx") or node.inputs[0] not in graph.inputs:
        return None
    if not all(v in node.outputs and v != MISSING for v in graph.outputs):
        return None
    branches = []
    for attr in ("else_branch", "then_branch"):
        branch = _as_model_graph(graph, node, node.subgraphs.get(attr))
        if branch is None:
            return None
        branches.append(branch)
    return BranchChoice(node.inputs[0], tuple(branches))


def _as_model_graph(graph: Graph, node, sub: Graph | None) -> Branch | None:
    """The If branch `sub` as a graph with the model's inputs and outputs: its captures of the
    model's inputs become its inputs (of overridable initializers, inputs with their default),
    its captures of initializers its constants."""
    if sub is None or sub.inputs:
        return None
    names, ids = list(sub.names), dict(sub.ids)
    constants = dict(sub.constants)
    captured = dict(zip(sub.captures, sub.capture_ids))
    mapping = {}
    for name, local in captured.items():
        outer = graph.ids.get(name)
        if outer is None or (outer not in graph.inputs and outer not in graph.constants
                             and outer not in graph.defaults):
            return None  # read from a scope above the model's graph, or computed by a node
        if outer in graph.constants:
            constants[local] = graph.constants[outer]
        mapping[outer] = local
    for vid in (*graph.inputs, *graph.defaults):
        if vid not in mapping:  # an input the branch does not read (the condition, at least)
            mapping[vid] = len(names)
            names.append(graph.names[vid])
    for vid in graph.outputs:
        mapping[vid] = sub.outputs[node.outputs.index(vid)]
    specialized = Graph(
        name=f"{graph.name} ({sub.name})", names=names, inputs=tuple(mapping[v] for v in graph.inputs),
        input_info=graph.input_info, outputs=tuple(mapping[v] for v in graph.outputs),
        output_info=graph.output_info, constants=constants, nodes=sub.nodes,
        defaults={mapping[v]: default for v, default in graph.defaults.items()},
        default_info={mapping[v]: info for v, info in graph.default_info.items()},
        ids=ids, producer=sub.producer)
    return Branch(specialized, mapping)
