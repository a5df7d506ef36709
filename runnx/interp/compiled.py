"""Plans compiled to straight-line Python: the executor's hot loop without the loop.

A plan that runs again (Options.compile_after: one-shot runs never pay for code generation) is
turned into one generated function: values are local variables (values whose lifetimes do not
overlap share one), every kernel, attribute dict and constant a global, and each step is the few
lines the interpreted loop would execute for it — gather the inputs, grant in-place reuse of
dying inputs whose storage is owned and held once, call the kernel, count the output's storage,
release dead values. Nothing is decided differently from `Executor.run`'s loop: the ownership
rules are the same, only the per-step indexing, attribute lookups and tuple unpacking go away.
CPython's `compile()` costs microseconds per syntax node, and the compiling run pays it for every
step: the common path of a step is inline, what is rarer (a grant to decide over several storages
or to tell the run's kept values of, an output that is not an ndarray, a step of several outputs,
a failure: found by its line number) calls a shared helper given the step's constants. A
kernel taking its attributes as keyword-only parameters is called through a copy of itself whose
defaults are the node's attributes (`registry.with_attributes`): matching a fused node's 24 keyword
arguments to its parameters cost 3.5 us a call, warm.

Plans with subgraph nodes (If/Loop/Scan bind a CaptureEnv per call) and instrumented runs
(profile, trace, in-place checking) keep the interpreted loop; a subgraph's own plan compiles.
"""
from __future__ import annotations

from bisect import bisect_right

import numpy as np

from runnx.capture.ownership import storage_keys, storage_root
from runnx.errors import NodeError
from runnx.interp.ir import MISSING, Graph
from runnx.interp.node_context import node_error
from runnx.interp.shape_cache import ShapeGroup
from runnx.ops.registry import bound_kernel, inplace_target


def bound_outputs(node, output_count: int, result) -> list:
    """(value, storage keys) for each declared output of `node` from its kernel's `result`."""
    outputs = result if type(result) is tuple else (result,)
    if len(outputs) < output_count:
        declared = node.outputs
        if any(v != MISSING for v in declared[len(outputs):]):
            raise NodeError(f"{node.describe()} produced {len(outputs)} outputs, the node declares {output_count}")
        outputs = outputs + (None,) * (output_count - len(outputs))
    return [bound_output(value) for value in outputs[:output_count]]


def bound_output(value) -> tuple:
    """(value, storage keys) of one kernel output that is not a plain ndarray."""
    if type(value) is not np.ndarray and isinstance(value, (np.generic, np.ndarray)):
        value = np.asarray(value)
    return value, storage_keys(value)


def _bind_one(r, table, step) -> tuple:
    """(value, keys) of a single output, held in `table`: an ndarray counted inline (its storage
    owned when new and writeable: `StorageTable.hold`'s rule), anything else as the executor binds it."""
    if type(r) is np.ndarray:
        key = id(r) if r.base is None else id(storage_root(r))
        count = table.count
        h = count.get(key)
        if h is None:
            count[key] = 1
            table.owned[key] = r.flags.writeable
        else:
            count[key] = h + 1
        return r, (key,)
    value, keys = bound_outputs(step.node, 1, r)[0]
    table.hold(keys, None, value)
    return value, keys


def _bind_many(r, table, step) -> list:
    """(value, keys) of each output of a step declaring several, held in `table`; an omitted
    output's pair is not held."""
    outputs = step.outputs
    if type(r) is tuple and len(r) == len(outputs):
        bound = []
        for value, vid in zip(r, outputs):
            if vid == MISSING:
                bound.append((None, ()))
            elif type(value) is np.ndarray:
                bound.append(_bind_one(value, table, step))
            else:
                value, keys = bound_output(value)
                table.hold(keys, None, value)
                bound.append((value, keys))
        return bound
    bound = bound_outputs(step.node, len(outputs), r)
    for (value, keys), vid in zip(bound, outputs):
        if vid != MISSING:
            table.hold(keys, None, value)
    return bound


