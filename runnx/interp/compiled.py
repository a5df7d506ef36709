"""Plans compiled to straight-line Python: the executor's hot loop without the loop.

A plan that runs again (Options.compile_after: one-shot runs never pay for code generation) is
turned into one generated function (codegen.py): values are local variables (values whose
lifetimes do not overlap share one), every kernel, attribute dict and constant a global, and each
step is the few lines the interpreted loop would execute for it: grant in-place reuse of dying
inputs, call the kernel, count the output's storage, release dead values. The decisions are the
interpreted loop's, made by the same rules (capture/ownership.py: `may_write`, `hold_array`,
`drop`); only the common case of a grant is inline, as the expression `may_write_inline` writes
beside its rule. A step's code holds its common path (the compiling run pays `compile()` for every
syntax node); what is rarer calls a rule or a helper below: a grant over several storages or into
storages the run keeps something of, an output that is not an ndarray, a step of several outputs.

Plans with subgraph nodes (If/Loop/Scan bind a CaptureEnv per call) and instrumented runs
(profile, trace, in-place checking) keep the interpreted loop; a subgraph's own plan compiles.
"""
from __future__ import annotations

import numpy as np

from runnx.capture.ownership import BOOKKEEPING, may_write, may_write_inline, storage_keys
from runnx.errors import NodeError
from runnx.interp.codegen import Program
from runnx.interp.ir import MISSING, Graph
from runnx.interp.shape_cache import ShapeGroup
from runnx.ops.registry import inplace_target, writable_alone_inline, writes_first_inline
from runnx.runtime import opening, settle


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


def _single_binder(steps: tuple):
    """`one(r, table, index)`: (value, keys) of the single output `r` of the plan's `index`-th step,
    held in `table` as the interpreted loop holds it."""

    def one(r, table, index: int) -> tuple:
        if type(r) is np.ndarray:
            return r, table.hold_array(r)
        value, keys = bound_outputs(steps[index].node, 1, r)[0]
        table.hold(keys, None, value)
        return value, keys

    return one


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
                bound.append((value, table.hold_array(value)))
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


def _memo_lines(outputs: list) -> list[str]:
    """Bind a memo node's outputs (names in order; its result is a tuple of exactly those): its
    values are read-only arrays that never share storage with a graph value, or sequences of such
    (shape_cache.py copies those that would), so neither they nor views of them are ever written in
    place and their storage is not counted: no keys, nothing to check, nothing to release."""
    return [f"{''.join(f'v{name}, ' for name in outputs)}= r", f"{''.join(f'k{name} = ' for name in outputs)}()"]


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


def compile_plan(graph: Graph, plan, overlap_jobs: bool = False):
    """A function (values, keys, table, ctx) -> (output values, output keys) running `plan` like
    the interpreted loop, or None for a plan with subgraph nodes. overlap_jobs: the kernels
    declaring `overlaps_jobs` are called with leave to return before their outputs are written
    (their pool job computing, or their calls deferred: `runtime/open_jobs.py`), and a step that
    may read what is still pending settles first: any other step but a memo (shapes only), or one
    of theirs whose `reads_data` inputs a pending step outputs; the caller settles after the
    function returns, and takes the leave back."""
    if any(step.node.subgraphs for step in plan.steps):
        return None
    names = _names(plan)
    keyless = {vid for step in plan.steps if isinstance(step.fn, ShapeGroup) for vid in step.outputs}
    program = Program(graph, "V, K, table, ctx", f"plan of {graph.name or 'graph'}",
                      [BOOKKEEPING, *(f"v{names[vid]} = V[{vid}]; k{names[vid]} = K[{vid}]" for vid in plan.inputs)])
    program.namespace.update(one=_single_binder(plan.steps), many=_bind_many, may_write=may_write,
                             target=inplace_target, ndarray=np.ndarray, STEPS=plan.steps, settle=settle,
                             OPENING=opening)
    for vid in plan.constants:  # globals: never assigned in the function
        program.set(f"v{names[vid]}", plan.values_template[vid])
        program.set(f"k{names[vid]}", plan.keys_template[vid])
    pending: set | None = None  # values a step since the last settle may still be writing (None: no such step)
    for index, step in enumerate(plan.steps):
        kernel = step.node.kernel
        overlaps = overlap_jobs and kernel is not None and kernel.overlaps_jobs and step.fn is kernel.fn
        memo = isinstance(step.fn, ShapeGroup)  # (reads shapes only)
        if pending is None or memo:
            settles = False
        elif overlaps:  # (reads data from Python only where it says)
            settles = any(p < len(step.inputs) and step.inputs[p] in pending for p in kernel.reads_data)
        else:
            settles = True
        _step(program, index, step, names, keyless, settles=settles, overlaps=overlaps)
        if settles or not overlaps and not memo:
            pending = None
        if overlaps:
            pending = (pending or set()) | set(step.outputs)
    return program.build(f"[{', '.join(f'v{names[v]}' for v in plan.outputs)}], "
                         f"[{', '.join(f'k{names[v]}' for v in plan.outputs)}]")


