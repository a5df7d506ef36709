"""Ops that grow or update a cache: Concat appends into spare capacity in place (the KV-cache
growth of Optimum decoders), TensorScatter writes new rows into a fixed cache."""
from __future__ import annotations

import numpy as np

from runnx.capture.capacity import append_in_place, concatenate_with_headroom
from runnx.errors import RunnxError
from runnx.ops.registry import register


@register("Concat", since=4, inplace=(0,))
def Concat(*inputs, axis: int, overwrite=(), ctx=None):
    """Appends into the first input's spare capacity when it is granted (owned, dead, unaliased).
    A granted input without room that is longer than what is appended (an accumulator growing: a
    KV cache, a loop-carried value) is regrown with doubling so that later appends are in place;
    other concatenations (e.g. rotary halves) allocate exactly."""
    first = inputs[0]
    if not -first.ndim <= axis < max(first.ndim, 1):
        raise RunnxError(f"Concat axis {axis} is out of range for inputs of rank {first.ndim}")
    axis = axis % first.ndim if first.ndim else 0
    parts = [p for p in inputs if p.shape[axis] or p is first] if first.ndim else list(inputs)
    if 0 in overwrite and first.ndim and len(parts) > 1 and all(p.dtype == first.dtype for p in parts):
        rest = parts[1:]
        grown = append_in_place(first, rest, axis)
        if grown is not None:
            if ctx is not None and ctx.profile is not None:
                ctx.count("Concat.appends_in_place")
                ctx.count("Concat.bytes_copied", sum(p.nbytes for p in rest))
            return grown
        if first.shape[axis] > sum(p.shape[axis] for p in rest):
            if ctx is not None and ctx.profile is not None:
                ctx.count("Concat.regrown")
                ctx.count("Concat.bytes_copied", sum(p.nbytes for p in parts))
            return concatenate_with_headroom(parts, axis)
    result = np.concatenate(inputs, axis=axis)
    if ctx is not None and ctx.profile is not None:
        ctx.count("Concat.bytes_copied", result.nbytes)
    return result


def count_appends(ctx, *appended) -> None:
    """Count a fused node's in-place cache appends (the arrays appended) under Concat's names."""
    if ctx is not None and ctx.profile is not None:
        ctx.count("Concat.appends_in_place", len(appended))
        ctx.count("Concat.bytes_copied", sum(a.nbytes for a in appended))


@register("TensorScatter", since=24, inplace=(0,))
def TensorScatter(past_cache, update, write_indices=None, *, axis: int = -2, mode: str = "linear",
                  overwrite=(), ctx=None):
    """Writes `update` into the cache at per-batch positions; in place when the cache is granted
    (owned and dead), so a fixed-size KV cache is updated in O(new rows)."""
    if mode not in ("linear", "circular"):
        raise RunnxError(f"TensorScatter mode must be 'linear' or 'circular', got '{mode}'")
    rank = past_cache.ndim
    axis = axis % rank
    if axis == 0:
        raise RunnxError("TensorScatter axis cannot be the batch axis 0")
    if update.ndim != rank or any(u != c for i, (u, c) in enumerate(zip(update.shape, past_cache.shape))
                                  if i != axis) or update.shape[axis] > past_cache.shape[axis]:
        raise RunnxError(f"update shape {list(update.shape)} does not fit cache shape {list(past_cache.shape)} "
                         f"along axis {axis}")
    batch, capacity, length = past_cache.shape[0], past_cache.shape[axis], update.shape[axis]
    starts = np.zeros(batch, dtype=np.int64) if write_indices is None else np.asarray(write_indices).reshape(-1)
    present = past_cache if 0 in overwrite else past_cache.copy()
    lead = (slice(None),) * (axis - 1)
    for row in range(batch):
        positions = int(starts[row]) + np.arange(length)
        if mode == "circular":
            positions %= capacity
        elif length and (positions[0] < 0 or positions[-1] >= capacity):
            raise RunnxError(f"TensorScatter writes rows {positions[0]}..{positions[-1]} of batch {row} outside "
                             f"the cache length {capacity}")
        present[row][lead + (positions,)] = update[row]
    if ctx is not None:
        ctx.count("TensorScatter.bytes_copied", update.nbytes + (0 if 0 in overwrite else past_cache.nbytes))
    return present