def _grant(keys: tuple, position: int, table, ctx) -> tuple:
    """(position,) when a dying input's storages may be overwritten (owned, held by it alone),
    telling `ctx` of the write when it keeps something of theirs; else (). The generated code
    decides a single owned storage and nothing kept inline."""
    if len(keys) == 1 and table.count.get(keys[0]) == 1 and table.owned.get(keys[0]) or \
            len(keys) > 1 and table.exclusive(keys):
        if ctx.kept_storages and not ctx.kept_storages.isdisjoint(keys):
            ctx.overwriting(keys)
        return (position,)
    return ()


def _memo_lines(outputs: list) -> list[str]:
    """Bind a memo node's outputs (names in order; its result is a tuple of exactly those): its
    values are read-only arrays that never share storage with a graph value, or sequences of such
    (shape_cache.py copies those that would), so neither they nor views of them are ever written in
    place and their storage is not counted: no keys, nothing to check, nothing to release."""
    return [f"        {''.join(f'v{name}, ' for name in outputs)}= r",
            f"        {''.join(f'k{name} = ' for name in outputs)}()"]


def _memo_lines_found(index: int, step, names: dict[int, str], call: str, namespace: dict) -> list[str]:
    """A memo's kept result found inline as its kernel finds it first, the kernel called when it is
    not: by its roots' shapes (`KeptResults`), or by those and its externals' identity (the
    `Remembered` lookup `ShapeGroup.__call__` makes outside profiles; a compiled plan never runs
    profiled): a hit then costs no kernel call."""
    group = step.fn
    count = len(group.roots)
    shapes = "".join(f"v{names[v]}.shape, " for v in step.inputs[:count])
    if group.external:
        namespace[f"m{index}"] = group.known_by_identity
        identities = "".join(f", id(v{names[v]})" for v in step.inputs[count:])
        lookup = f"            r = m{index}((({shapes}){identities}))"
    else:
        namespace[f"m{index}"] = group.results.get
        lookup = f"            r = m{index}(({shapes}))"
    return ["        try:", lookup, "        except AttributeError:", "            r = None", "        if r is None:",
            f"            r = {call}"]


def _names(plan) -> dict[int, str]:
    """The suffix of each value's local variables (v<suffix>, k<suffix>): constants keep their id
    (they are globals); other values share a slot with values whose lifetimes end before theirs
    begin. A plan then has tens of locals, not thousands: Python 3.11 allocates frames in 16 KiB
    chunks, and a frame nearly filling one made every call from it map and unmap a fresh chunk
    (hundreds a decode step)."""
    slot_of: dict[int, int] = {}
    free: list[int] = []
    used = 0
    for produced, released in ((plan.inputs, ()), *((step.outputs, step.releases) for step in plan.steps)):
        for vid in produced:
            if vid != MISSING and vid not in slot_of:
                if free:
                    slot_of[vid] = free.pop()
                else:
                    slot_of[vid], used = used, used + 1
        for vid in released:  # after the outputs: a step binds its outputs before it releases
            if vid in slot_of:
                free.append(slot_of[vid])
    return {**{vid: f"s{slot}" for vid, slot in slot_of.items()}, **{vid: f"c{vid}" for vid in plan.constants}}


