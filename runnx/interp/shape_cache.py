"""Shape-computation caching: bookkeeping that depends only on tensor shapes runs once per shape.

Exporters compute reshape targets, masks and positions with chains of Shape/Gather/Unsqueeze/
Concat/... nodes: in an exported decoder most of the nodes of a step. A value is
*shape-derived* when it is the output of Shape/Size, or of a deterministic node whose inputs are all
shape-derived or constants: it is then a function of the shapes that its Shape/Size nodes read (its
*roots*) and never of any tensor's contents.

Fused nodes count when their kernel declares the inputs it reads only for their shape (a memo node
itself, a shape stand-in such as RepeatedKVShape) and their other inputs are shape-derived: the
model memoizes again after fusion, so that a stand-in and the memos around it become one.

Shape-derived nodes with the same set of roots become one memo node (a lone node only when
another group reads it: `_feeding_other_groups`). Grouping by root set keeps
each group convex (a path leaving a group and re-entering it would have to read the shape of a
value computed from the group, which gives that node a larger root set), so the rewritten graph
has no cycles. The memo node reads the roots (for their shapes) and the shape-derived values of
other groups (by value), and keeps a few recent results, read-only, keyed by exactly those. A key
seen before returns the same arrays without running a node; a new key runs the group's nodes.
"""
from __future__ import annotations

import numpy as np

from runnx.capture.ownership import storage_root
from runnx.interp.codegen import Program
from runnx.interp.folding import NONDETERMINISTIC, out_of_place_kwargs
from runnx.interp.ir import MISSING, Graph, Node
from runnx.interp.read_ahead import AheadState, read_ahead, value_key
from runnx.ops._remembered import Remembered
from runnx.ops.registry import Kernel

SHAPE_READERS = frozenset({"Shape", "Size"})
# per group (shared by groups computing the same): a decode step's past length is a new key, seen
# again by the next generation or window from the same prompt length on; oldest dropped first
KEPT_RESULTS = 1024
KEPT_BYTES = 1 << 20  # of kept arrays and of the external values in their keys
MEMO_OP = "ShapeMemo"
MEMO_DOMAIN = "runnx.fused"


def topological(graph: Graph) -> list[Node]:
    """The graph's nodes in a dependency order (they may be stored out of order)."""
    order, state = [], {}
    for root in graph.nodes:
        if root.index in state:
            continue
        stack = [(root, iter([v for v in root.inputs if v != MISSING] + list(root.captures)))]
        state[root.index] = 1
        while stack:
            node, reads = stack[-1]
            for vid in reads:
                dep = graph.producer.get(vid)
                if dep is not None and dep.index not in state:
                    state[dep.index] = 1
                    stack.append((dep, iter([v for v in dep.inputs if v != MISSING] + list(dep.captures))))
                    break
            else:
                order.append(node)
                stack.pop()
    return order


def _roots(graph: Graph, order: list[Node]) -> dict[int, frozenset]:
    """Shape-derived value id -> the value ids whose shapes it depends on."""
    roots: dict[int, frozenset] = {}
    for node in order:
        kernel = node.kernel
        if (kernel is None or node.subgraphs or node.captures or node.op_type in NONDETERMINISTIC
                or (node.domain != "" and not kernel.shape_only)):  # fused: memos, shape stand-ins
            continue
        reads = [v for v in node.inputs if v != MISSING]
        if node.op_type in SHAPE_READERS and len(reads) == 1:
            found = roots.get(reads[0], frozenset(reads))
        elif kernel.shape_only and node.domain != "":  # the shapes of some inputs, the values of the others
            shaped = {node.inputs[p] for p in kernel.shape_only if p < len(node.inputs)} - {MISSING}
            shaped -= graph.constants.keys()  # a constant's shape is the group's own, not a key
            others = [v for v in reads if v not in shaped]
            if not shaped or not all(v in roots or v in graph.constants for v in others):
                continue
            found = frozenset().union(*(roots.get(v, frozenset((v,))) for v in shaped),
                                      *(roots.get(v, ()) for v in others))
        elif reads and all(v in roots or v in graph.constants for v in reads):
            found = frozenset().union(*(roots.get(v, ()) for v in reads))
        else:
            continue
        if found:
            for vid in node.outputs:
                if vid != MISSING:
                    roots[vid] = found
    return roots