def _grant(keys: str) -> str:
    """An expression true when the dying input whose keys are local `keys` is granted: `may_write`,
    its common case inline (`may_write_inline`)."""
    return f"{may_write_inline(keys)} or may_write(table, {keys}, ctx)"


def _step(program: Program, index: int, step, names: dict[int, str], keyless: set, settles: bool,
          overlaps: bool) -> None:
    """Emit the lines of one step; `keyless` values (memo outputs) are never granted, counted or
    released. The common path is inline (a single owned storage granted, an ndarray output
    counted, a release); what is rarer calls the rules' functions or a helper above: a grant
    `may_write` decides, an output that is not an ndarray, a step of several outputs."""
    node = step.node
    candidates = [(position, vid) for position, vid in step.candidates if vid not in keyless]
    inputs = ["None" if v == MISSING else f"v{names[v]}" for v in step.inputs]
    program.node(node, inputs)
    if settles:  # an earlier step's pool job may still write what this one reads, or read what it writes
        program.emit("settle()")
    arguments = list(inputs)
    ufunc = node.kernel.ufunc if node.kernel is not None and step.fn is node.kernel.fn else None
    memo = isinstance(step.fn, ShapeGroup)
    inline_ufunc = ufunc is not None and not memo and len(step.inputs) in (1, 2) and MISSING not in step.inputs
    if inline_ufunc and len(candidates) == 1:  # the grant decided inside the ufunc call's arguments
        position, vid = candidates[0]
        program.emit(*_inline_ufunc_lines(program, index, ufunc, inputs, [position], _grant(f"k{names[vid]}")))
    else:
        if candidates:
            grants = [f"(({position},) if {_grant(f'k{names[vid]}')} else ())" for position, vid in candidates]
            program.emit(f"g = {' + '.join(grants)}")
            arguments.append("overwrite=g")
        elif "overwrite" in step.kwargs:
            arguments.append("overwrite=()")
        attributes = {k: v for k, v in step.kwargs.items() if k != "overwrite"}
        call = program.call(index, step.fn, attributes, arguments, step.wants_ctx)
        if memo and MISSING not in step.inputs:
            program.emit(*step.fn.found_lines(program, index, inputs, call))
        elif inline_ufunc:
            program.emit(*_inline_ufunc_lines(program, index, ufunc, inputs, [p for p, _ in candidates]))
        elif overlaps:  # leave to return with its pool job open, for this call only
            program.emit("OPENING.allowed = True", f"r = {call}", "OPENING.allowed = False")
        else:
            program.emit(f"r = {call}")
    outputs = [(j, names[v]) for j, v in enumerate(step.outputs) if v != MISSING]
    # a single dying input released here: `_single_output_lines` releases it (or hands its hold over)
    taken = names[candidates[0][1]] if step.single and len(candidates) == 1 and candidates[0][1] in step.releases \
        else None
    if memo:
        program.emit(*_memo_lines([name for _, name in outputs]))
    elif step.single:
        _single_output_lines(program, index, names[step.outputs[0]], [names[v] for _, v in candidates],
                             taken is not None)
    elif outputs:
        targets = ", ".join("(_, _)" if v == MISSING else f"(v{names[v]}, k{names[v]})" for v in step.outputs)
        program.emit(f"{targets}, = many(r, table, STEPS[{index}])")
    for vid in step.releases:
        if vid not in keyless and names[vid] != taken:
            program.emit(f"drop(k{names[vid]})")
        program.emit(f"v{names[vid]} = None")


