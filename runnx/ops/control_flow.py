"""Control flow: If, Loop and Scan run their bodies through `Subgraph` (see runnx/capture/env.py).

If runs its branch once, so captures moved into it (by value) are owned inside the branch.
Loop/Scan iterate with `iterate()`: captures are lent read-only to every iteration (never copied),
while loop-carried values stay owned across iterations, so a Concat onto a loop-carried value
grows in place.
"""
from __future__ import annotations

import numpy as np

from runnx.capture.env import Subgraph
from runnx.errors import RunnxError
from runnx.interp.dtypes import ONNX_TO_NUMPY
from runnx.ops.registry import register


def _scalar_bool(value, what: str) -> bool:
    array = np.asarray(value)
    if array.size != 1:
        raise RunnxError(f"{what} must hold exactly one element, got shape {list(array.shape)}")
    return bool(array.reshape(-1)[0])


@register("If", since=1)
def If(cond, *, then_branch: Subgraph, else_branch: Subgraph):
    branch = then_branch if _scalar_bool(cond, "If condition") else else_branch
    outputs, _ = branch.run()
    return tuple(outputs)


def _empty_scan_output(info) -> np.ndarray:
    """A Loop scan output when the loop ran zero times: shape (0, *static dims)."""
    dtype = ONNX_TO_NUMPY.get(info.elem_type, np.dtype(np.float32))
    dims = [d if isinstance(d, int) else 0 for d in (info.shape or ())]
    return np.zeros([0] + dims, dtype=dtype)


@register("Loop", since=1, inplace_from=2)
def Loop(max_trip_count, cond, *initial, body: Subgraph, overwrite=(), ctx=None):
    trips = None  # M may be INT64_MAX for a while-loop (PyTorch exports): the limit is checked per iteration
    if max_trip_count is not None and np.asarray(max_trip_count).size:
        trips = int(np.asarray(max_trip_count).reshape(-1)[0])
    running = True if cond is None or not np.asarray(cond).size else _scalar_bool(cond, "Loop condition")
    state = list(initial)
    owned = [position + 2 in overwrite for position in range(len(initial))]
    scan_count = len(body.output_names) - 1 - len(state)
    if scan_count < 0:
        raise RunnxError(f"Loop body has {len(body.output_names)} outputs, needs at least {1 + len(state)} "
                         f"(condition + {len(state)} loop-carried values)")
    scans = [[] for _ in range(scan_count)]
    limit = ctx.options.max_loop_iterations
    iteration = 0
    while running and (trips is None or iteration < trips):
        if iteration >= limit:
            ctx.check_iterations(iteration + 1, "Loop")
        outputs, flags = body.iterate(
            [np.array(iteration, dtype=np.int64), np.array(running), *state], [True, True, *owned])
        running = _scalar_bool(outputs[0], "Loop body condition output")
        state = outputs[1:1 + len(state)]
        owned = flags[1:1 + len(state)]
        for collected, value in zip(scans, outputs[1 + len(state):]):
            collected.append(np.array(value))  # a copy: the next iteration may overwrite the storage
        iteration += 1
    finals = []
    for index, collected in enumerate(scans):
        info = body.output_info[1 + len(state) + index]
        finals.append(np.stack(collected) if collected else _empty_scan_output(info))
    return tuple(state + finals)


def _scan_loop(body: Subgraph, states, state_owned, sequences, input_axes, input_reverse,
               output_axes, output_reverse, ctx):
    """The Scan recurrence shared by the opset-8 (batched) and opset-9+ forms."""
    length = sequences[0].shape[input_axes[0]] if sequences else 0
    for sequence, axis in zip(sequences, input_axes):
        if sequence.shape[axis] != length:
            raise RunnxError(f"Scan inputs disagree on the sequence length: {length} vs {sequence.shape[axis]}")
    ctx.check_iterations(length, "Scan")
    steps = [[] for _ in range(len(body.output_names) - len(states))]
    for t in range(length):
        slices = [np.take(seq, length - 1 - t if reverse else t, axis=axis)
                  for seq, axis, reverse in zip(sequences, input_axes, input_reverse)]
        outputs, flags = body.iterate([*states, *slices], [*state_owned, *([False] * len(slices))])
        states, state_owned = outputs[:len(states)], flags[:len(states)]
        for collected, value in zip(steps, outputs[len(states):]):
            collected.append(np.array(value))
    finals = []
    for index, collected in enumerate(steps):
        if output_reverse[index]:
            collected = collected[::-1]
        if collected:
            finals.append(np.stack(collected, axis=output_axes[index] % (collected[0].ndim + 1)))
        else:
            finals.append(_empty_scan_output(body.output_info[len(states) + index]))
    return list(states), finals


def _axes(values, count):
    values = list(values) if values is not None else [0] * count
    if len(values) != count:
        raise RunnxError(f"expected {count} axis/direction values, got {len(values)}")
    return values


@register("Scan", since=9, inplace_from=0)
def Scan(*inputs, body: Subgraph, num_scan_inputs: int, scan_input_axes: tuple[int, ...] | None = None,
         scan_input_directions: tuple[int, ...] | None = None, scan_output_axes: tuple[int, ...] | None = None,
         scan_output_directions: tuple[int, ...] | None = None, overwrite=(), ctx=None):
    state_count = len(inputs) - num_scan_inputs
    states, sequences = list(inputs[:state_count]), list(inputs[state_count:])
    output_count = len(body.output_names) - state_count
    input_axes = [a % s.ndim for a, s in zip(_axes(scan_input_axes, num_scan_inputs), sequences)]
    states, finals = _scan_loop(
        body, states, [i in overwrite for i in range(state_count)], sequences, input_axes,
        _axes(scan_input_directions, num_scan_inputs), _axes(scan_output_axes, output_count),
        _axes(scan_output_directions, output_count), ctx)
    return tuple(states + finals)


@register("Scan", since=8, inplace_from=1)
def Scan_8(sequence_lens, *inputs, body: Subgraph, num_scan_inputs: int,
           directions: tuple[int, ...] | None = None, overwrite=(), ctx=None):
    """Opset 8: every input has a leading batch axis; each batch row is scanned on its own."""
    state_count = len(inputs) - num_scan_inputs
    batch = inputs[0].shape[0]
    output_count = len(body.output_names) - state_count
    directions = _axes(directions, num_scan_inputs)
    rows_states, rows_outputs = [], []
    for row in range(batch):
        sequences = [s[row] for s in inputs[state_count:]]
        if sequence_lens is not None:
            sequences = [s[:int(sequence_lens[row])] for s in sequences]
        states, finals = _scan_loop(
            body, [s[row] for s in inputs[:state_count]], [False] * state_count, sequences,
            [0] * num_scan_inputs, directions, [0] * output_count, [0] * output_count, ctx)
        rows_states.append(states)
        rows_outputs.append(finals)
    stacked_states = [np.stack([r[i] for r in rows_states]) for i in range(state_count)]
    stacked_outputs = [np.stack([r[i] for r in rows_outputs]) for i in range(output_count)]
    return tuple(stacked_states + stacked_outputs)