def memoize_shapes(graph: Graph) -> int:
    """Replace the shape-derived nodes of `graph` (top level) by memo nodes; returns how many
    nodes were replaced."""
    order = topological(graph)
    roots = _roots(graph, order)
    groups: dict[frozenset, list[Node]] = {}
    for node in order:
        outputs = [v for v in node.outputs if v != MISSING]
        if outputs and outputs[0] in roots:
            groups.setdefault(roots[outputs[0]], []).append(node)
    readers: dict[int, set] = {}
    for node in graph.nodes:
        for vid in list(node.inputs) + list(node.captures):
            readers.setdefault(vid, set()).add(node.index)
    replaced, memos, shared = set(), [], {}
    feeding = _feeding_other_groups(groups, readers)
    for root_set, members in groups.items():
        if len(members) < 2 and members[0].index not in feeding:
            continue
        inside = {n.index for n in members}
        produced = {v for n in members for v in n.outputs if v != MISSING}
        external = sorted({v for n in members for v in n.inputs
                           if v != MISSING and v not in produced and v not in graph.constants
                           and v not in root_set})
        outputs = tuple(v for n in members for v in n.outputs
                        if v != MISSING and (v in graph.outputs or readers.get(v, set()) - inside))
        if not outputs:
            continue
        group = ShapeGroup(graph, members, tuple(sorted(root_set)), tuple(external), outputs)
        # kept results, and what identities found them, for every group computing the same
        group.results, group._by_identity = shared.setdefault(_structure(group), (group.results, group._by_identity))
        kernel = Kernel(MEMO_OP, MEMO_DOMAIN, 1, group, (), None, {}, (), True, False, (0, None),
                        shape_only=tuple(range(len(group.roots))))
        memo = Node(min(inside), f"{MEMO_OP}({members[0].name}, {len(members)} nodes)", MEMO_OP, MEMO_DOMAIN,
                    group.roots + group.external, outputs, {}, {}, (), kernel, 1)
        memos.append(memo)
        replaced |= inside
    if not memos:
        return 0
    graph.nodes = tuple(n for n in graph.nodes if n.index not in replaced) + tuple(memos)
    graph.producer = {vid: node for node in graph.nodes for vid in node.outputs if vid != MISSING}
    return len(replaced)


def _feeding_other_groups(groups: dict, readers: dict) -> set:
    """Indices of nodes whose outputs another group's members read. A lone shape-derived node is
    not worth a memo of its own (its kernel costs about what a lookup does), unless another group
    reads it: that group then gets a memo's output, kept read-only and known by identity, which it
    can read ahead (a decoder's position bookkeeping, a few nodes reading two such values, would
    otherwise compute at every step, cold)."""
    group_of = {node.index: key for key, members in groups.items() for node in members}
    return {node.index for key, members in groups.items() for node in members
            if any(group_of.get(reader) not in (None, key) for vid in node.outputs if vid != MISSING
                   for reader in readers.get(vid, ()))}


def _structure(group) -> tuple:
    """What the group computes, independent of value names: groups with equal structure compute
    the same function of their inputs (e.g. the same bookkeeping in every layer) and share their
    kept results, and what their externals' identities found (a layer's memo then finds by identity
    what the first layer's read ahead, where it would hash bytes once a layer a step in a first
    window)."""
    slots = {v: ("in", i) for i, v in enumerate(group.roots + group.external)}
    parts = []
    for index, node in enumerate(group.members):
        shaped = node.kernel.shape_only if node.domain != "" else ()
        reads = tuple(("none",) if v == MISSING else slots[v] if v in slots
                      else _shape_key(group.graph.constants[v]) if position in shaped
                      else _constant_key(group.graph.constants[v]) for position, v in enumerate(node.inputs))
        attrs = tuple(sorted((name, _constant_key(value) if isinstance(value, np.ndarray) else value)
                             for name, value in node.attrs.items()))
        if isinstance(node.kernel.fn, ShapeGroup):  # a memo of the first pass: what it computes
            attrs += (("memo", _structure(node.kernel.fn)),)
        parts.append((node.domain, node.op_type, node.since, reads, attrs))
        for output, vid in enumerate(node.outputs):
            if vid != MISSING:
                slots[vid] = ("node", index, output)
    return tuple(parts), tuple(slots[v] for v in group.outputs)


def _shape_key(value: np.ndarray) -> tuple:
    """A constant read only for its shape and dtype (a shape stand-in's weight): any of that shape
    and dtype gives the same result."""
    return "shaped", value.dtype, value.shape


def _constant_key(value: np.ndarray):
    if value.nbytes <= 4096 and value.dtype.kind != "O":
        return value.dtype, value.shape, value.tobytes()  # the dtype itself: ml_dtypes' float8s share a str
    return "object", id(value)  # large constants are only shared by the very same array


