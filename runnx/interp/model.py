"""Model: a loaded graph plus its plan cache; `run` validates feeds, plans, executes."""
from __future__ import annotations

import gc
import os
import sys
import threading
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from runnx.errors import UnknownOutputError
from runnx.interp.branches import specialize_branches
from runnx.interp.context import RunContext
from runnx.interp.dtypes import type_name
from runnx.interp.executor import Executor
from runnx.interp.float16 import widen_float16
from runnx.interp.folding import fold_constants
from runnx.interp.fusion import fuse, quantizes_computed_values, rewrite
from runnx.interp.fusion.split_products import rejoined
from runnx.interp.ir import MISSING
from runnx.interp.last_position import keep_last_position
from runnx.interp.model_file import settle_held, settles_held
from runnx.interp.quiet import BUSY
from runnx.interp.options import Options
from runnx.interp.planner import Plan, make_plan
from runnx.interp.profiler import Profile
from runnx.interp.shape_cache import memoize_shapes, topological
from runnx.interp.validation import bind_feeds, feed_specs
from runnx.ops.registry import COMPUTED
from runnx.runtime import arena, keep_freed_if_asked, set_threads, sleep_after_calls, threads

if TYPE_CHECKING:
    from runnx.interp.loader import LoadedModel


class Model:
    def __init__(self, loaded: LoadedModel, options: Options | None = None):
        self.loaded = loaded
        self.graph = loaded.graph
        self.options = (options or Options()).effective()  # the switches its optimization level allows
        if self.options.arena:
            arena.prepare()  # (on a thread of its own: runs before it is ready allocate as numpy does)
        self.widened = widen_float16(self.graph)  # float16 arithmetic in float32 at every level: float16.py
        self.folded = fold_constants(self.graph, self.options) if self.options.fold_constants else 0
        settle_held()  # the weights' huge pages, once the fold's copies of them are made (model_file.py)
        # after folding (a head's weight may be a Transpose of the embedding, or read by If branches)
        self.last_position = keep_last_position(self.graph, self.options.last_position)
        self._unrewritten = replace(self.graph)  # for plans requesting values a rewrite removed
        # a quantizer anywhere may read what any graph computes (a branch's captures): all fuse bitwise
        self.fuses_bitwise = self.options.fuse and any(quantizes_computed_values(g) for g in _graphs(self.graph))
        self.rewritten = {}  # standard-op rewrites for the fusion patterns, before the memos hide shapes
        for graph in _graphs(self.graph) if self.options.fuse else ():
            for name, count in rewrite(graph, bitwise=self.fuses_bitwise).items():
                self.rewritten[name] = self.rewritten.get(name, 0) + count
        # All these rewrites apply to subgraphs too (an Optimum merged decoder's branches). A memo node
        # reads its roots for their shapes only, so it never holds back an in-place KV append.
        self.memoized = sum(memoize_shapes(graph) for graph in _graphs(self.graph)) if self.options.shape_cache else 0
        self.fused = {}
        for graph in _graphs(self.graph) if self.options.fuse else ():
            for op, count in fuse(graph, bitwise=self.fuses_bitwise).items():
                self.fused[op] = self.fused.get(op, 0) + count
        if self.fused and self.options.shape_cache:  # fused shape stand-ins join the memos around them
            self.memoized += sum(memoize_shapes(graph) for graph in _graphs(self.graph))
        set_threads(self.options.threads)
        self._threads = None  # counts in effect, looked up when first profiled
        self.opsets = dict(loaded.opsets)
        self.path = loaded.path
        self._specs = feed_specs(self.graph)
        # after the rewrites, whose nodes the branch graphs share
        self._branches = specialize_branches(self.graph) if self.options.specialize_branches else None
        self._output_ids = {self.graph.names[v]: v for v in self.graph.outputs}
        self._plans: dict[tuple, Plan] = {}
        self._executor = Executor()
        # the numba kernels its runs load, for a later process to load ahead
        from runnx.ops.kernel_loads import Recorder, record_path  # (numba: not at `import runnx`)
        self._kernel_loads = Recorder(record_path(self.path) if self.path else None)

    @property
    def input_names(self) -> list[str]:
        return [self.graph.names[v] for v in self.graph.inputs]

    @property
    def output_names(self) -> list[str]:
        return [self.graph.names[v] for v in self.graph.outputs]

    @property
    def inputs(self):
        return list(self.graph.input_info)

    @property
    def outputs(self):
        return list(self.graph.output_info)

    def _output_vids(self, outputs) -> tuple[int, ...]:
        if outputs is None:
            return tuple(self.graph.outputs)
        if isinstance(outputs, str):
            outputs = [outputs]
        vids = []
        for name in outputs:
            vid = self._output_ids.get(name)
            if vid is None:
                vid = self.graph.ids.get(name)  # intermediate values may be requested too
                if vid is None:
                    raise UnknownOutputError(f"'{name}' is not a value of the model (outputs: "
                                             f"{', '.join(self.output_names)})")
            vids.append(vid)
        return tuple(vids)

    def _plan_for(self, provided: frozenset, outputs: tuple[int, ...], branch=None) -> Plan:
        key = (provided, outputs, branch)
        plan = self._plans.get(key)
        if plan is None:
            graph = self.graph if branch is None else branch.graph
            if branch is None and any(v not in graph.producer and v not in graph.constants and v not in provided
                                      and v not in graph.defaults for v in outputs):
                graph = self._unrewritten_graph()
            plan = self._plans[key] = make_plan(graph, provided, outputs)
        return plan

    def _unrewritten_graph(self):
        """The graph before the rewrites, its weights a rewrite moved (`Graph.moved`) rebuilt, once."""
        if self.graph.moved and self._unrewritten.constants is self.graph.constants:
            self._unrewritten = replace(self._unrewritten, constants=rejoined(self.graph))
        return self._unrewritten

    def plan(self, outputs=None, inputs=None) -> list:
        """The nodes that run, in order, to compute `outputs` from `inputs` (default: all of both)."""
        return self._plan_of(outputs, inputs).nodes

    def _plan_of(self, outputs=None, inputs=None) -> Plan:
        names = self.input_names if inputs is None else list(inputs)
        return self._plan_for(frozenset(self._specs[n].vid for n in names), self._output_vids(outputs))

    def run(self, feeds, outputs=None, *, profile=False):
        """Run the model. `feeds` maps input names to arrays (or `runnx.Owned(array)` to hand a buffer
        over for in-place use). Returns {output name: array}; with profile=True, (outputs, Profile);
        with profile=<Profile>, adds to that profile and returns the outputs."""
        bound = bind_feeds(self._specs, feeds, self.options.check_symbolic_dims)
        output_vids = self._output_vids(outputs)
        branch = self._branches.pick(bound, output_vids) if self._branches is not None else None
        graph, run_vids = self.graph, output_vids
        if branch is not None:  # the model's value ids -> the branch graph's
            ids = branch.ids
            graph, run_vids = branch.graph, tuple(ids[v] for v in output_vids)
            bound = {ids[v]: fed for v, fed in bound.items()}
        plan = self._plan_for(frozenset(bound), run_vids, branch)
        for vid in plan.unused_inputs:
            bound.pop(vid, None)
        record = profile if isinstance(profile, Profile) else (Profile() if profile or self.options.profile else None)
        if record is not None:
            self._threads = self._threads or threads()
            record.threads = self._threads
        ctx = RunContext(self.options, record)
        with BUSY, self._kernel_loads.running(), arena.kept() if self.options.arena else nullcontext():
            values, _ = self._executor.run(graph, plan, bound, ctx, owned=False)  # (an unrewritten graph shares ids)
        names = [self.graph.names[v] for v in output_vids]
        result = {}
        for name, value in zip(names, values):
            if isinstance(value, np.ndarray) and not value.flags.writeable:
                value = value.copy()  # never hand out a view of a constant or of a caller's array
            elif type(value) is list:  # nor in a sequence
                value = [v.copy() if isinstance(v, np.ndarray) and not v.flags.writeable else v for v in value]
            result[name] = value
        if record is not None:
            record.runs += 1
            if self.options.profile and profile is False:
                print(record.summary(), file=sys.stderr)
        if profile is True:
            return result, record
        return result

    def recording_loads(self):
        """A context in which the calling thread's loads of compiled kernels count as this model's,
        loaded ahead when a later process loads its file (ops/kernel_loads.py): a generation loop's
        own kernels around its runs (its cache's), which `run` alone does not cover."""
        return self._kernel_loads.running()

    def plan_ahead(self, outputs=None) -> None:
        """Make now the plan a run feeding every input and asking for `outputs` will use, and compile
        it with its shape memos' programs (`Executor.compile_now`), as onnxruntime's session creation
        plans before a first run: for a model that will run many times (a decoder's, whose first
        prompt paid 9-15 ms for the plan and 8-9 ms for the memos' programs otherwise). Nothing for a
        model whose runs pick a branch (each branch is planned on its first run)."""
        if self._branches is None:
            Executor.compile_now(self.graph, self._plan_of(outputs), self.options)

    def prepack_in_background(self) -> threading.Thread | None:
        """Make on a thread of its own, node by node in the graph's order, what kernels declaring
        `prepack` would make from their constant inputs on their first call (a 4-bit weight's
        tiles, an 8-bit weight's VNNI tiles: `ops/registry.py`), as onnxruntime prepacks weights
        when a session is created. Each is kept as the call would keep it, so the model's first
        few-row run finds the nodes before it ahead of it made; a node that run reaches first makes
        its own, once (`Remembered`). The generation API starts it for a decoder, whose every step
        takes those paths; a model run only with long inputs would keep tiles it never reads. The
        thread (returned, None when no node has anything to make) ends when all are made; what a
        prepack raises is dropped (the node's run raises it). Returns once the thread has planned
        its work (the Python part, a few milliseconds): the native part that follows needs no GIL,
        so a caller holding the GIL next for long (a tokenizer loading, 90 ms) does not stall it."""
        work = [(node.kernel.prepack, tuple(None if v == MISSING else graph.constants.get(v, COMPUTED)
                                            for v in node.inputs), node.kernel.attributes_of(node.attrs))
                for graph in _graphs(self.graph) for node in topological(graph)
                if node.kernel is not None and node.kernel.prepack is not None]
        if not work:
            return None
        # not a daemon: a process ending while numba loads a kernel for it aborts inside LLVM
        planned = threading.Event()
        thread = threading.Thread(target=_prepack, args=(work, planned), name="runnx-prepack")
        thread.start()
        while not planned.wait(0.01) and thread.is_alive():
            pass
        return thread

    def describe_io(self):
        return ([(i.name, type_name(i.elem_type or 0), i.shape) for i in self.inputs],
                [(o.name, type_name(o.elem_type or 0), o.shape) for o in self.outputs])


