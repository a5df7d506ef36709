"""Execution of a plan: values move through a flat list indexed by value id.

Per step: gather inputs, grant in-place reuse of inputs that die here and whose storage is owned
and unaliased, move dying owned captures into the subgraph's CaptureEnv, call the kernel, register
the outputs' storage (a view inherits its input's ownership; a fresh writeable array is owned),
release dead values. There are no op-specific branches here: the registry declares everything.
"""
from __future__ import annotations

import sys
import time

import numpy as np

from runnx.capture.env import CaptureEnv, Subgraph
from runnx.capture.ownership import StorageTable, may_write, storage_keys
from runnx.errors import InPlaceMismatchError
from runnx.interp.compiled import bound_outputs, compile_plan
from runnx.interp.node_context import describe_value, node_error
from runnx.interp.ir import MISSING, Graph
from runnx.interp.planner import Plan, make_plan
from runnx.runtime import drop_deferred, opening, settle


def _same(a, b) -> bool:
    """Bitwise equality (NaNs included, for every dtype incl. ml_dtypes'), elementwise for objects."""
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        if a.dtype == object:
            return bool(np.array_equal(a, b))
        return np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes()
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a is b or (a is None and b is None)


def _snapshot(value):
    if isinstance(value, np.ndarray):
        return value.copy()
    if isinstance(value, list):
        return [_snapshot(v) for v in value]
    return value