class KeptResults(dict):
    """A memo's results by key, at most KEPT_RESULTS of them and KEPT_BYTES in all."""

    def __init__(self):
        super().__init__()
        self.nbytes = 0

    def keep(self, key: tuple, result: tuple, size: int) -> None:
        """Keep `result` (`size` bytes with its key's values: `_nbytes`), dropping the oldest beyond
        the bounds."""
        if size > KEPT_BYTES:
            return
        try:
            while self and (len(self) >= KEPT_RESULTS or self.nbytes + size > KEPT_BYTES):
                oldest = next(iter(self))
                self.nbytes -= _nbytes(oldest, self.pop(oldest))
        except (RuntimeError, StopIteration, KeyError):  # another thread changed it meanwhile: keep going
            pass
        self[key] = result
        self.nbytes += size


def _nbytes(key: tuple, result: tuple) -> int:
    """The bytes of a kept result's arrays and of the external values in its key (`value_key`'s)."""
    size = 0
    for value in result:
        size += value.nbytes
    for part in key:
        if type(part) is tuple and len(part) == 3 and type(part[2]) is bytes:
            size += len(part[2])
    return size


class ShapeGroup:
    """The nodes of one memo node and its recent results; called as the memo node's kernel."""

    __slots__ = ("graph", "members", "roots", "external", "outputs", "results", "_by_identity", "_program",
                 "ahead", "__name__", "__weakref__")

    def __init__(self, graph, members, roots, external, outputs):
        self.graph = graph
        self.members = members  # in dependency order
        self.roots = roots
        self.external = external
        self.outputs = outputs
        self.results = KeptResults()
        # hashing an external's bytes costs more than the lookup saves: the same read-only arrays
        # as before give the same result
        self._by_identity = Remembered()
        self._program = None
        self.ahead = AheadState()
        self.__name__ = MEMO_OP

    def __call__(self, *args, ctx):
        count = len(self.roots)
        key = tuple([getattr(a, "shape", None) for a in args[:count]])
        if len(args) > count:
            if ctx.profile is None:  # read-only externals (kept results, constants) known by identity
                return self._by_identity.lookup(key, args[count:], lambda shapes, *externals: self._kept(
                    shapes + tuple([value_key(a) for a in externals]), args, ctx))
            key += tuple([value_key(a) for a in args[count:]])
        return self._kept(key, args, ctx)

    def _kept(self, key: tuple, args: tuple, ctx) -> tuple:
        """The kept result for `key`, or the members' computed now (and kept, and read ahead)."""
        try:
            result = self.results.get(key)
        except TypeError:  # an unhashable external (a sequence): compute, do not keep
            return self.compute(args, ctx)
        if result is not None:
            if ctx.profile is not None:
                ctx.count("ShapeMemo.hits")
                ctx.count("ShapeMemo.nodes_skipped", len(self.members))
            return result
        ctx.count("ShapeMemo.misses")
        result = self.compute(args, ctx)
        if self.keep(key, result) and ctx.options.memo_read_ahead:
            read_ahead(self, key, result, args, ctx)
        return result

    def known_by_identity(self, key: tuple):
        """The result kept for `key` ((the roots' shapes), *the externals' ids) by identity, or None
        (compiled plans look it up inline before calling the memo)."""
        return self._by_identity.known_result(key)

    def found_lines(self, program, index: int, inputs: list[str], call: str) -> list[str]:
        """Lines of generated code (compiled.py) setting `r` to this memo's result for `inputs` (the
        memo node's input locals) as `__call__` finds it outside profiles, inline, `call` called
        when it is not found: by its roots' shapes (`results`), or by those and its externals'
        identity (`known_by_identity`). A compiled plan never runs profiled; a hit costs no call."""
        count = len(self.roots)
        shapes = "".join(f"{name}.shape, " for name in inputs[:count])
        if self.external:
            find = program.set(f"m{index}", self.known_by_identity)
            lookup = f"r = {find}((({shapes}){''.join(f', id({name})' for name in inputs[count:])}))"
        else:
            find = program.set(f"m{index}", self.results.get)
            lookup = f"r = {find}(({shapes}))"
        return ["try:", f"    {lookup}", "except AttributeError:", "    r = None", "if r is None:", f"    r = {call}"]

    def know(self, shapes: tuple, externals: tuple, result: tuple) -> None:
        """Remember `result` for roots of these shapes and these read-only externals by identity, as
        a call would after finding it by their values (read-ahead: a future step's externals are
        the results other memos read ahead, handed out then as the same arrays)."""
        self._by_identity.lookup(shapes, externals, lambda *_: result)

    def keep(self, key: tuple, result: tuple) -> bool:
        """Keep `result` for `key` when it can be handed out again: arrays only, a full key."""
        for value in result:
            if type(value) is not np.ndarray:
                return False
        if None in key:
            return False
        self.results.keep(key, result, _nbytes(key, result))
        return True

    def compute(self, args, ctx) -> tuple:
        """Run the members (a new key) out of place, through their program (made once)."""
        program = self._program
        if program is None:
            program = self._program = _group_program(self)
        return tuple([_kept_value(value, args) for value in program(args, ctx)])

    def make_programs(self) -> None:
        """Make the program of this memo and of the memos among its members now, not at their first
        miss (a plan compiled ahead: `Executor.compile_now`)."""
        if self._program is None:
            self._program = _group_program(self)
        for member in self.members:
            if member.kernel is not None and isinstance(member.kernel.fn, ShapeGroup):
                member.kernel.fn.make_programs()


