"""Shape and layout: views where numpy allows them (Reshape, Transpose, Identity, ...)."""
from __future__ import annotations

import numpy as np

from runnx.errors import RunnxError
from runnx.ops.registry import register


@register("Identity", since=1)
def Identity(x):
    return x


@register("Shape", since=1)
def Shape(x, *, start: int = 0, end: int | None = None):
    return np.array(x.shape[start:end], dtype=np.int64)


@register("Reshape", since=5)
def Reshape(data, shape, *, allowzero: int = 0):
    target = [int(d) for d in shape]
    if not allowzero:
        target = [data.shape[i] if d == 0 else d for i, d in enumerate(target)]
    if target.count(-1) > 1:
        raise RunnxError(f"Reshape target {list(shape)} has more than one -1")
    return data.reshape(target)


@register("Transpose", since=1)
def Transpose(data, *, perm: tuple[int, ...] | None = None):
    return np.transpose(data, perm)
