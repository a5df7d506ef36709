"""Ops that grow or update a cache: Concat appends into spare capacity in place (the KV-cache
growth of Optimum decoders), TensorScatter writes new rows into a fixed cache."""
from __future__ import annotations

import numpy as np

from runnx.capture.capacity import append_in_place, concatenate_with_headroom
from runnx.ops.registry import register


@register("Concat", since=4, inplace=(0,))
def Concat(*inputs, axis: int, overwrite=(), ctx=None):
    """Appends into the first input's spare capacity when it is granted (owned, dead, unaliased);
    a granted input without room is regrown with doubling so that later appends are in place."""
    first = inputs[0]
    axis = axis % first.ndim if first.ndim else 0
    parts = [p for p in inputs if p.shape[axis] or p is first] if first.ndim else list(inputs)
    if 0 in overwrite and first.ndim and len(parts) > 1 and all(p.dtype == first.dtype for p in parts):
        rest = parts[1:]
        grown = append_in_place(first, rest, axis)
        if grown is not None:
            if ctx is not None:
                ctx.count("Concat.appends_in_place")
                ctx.count("Concat.bytes_copied", sum(p.nbytes for p in rest))
            return grown
        if ctx is not None:
            ctx.count("Concat.regrown")
            ctx.count("Concat.bytes_copied", sum(p.nbytes for p in parts))
        return concatenate_with_headroom(parts, axis)
    result = np.concatenate(inputs, axis=axis)
    if ctx is not None:
        ctx.count("Concat.bytes_copied", result.nbytes)
    return result