def _prepack(work: list, planned: threading.Event) -> None:
    """Each node's prepack in the graph's order, and the pending work they return planned by kind
    (`ops/registry.py`); then `planned` is set, and each kind's work made, in order (busy throughout:
    weights settling into huge pages wait for it)."""
    with BUSY:
        _prepack_busy(work, planned)


def _prepack_busy(work: list, planned: threading.Event) -> None:
    makes = []
    try:
        pending: dict = {}
        for prepack, inputs, attrs in work:
            try:
                made = prepack(inputs, attrs)
            except Exception:  # noqa: BLE001 (the node's own run raises it, with its name)
                continue
            for one in made if isinstance(made, list) else () if made is None else (made,):
                pending.setdefault(one.batch, []).append(one)
        for batch, items in pending.items():
            try:
                makes.append(batch(items))
            except Exception:  # noqa: BLE001 (what is not made, a run makes, or raises about)
                pass
    finally:
        planned.set()
    for make in makes:
        try:
            make()
        except Exception:  # noqa: BLE001 (as above)
            pass


def _graphs(graph):
    """The graph and every subgraph nested in it."""
    yield graph
    for node in graph.nodes:
        for sub in node.subgraphs.values():
            for subgraph in (sub if isinstance(sub, list) else [sub]):
                yield from _graphs(subgraph)