def compile_plan(graph: Graph, plan):
    """A function (values, keys, table, ctx) -> (output values, output keys) running `plan` like
    the interpreted loop, or None for a plan with subgraph nodes."""
    if any(step.node.subgraphs for step in plan.steps):
        return None
    names = _names(plan)
    keyless = {vid for step in plan.steps if isinstance(step.fn, ShapeGroup) for vid in step.outputs}
    namespace = {"one": _bind_one, "many": _bind_many, "grant": _grant,
                 "target": inplace_target}
    lines = ["def run(V, K, table, ctx):",
             "    cnt_get, own_get, drop = table.count.get, table.owned.get, table.drop"]
    for vid in plan.inputs:
        lines.append(f"    v{names[vid]} = V[{vid}]; k{names[vid]} = K[{vid}]")
    for vid in plan.constants:  # globals: never assigned in the function
        namespace[f"v{names[vid]}"] = plan.values_template[vid]
        namespace[f"k{names[vid]}"] = plan.keys_template[vid]
    lines += ["    try:"]
    starts = []  # the first line of each step: a failure is placed by its line number
    for index, step in enumerate(plan.steps):
        starts.append(len(lines) + 1)
        lines += _step_lines(index, step, namespace, names, keyless)
    outputs = ", ".join(f"v{names[v]}" for v in plan.outputs)
    output_keys = ", ".join(f"k{names[v]}" for v in plan.outputs)
    lines += ["        pass",
              "    except Exception as error:",
              "        scope = locals()",
              "        step = STEPS[bisect(STARTS, error.__traceback__.tb_lineno) - 1]",
              "        args = [None if v == -1 else scope.get(f'v{NAMES[v]}', globals().get(f'v{NAMES[v]}'))",
              "                for v in step.inputs]",
              "        wrapped = node_error(GRAPH, step.node, args, error)",
              "        if wrapped is error:",
              "            raise",
              "        raise wrapped from error",
              f"    return [{outputs}], [{output_keys}]"]
    namespace.update(STEPS=plan.steps, STARTS=starts, GRAPH=graph, NAMES=names, node_error=node_error,
                     bisect=bisect_right)
    exec(compile("\n".join(lines), f"<runnx plan of {graph.name or 'graph'}>", "exec"), namespace)
    return namespace["run"]


def _grant_test(keys: str, position: int, inline_only: bool = False) -> str:
    """An expression true when the dying input whose keys are local `keys` is granted: a single
    owned storage it alone holds, nothing kept this run, decided inline; else by `_grant`."""
    test = f"len({keys}) == 1 and cnt_get({keys}[0]) == 1 and own_get({keys}[0]) and not ctx.kept_storages"
    return test if inline_only else f"{test} or grant({keys}, {position}, table, ctx)"