def _single_output_lines(program: Program, index: int, out: str, dying: list[str], released: bool) -> None:
    """Bind a step's one output `r` to locals v<out>, k<out>: an ndarray counted by `hold`
    (`StorageTable.hold_array`), anything else by `one`. When the kernel returned a `dying` input
    itself (overwritten, or unchanged), the output takes over that input's hold on the storage
    (holding it and releasing the input would leave the counts as they are), and the input's keys
    are emptied: it may live on for its shape (a memo's root), its release then drops nothing.
    A single dying input `released` at this step is instead released by the `else` branch only.
    That branch (the input was not returned) calls `one`: a call more where the kernel writes a
    new array, less code to compile for a step that usually writes in place."""
    if not dying:
        program.emit(f"v{out}, k{out} = (r, hold(r)) if type(r) is ndarray else one(r, table, {index})")
        return
    bind = f"v{out}, k{out} = one(r, table, {index})"
    if released:
        program.emit(f"if r is v{dying[0]}:", f"    v{out} = r; k{out} = k{dying[0]}", "else:", f"    {bind}",
                     f"    drop(k{dying[0]})")
    else:
        for n, name in enumerate(dying):
            program.emit(f"{'elif' if n else 'if'} r is v{name}:", f"    v{out} = r; k{out} = k{name}; k{name} = ()")
        program.emit("else:", f"    {bind}")


def _inline_ufunc_lines(program: Program, index: int, ufunc, inputs: list[str], granting: list,
                        test: str | None = None) -> list[str]:
    """A kernel registered as `binary`/`unary` of a ufunc (registry.py) called as the ufunc itself:
    into the granted input `binary`/`unary` would write (`inplace_target`, C-contiguity), else
    into a fresh array (a 0-d result comes back a numpy scalar: binding makes it an array, as the
    kernel would). `granting`: the positions that may be granted, in local `g`; or, with `test`
    (an expression true when the one position in `granting` is granted), decided in the call.
    On a chain of small ops the two calls around the ufunc cost as much as the plan's bookkeeping."""
    u = program.set(f"u{index}", ufunc)
    a = inputs[0]
    granted = "g" if test is None else f"({test})"
    if len(inputs) == 1:
        if not granting:
            return [f"r = {u}({a})"]
        return [f"r = {u}({a}, {a}) if {granted} and {writable_alone_inline(a)} else {u}({a})"]
    b = inputs[1]
    if not granting:
        return [f"r = {u}({a}, {b})"]
    # first the case of equal operands, as `inplace_target` decides it (a tenth of a tiny node's cost)
    fits = writes_first_inline(a, b)
    if test is not None:
        position = granting[0]
        into = f"{a} if {fits} else target({a}, {b}, (0,))" if position == 0 else f"target({a}, {b}, ({position},))"
        return [f"r = {u}({a}, {b}, ({into}) if {test} else None)"]
    fallback = f"r = {u}({a}, {b}, target({a}, {b}, g) if g else None)"
    if 0 not in granting:
        return [fallback]
    first = "g" if granting == [0] else "g and g[0] == 0"  # g is (0,) when granted
    return [f"if {first} and {fits}:", f"    r = {u}({a}, {b}, {a})", "else:", f"    {fallback}"]