def load(source, *, weights=None, options: Options | None = None, **option_values) -> Model:
    """Load an ONNX model from a path, bytes or onnx.ModelProto. `weights=` a .safetensors file
    whose tensors supply or override initializers by name (memory-mapped). Keyword options
    (inplace=False, check_inplace=True, max_tensor_elements=...) build an Options."""
    if option_values:
        options = Options(**option_values) if options is None else _replace(options, option_values)
    options = options or Options()
    # RUNNX_KEEP_FREED=1: glibc keeps the runs' freed temporaries mapped (runtime/allocator.py), asked
    # before the threads below first allocate (each would keep an arena of its own)
    keep_freed_if_asked()
    ahead = None
    if isinstance(source, (str, os.PathLike)):  # the kernels its runs loaded before, while it loads
        from runnx.ops.kernel_loads import load_in_background, record_path  # (imports numba)
        ahead = load_in_background(record_path(source))
    from runnx.interp.loader import load_model  # imports onnx (seconds: it imports ml_dtypes)
    sleep_after_calls()  # OpenBLAS's threads, when numpy loaded it before runnx (runtime/openblas.py)
    with _collection_paused(), settles_held(), BUSY:  # (the weights settle once it has been quiet a while)
        model = Model(load_model(source, weights, options.allow_newer_opset), options)
    model._kernel_loads.ahead = ahead  # (its first run waits for them)
    return model


@contextmanager
def _collection_paused():
    """Python's cyclic garbage collector off while a model loads, as it was after: a load makes tens
    of thousands of objects that live as long as the model (nodes, attributes, kernels), and each of
    the few full collections their count set off went through every object of the process (about
    50 ms each for a 135M-parameter decoder, 0.2 s of its load); what cycles a load drops, the first
    collection after it finds. Off already (the caller's choice, or another thread's load): left as it is."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _replace(options: Options, values: dict) -> Options:
    return replace(options, **values)
