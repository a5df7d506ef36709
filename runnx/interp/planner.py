"""Planning: which nodes run, in which order, and what each step may consume or release.

Backwards from the requested outputs (only needed nodes run), then forwards over the frontier
of runnable nodes, always preferring a node that consumes nothing in place: readers of a value
(Shape, Gather of a shape, ...) run before the node that would overwrite it. Liveness is
computed once per plan, so the executor only checks storage ownership at run time.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from runnx.capture.ownership import storage_keys
from runnx.errors import CycleError, MissingInputError, MissingValueError
from runnx.interp.ir import MISSING, Graph, Node


@dataclass(frozen=True, slots=True)
class Step:
    node: Node
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    candidates: tuple[tuple[int, int], ...]  # (input position, value id) that die here, may be overwritten
    movable: frozenset  # captured value ids that die here and may be moved into the subgraph
    releases: tuple[int, ...]  # value ids dead after this step (dying inputs, unused outputs)
    fn: object = None  # the kernel function
    kwargs: dict = field(default=None, compare=False)  # attributes plus the reserved keywords known when planning (read-only)
    wants_ctx: bool = False
    single: bool = False  # exactly one output, and it is used


@dataclass(frozen=True, slots=True)
class Plan:
    steps: tuple[Step, ...]
    inputs: tuple[int, ...]  # provided value ids the plan reads
    constants: tuple[int, ...]  # constant ids the plan reads
    outputs: tuple[int, ...]
    unused_inputs: tuple[int, ...]
    # per-run starting state, built once: value and storage-key slots with the constants in place
    # (one extra slot, values[MISSING], stays None)
    values_template: tuple = field(default=(), compare=False)
    keys_template: tuple = field(default=(), compare=False)
    state: dict = field(default_factory=dict, compare=False)  # run count and compiled function (compiled.py)

    @property
    def nodes(self) -> list[Node]:
        return [step.node for step in self.steps]


_NONE = frozenset()


def _reads(node: Node) -> list[int]:
    reads = [v for v in node.inputs if v != MISSING]
    if node.captures:
        reads += node.captures
    return reads


def _consumes(node: Node) -> bool:
    """Whether the node may consume an input in place or move a capture (it then runs last)."""
    kernel = node.kernel
    return bool(node.captures) or (kernel is not None and bool(kernel.inplace or kernel.inplace_from is not None))


def make_plan(graph: Graph, provided: frozenset, outputs: tuple[int, ...]) -> Plan:
    """The execution plan computing `outputs` from the `provided` value ids and the constants
    (with the defaults of the overridable initializers not provided: constants of this plan only)."""
    fixed = {**{v: d for v, d in graph.defaults.items() if v not in provided}, **graph.constants}
    needed = _needed_nodes(graph, provided, outputs, fixed)
    order = _forward_order(graph, needed, provided, fixed)
    return _liveness(graph, order, provided, outputs, fixed)


def _needed_nodes(graph: Graph, provided: frozenset, outputs, fixed: dict) -> list[Node]:
    """Iterative DFS backwards from the outputs; detects cycles and missing values."""
    state: dict[int, int] = {}  # node index -> 1 visiting, 2 done
    needed: list[Node] = []

    producer = graph.producer

    def producer_of(vid: int, user):
        """The node producing `vid`, None for a provided value or a constant; `user` (the reading
        node, or a description) only names it in errors."""
        if vid in provided or vid in fixed:
            return None
        node = producer.get(vid)
        if node is None:
            name = graph.names[vid]
            user = user.describe() if isinstance(user, Node) else user
            if vid in graph.inputs or vid in graph.capture_ids:
                raise MissingInputError(f"input '{name}' is needed by {user} but was not provided")
            raise MissingValueError(f"value '{name}' needed by {user} is not produced by any node")
        return node

    for out in outputs:
        root = producer_of(out, f"the requested output '{graph.names[out]}'")
        if root is None or state.get(root.index) == 2:
            continue
        stack = [(root, iter(_reads(root)))]
        state[root.index] = 1
        while stack:
            node, reads = stack[-1]
            for vid in reads:
                dep = producer_of(vid, node)
                if dep is None:
                    continue
                mark = state.get(dep.index)
                if mark == 1:
                    raise CycleError(f"the graph has a cycle through {dep.describe()} (reached again from "
                                     f"{node.describe()})")
                if mark is None:
                    state[dep.index] = 1
                    stack.append((dep, iter(_reads(dep))))
                    break
            else:
                state[node.index] = 2
                needed.append(node)
                stack.pop()
    needed.sort(key=lambda n: n.index)
    return needed


def _forward_order(graph: Graph, needed: list[Node], provided: frozenset, fixed: dict) -> list[Node]:
    """Topological order over the frontier, readers (non-consuming nodes) first, then model order."""
    waiting: dict[int, int] = {}
    consumers: dict[int, list[Node]] = {}
    in_plan = {node.index for node in needed}
    producer = graph.producer
    for node in needed:
        deps = {vid for vid in _reads(node)
                if vid not in provided and vid not in fixed and producer[vid].index in in_plan}
        waiting[node.index] = len(deps)
        for vid in deps:
            consumers.setdefault(vid, []).append(node)
    frontier = [(_consumes(n), n.index, n) for n in needed if waiting[n.index] == 0]
    heapq.heapify(frontier)
    order = []
    while frontier:
        _, _, node = heapq.heappop(frontier)
        order.append(node)
        for vid in node.outputs:
            for consumer in consumers.get(vid, ()):
                waiting[consumer.index] -= 1
                if waiting[consumer.index] == 0:
                    heapq.heappush(frontier, (_consumes(consumer), consumer.index, consumer))
    return order


def _liveness(graph: Graph, order: list[Node], provided: frozenset, outputs, fixed: dict) -> Plan:
    """One pass forwards for each value's last reads, one building the steps: linear in the reads."""
    requested = set(outputs)
    last_use: dict[int, int] = {}  # released after this step
    last_data_use: dict[int, int] = {}  # later steps read its shape only: its data may be overwritten here
    all_reads = []
    for position, node in enumerate(order):
        reads = _reads(node)
        all_reads.append(reads)
        shape_only = getattr(node.kernel, "shape_only", ())
        data = reads if not shape_only else _data_reads(node, shape_only)
        for vid in reads:
            last_use[vid] = position
        for vid in data:
            last_data_use[vid] = position
    # constants are read-only, never owned: never candidates, never released (held all run for free)
    read_only = fixed.keys() - provided
    steps = []
    for position, node in enumerate(order):
        reads = all_reads[position]
        dying = {vid for vid in reads if last_use[vid] == position and vid not in requested}
        released = tuple(sorted(dying - read_only)) if dying else ()
        kernel = node.kernel
        consumes = kernel.inplace or kernel.inplace_from is not None
        candidates = ()
        if consumes:
            for pos, vid in enumerate(node.inputs):
                if (last_data_use.get(vid) == position and vid not in requested and vid not in read_only
                        and reads.count(vid) == 1 and kernel.can_overwrite(pos)):
                    candidates += ((pos, vid),)
        movable = _NONE
        if node.captures:
            movable = frozenset(vid for vid in node.captures if vid in dying and reads.count(vid) == 1)
        unused = ()
        for vid in node.outputs:
            if vid not in last_use and vid != MISSING and vid not in requested:
                unused += (vid,)
        kwargs = dict(node.attrs)
        if consumes:
            kwargs["overwrite"] = ()  # the executor grants positions per run
        if kernel.wants_output_count:
            kwargs["output_count"] = len(node.outputs)
        steps.append(Step(node, node.inputs, node.outputs, candidates, movable, released + unused, kernel.fn,
                          kwargs, kernel.wants_ctx, len(node.outputs) == 1 and node.outputs[0] != MISSING))
    constants = tuple(sorted(v for v in fixed if (v in last_use or v in requested) and v not in provided))
    values, keys = [None] * (len(graph.names) + 1), [()] * (len(graph.names) + 1)
    for vid in constants:
        values[vid] = fixed[vid]
        keys[vid] = storage_keys(values[vid])
    return Plan(
        steps=tuple(steps),
        inputs=tuple(sorted(v for v in provided if v in last_use or v in requested)),
        constants=constants,
        outputs=tuple(outputs),
        unused_inputs=tuple(sorted(v for v in provided if v not in last_use and v not in requested)),
        values_template=tuple(values),
        keys_template=tuple(keys),
    )


def _data_reads(node: Node, shape_only) -> set:
    """The values `node` reads for their data: those at a position not in `shape_only`, and its
    captures (`Node.reads_shape_only` for all reads at once)."""
    data = {vid for position, vid in enumerate(node.inputs) if vid != MISSING and position not in shape_only}
    data.update(node.captures)
    return data