def _group_program(group: ShapeGroup):
    """A function (args, ctx) -> the group's output values: its members as straight-line Python
    (codegen.py, as plans are compiled), values locals and kernels, attribute dicts and constants
    globals. A new key then costs the kernels and little else: looping over the steps, gathering
    each one's inputs into a list and storing its outputs in one cost as much as the kernels (a
    decoder's position group of ~20 nodes), and a decode step's new past length misses in a first
    window, and in every step of a decoder-only LM's generation."""
    graph = group.graph
    names = {MISSING: "None"}
    for position, vid in enumerate(group.roots + group.external):
        names[vid] = f"a{position}"
    program = Program(graph, "a, ctx", f"shape memo {group.members[0].name}",
                      [f"{''.join(names[v] + ', ' for v in group.roots + group.external)}= a"])
    program.set("unpacked", _unpacked)
    for index, node in enumerate(group.members):
        for vid in node.inputs:
            if vid not in names:  # a constant: a global
                names[vid] = program.set(f"c{vid}", graph.constants[vid])
        arguments = [names[v] for v in node.inputs]
        program.node(node, arguments)
        call = program.call(index, node.kernel.fn, out_of_place_kwargs(node), arguments, node.kernel.wants_ctx)
        targets = [f"v{index}_{j}" for j in range(len(node.outputs))]  # an omitted output's is never read
        for vid, target in zip(node.outputs, targets):
            if vid != MISSING:
                names[vid] = target
        program.emit(f"r = {call}")
        if len(targets) == 1:
            program.emit(f"{targets[0]} = r if type(r) is not tuple else unpacked(r, 1)[0]")
        else:
            program.emit(f"{', '.join(targets)}, = unpacked(r, {len(targets)})")
    return program.build(f"({''.join(names[v] + ', ' for v in group.outputs)})")


def _unpacked(result, count: int) -> tuple:
    """A kernel's result as `count` output values: a tuple's first `count` (None for any it lacks),
    or a single value first."""
    values = result if type(result) is tuple else (result,)
    return (values + (None,) * count)[:count]


def _kept_value(value, args: tuple):
    """A member's output as kept (a sequence's arrays each): an array never writeable (kept results
    are handed out again), copied if it shares storage with an argument (an Identity or Reshape of
    an external), so that kept results never alias a graph value and a compiled plan need not count
    their storage (compiled.py). An array owning its memory shares it with none but itself; a view shares its
    root's (the object the ownership counts know storage by), found without numpy's overlap test
    (np.may_share_memory, a cost on every argument of every miss)."""
    if type(value) is not np.ndarray:
        if type(value) is list:  # a sequence: its arrays as kept (compiled plans do not count them either)
            return [_kept_value(v, args) for v in value]
        if not isinstance(value, (np.ndarray, np.generic)):
            return value
        value = np.asarray(value)
    if value.base is None:
        for a in args:
            if value is a:  # an Identity of an argument
                return _read_only(value.copy())
    else:  # a view: of an argument's storage? (told by its root object, as ownership counts tell it)
        root = storage_root(value)
        for a in args:
            if isinstance(a, np.ndarray) and (a is root or a.base is not None and storage_root(a) is root):
                return _read_only(value.copy())
    return _read_only(value.view()) if value.flags.writeable else value


def _read_only(value: np.ndarray) -> np.ndarray:
    value.flags.writeable = False
    return value