def _step_lines(index: int, step, namespace: dict, names: dict[int, str], keyless: set) -> list[str]:
    """The lines of one step; `keyless` values (memo outputs) are never granted, counted or released.
    The common path is inline (a single owned storage granted, an ndarray output counted, a
    release); what is rarer calls a helper above: a grant to decide with `StorageTable.exclusive`
    or to tell `ctx` of, an output that is not an ndarray, a step of several outputs."""
    node = step.node
    candidates = [(position, vid) for position, vid in step.candidates if vid not in keyless]
    arguments = ["None" if v == MISSING else f"v{names[v]}" for v in step.inputs]
    namespace[f"f{index}"], attrs = bound_kernel(step.fn, {k: v for k, v in step.kwargs.items() if k != "overwrite"})
    if attrs:
        namespace[f"a{index}"] = attrs
        arguments.append(f"**a{index}")
    if step.wants_ctx:
        arguments.append("ctx=ctx")
    lines = [f"        # {node.describe()}"]
    ufunc = node.kernel.ufunc if node.kernel is not None and step.fn is node.kernel.fn else None
    inline_ufunc = (ufunc is not None and not isinstance(step.fn, ShapeGroup) and len(step.inputs) in (1, 2)
                    and MISSING not in step.inputs)
    if inline_ufunc and len(candidates) == 1:  # the grant decided inside the ufunc call's arguments
        position, vid = candidates[0]
        lines += _inline_ufunc_lines(index, ufunc, arguments[:len(step.inputs)], [position], namespace,
                                     _grant_test(f"k{names[vid]}", position))
    else:
        if candidates:
            grants = [f"(({position},) if {_grant_test(f'k{names[vid]}', position, inline_only=True)} else "
                      f"grant(k{names[vid]}, {position}, table, ctx))" for position, vid in candidates]
            lines.append(f"        g = {' + '.join(grants)}")
            arguments.append("overwrite=g")
        elif "overwrite" in step.kwargs:
            arguments.append("overwrite=()")
        call = f"f{index}({', '.join(arguments)})"
        if isinstance(step.fn, ShapeGroup) and MISSING not in step.inputs:
            lines += _memo_lines_found(index, step, names, call, namespace)
        elif inline_ufunc:
            lines += _inline_ufunc_lines(index, ufunc, arguments[:len(step.inputs)], [p for p, _ in candidates],
                                         namespace)
        else:
            lines.append(f"        r = {call}")
    outputs = [(j, names[v]) for j, v in enumerate(step.outputs) if v != MISSING]
    if isinstance(step.fn, ShapeGroup):
        lines += _memo_lines([name for _, name in outputs])
    elif step.single:
        out = names[step.outputs[0]]
        # a kernel that returns a dying input itself (overwritten, or unchanged): the output takes
        # over its storage count, the release is a no-op
        for n, (_, vid) in enumerate(candidates):
            lines += [f"        {'elif' if n else 'if'} r is v{names[vid]}:",
                      f"            v{out} = r; k{out} = k{names[vid]}; k{names[vid]} = ()"]
        bind = f"v{out}, k{out} = one(r, table, STEPS[{index}])"
        lines += ["        else:", f"            {bind}"] if candidates else [f"        {bind}"]
    elif outputs:
        targets = ", ".join("(_, _)" if v == MISSING else f"(v{names[v]}, k{names[v]})" for v in step.outputs)
        lines.append(f"        {targets}, = many(r, table, STEPS[{index}])")
    for vid in step.releases:
        if vid not in keyless:
            lines.append(f"        if k{names[vid]}: drop(k{names[vid]})")
        lines.append(f"        v{names[vid]} = None")
    return lines


def _inline_ufunc_lines(index: int, ufunc, inputs: list[str], granting: list, namespace: dict,
                        test: str | None = None) -> list[str]:
    """A kernel registered as `binary`/`unary` of a ufunc (registry.py) called as the ufunc itself:
    into the granted input `binary`/`unary` would write (`inplace_target`, C-contiguity), else
    into a fresh array (a 0-d result comes back a numpy scalar: binding makes it an array, as the
    kernel would). `granting`: the positions that may be granted, in local `g`; or, with `test`
    (an expression true when the one position in `granting` is granted), decided in the call.
    On a chain of small ops the two calls around the ufunc cost as much as the plan's bookkeeping."""
    namespace[f"u{index}"] = ufunc
    a = inputs[0]
    granted = "g" if test is None else f"({test})"
    if len(inputs) == 1:
        if not granting:
            return [f"        r = u{index}({a})"]
        return [f"        r = u{index}({a}, {a}) if {granted} and {a}.flags.c_contiguous else u{index}({a})"]
    b = inputs[1]
    if not granting:
        return [f"        r = u{index}({a}, {b})"]
    # first the case of equal operands, as `inplace_target` decides it (a tenth of a tiny node's cost)
    fits = f"{a}.shape == {b}.shape and {a}.dtype == {b}.dtype and {a}.flags.c_contiguous"
    if test is not None:
        position = granting[0]
        into = f"{a} if {fits} else target({a}, {b}, (0,))" if position == 0 else f"target({a}, {b}, ({position},))"
        return [f"        r = u{index}({a}, {b}, ({into}) if {test} else None)"]
    fallback = f"r = u{index}({a}, {b}, target({a}, {b}, g) if g else None)"
    if 0 not in granting:
        return [f"        {fallback}"]
    first = "g" if granting == [0] else "g and g[0] == 0"  # g is (0,) when granted
    return [f"        if {first} and {fits}:",
            f"            r = u{index}({a}, {b}, {a})",
            "        else:",
            f"            {fallback}"]