class Executor:
    """Runs plans of one model; per-run state lives in locals, so one Executor serves many threads."""

    def run_subgraph(self, graph: Graph, env: CaptureEnv, inputs: list, owned, ctx) -> tuple[list, list]:
        """Run a subgraph (If branch, loop body) with its formal inputs and captures from `env`."""
        count = len(inputs)
        plans = graph.__dict__.setdefault("_plans", {})
        plan = plans.get(count)
        if plan is None:
            provided = frozenset(graph.inputs[:count]) | frozenset(graph.capture_ids)
            plan = plans[count] = make_plan(graph, provided, graph.outputs)
        owned = owned if owned is not None else [False] * count
        needed = set(plan.inputs)
        bound = {}
        for vid, value, is_owned in zip(graph.inputs, inputs, owned):
            if vid in needed:
                bound[vid] = (value, is_owned)
        for name, vid in zip(graph.captures, graph.capture_ids):
            if vid in needed:
                bound[vid] = env.take(name)
        return self.run(graph, plan, bound, ctx)

    def run(self, graph: Graph, plan: Plan, bound: dict, ctx, owned: bool = True) -> tuple[list, list | None]:
        """Execute `plan`; `bound` maps value id -> (value, owned). Returns outputs and their owned
        flags (None with owned=False: a model's run hands none over)."""
        profile = ctx.profile
        options = ctx.options
        inplace_on = options.inplace
        checking = options.check_inplace
        trace = options.trace
        instrumented = profile is not None or checking or trace
        table = StorageTable(track_bytes=profile is not None)
        hold, hold_array, drop = table.hold, table.hold_array, table.drop
        # the common case runs compiled (interp/compiled.py); the loop below serves first runs,
        # instrumented runs and plans holding subgraph nodes
        if not instrumented and inplace_on and (compiled := self._compiled(graph, plan, options)) is not None:
            values, keys = {}, {}
            self._hold_bound(bound, values, keys, hold)
            try:
                outputs, output_keys = compiled(values, keys, table, ctx)
            except BaseException:
                drop_deferred()  # (they would write only what the failed run discards)
                raise
            finally:  # (what the last steps deferred or left open; the leave a failing step was given)
                settle()
                opening.allowed = False
            return outputs, [table.is_owned(k) for k in output_keys] if owned else None
        values = list(plan.values_template)  # constants in place; values[MISSING], the last slot, stays None
        keys = list(plan.keys_template)
        if profile is not None:  # constants are read-only (never owned, nor their views): held only to count bytes
            for vid in plan.constants:
                hold(keys[vid], False, values[vid])
        self._hold_bound(bound, values, keys, hold)
        for step in plan.steps:
            node = step.node
            args = [values[v] for v in step.inputs]
            kwargs = step.kwargs
            granted = ()
            if step.candidates and inplace_on:
                for position, vid in step.candidates:
                    if may_write(table, keys[vid], ctx):
                        granted += (position,)
                if granted:
                    kwargs = {**kwargs, "overwrite": granted}
            if node.subgraphs:
                kwargs = self._bind_subgraphs(graph, node, step, kwargs, values, keys, table, inplace_on, ctx)
            if step.wants_ctx:
                kwargs = {**kwargs, "ctx": ctx}
            start = time.perf_counter() if profile is not None else 0.0
            try:
                reference = None
                if checking and granted and not node.subgraphs:
                    reference = _out_of_place(step.fn, args, kwargs)
                result = step.fn(*args, **kwargs)
                if reference is not None:
                    _compare(node, reference, result)
            except Exception as error:
                wrapped = node_error(graph, node, args, error)
                if wrapped is error:
                    raise
                raise wrapped from error
            if step.single and type(result) is np.ndarray:  # `_bind_outputs`' common case
                vid = step.outputs[0]
                values[vid] = result
                for position, dying in step.candidates:
                    if result is args[position]:  # a dying input itself: the output takes over its hold
                        keys[vid], keys[dying] = keys[dying], ()  # (it may live on, for its shape only)
                        break
                else:
                    keys[vid] = hold_array(result)
            else:
                self._bind_outputs(node, step, result, values, keys, hold)
            if instrumented:
                self._instrument(graph, node, step, args, granted, start, values, profile, trace)
            for vid in step.releases:
                drop(keys[vid])
                values[vid] = None
                keys[vid] = ()
        if profile is not None and table.peak_bytes > profile.peak_live_bytes:
            profile.peak_live_bytes = table.peak_bytes
        return [values[v] for v in plan.outputs], [table.is_owned(keys[v]) for v in plan.outputs] if owned else None

    @staticmethod
    def _hold_bound(bound: dict, values, keys, hold) -> None:
        """Place the provided values; a caller's array is owned only when handed over (and writeable)."""
        for vid, (value, is_owned) in bound.items():
            values[vid] = value
            keys[vid] = k = storage_keys(value)
            hold(k, bool(is_owned) and getattr(getattr(value, "flags", None), "writeable", True), value)

    @staticmethod
    def _compiled(graph: Graph, plan: Plan, options):
        """The plan's compiled function once it has run `options.compile_after` times, else None."""
        state = plan.state
        compiled = state.get("compiled")
        if compiled is None:
            if not options.compile_after:
                return None
            runs = state["runs"] = state.get("runs", 0) + 1
            if runs < options.compile_after:
                return None
            compiled = Executor.compile_now(graph, plan, options)
        return compiled or None

    @staticmethod
    def compile_now(graph: Graph, plan: Plan, options):
        """Compile `plan` now (False: it cannot be), as its `compile_after`-th run would, and make
        its shape memos' programs: a plan that will run many times (a decoder's) pays for its code
        where it loads, not in its first runs. Nothing (None) when the options compile no plan or
        keep every run interpreted (out of place, profiled, traced, checked)."""
        if (not options.compile_after or not options.inplace or options.check_inplace or options.trace
                or options.profile):
            return None
        for step in plan.steps:
            make_programs = getattr(getattr(step.node.kernel, "fn", None), "make_programs", None)  # a ShapeGroup's
            if make_programs is not None:
                make_programs()
        compiled = plan.state.get("compiled")
        if compiled is None:
            compiled = plan.state["compiled"] = compile_plan(graph, plan, options.overlap_jobs) or False
        return compiled

    @staticmethod
    def _instrument(graph, node, step, args, granted, start, values, profile, trace) -> None:
        """Profile counters and the trace line of one step."""
        if profile is not None:
            op = node.op_type
            profile.op_time[op] += time.perf_counter() - start
            profile.op_calls[op] += 1
            written = {key for p in granted for key in storage_keys(args[p])}
            if written and any(not written.isdisjoint(storage_keys(values[v])) for v in step.outputs if v != MISSING):
                profile.inplace[op] += 1
        if trace:
            shapes = [describe_value(graph.names[v], values[v]) for v in step.outputs if v != MISSING]
            print(f"runnx trace: {node.describe()} -> {', '.join(shapes)}"
                  f"{' (in place)' if granted else ''}", file=sys.stderr)

    @staticmethod
    def _bind_outputs(node, step, result, values, keys, hold) -> None:
        for vid, (value, k) in zip(step.outputs, bound_outputs(node, len(step.outputs), result)):
            if vid != MISSING:
                values[vid] = value
                keys[vid] = k
                hold(k, None, value)

    def _bind_subgraphs(self, graph, node, step, attrs, values, keys, table, inplace_on, ctx) -> dict:
        """Build the node's CaptureEnv (moving dying owned captures) and bind each subgraph to it."""
        captured, owned = {}, {}
        for vid in node.captures:
            name = graph.names[vid]
            captured[name] = values[vid]
            if inplace_on and vid in step.movable and table.exclusive(keys[vid]):
                owned[name] = True
                table.drop(keys[vid])  # moved: the parent no longer holds it
                values[vid] = None
                keys[vid] = ()
                if ctx.profile is not None:
                    ctx.profile.moves += 1
        env = CaptureEnv(captured, owned)
        bound = dict(attrs)

        def runner(sub_graph, sub_env, inputs, owned_flags):
            return self.run_subgraph(sub_graph, sub_env, inputs, owned_flags, ctx)

        for attr_name, sub in node.subgraphs.items():
            if isinstance(sub, list):
                bound[attr_name] = [Subgraph(g, env, runner) for g in sub]
            else:
                bound[attr_name] = Subgraph(sub, env, runner)
        return bound


def _out_of_place(fn, args, kwargs) -> list:
    """Checking mode: the node's outputs computed without reusing any input, snapshotted."""
    reference = fn(*args, **{**kwargs, "overwrite": ()})
    return [_snapshot(v) for v in (reference if type(reference) is tuple else (reference,))]


def _compare(node, reference: list, result) -> None:
    result = result if type(result) is tuple else (result,)
    for index, (expected, got) in enumerate(zip(reference, result)):
        if not _same(expected, got):
            raise InPlaceMismatchError(f"{node.describe()}: output {index} differs when computed in place")
