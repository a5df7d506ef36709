"""Elementwise arithmetic: broadcasting binary ops and unary math, in place when granted."""
from __future__ import annotations

import numpy as np

from runnx.ops._elementwise_util import binary, unary
from runnx.ops.registry import register


@register("Add", since=7, inplace=(0, 1))
def Add(a, b, *, overwrite=()):
    return binary(np.add, a, b, overwrite)


@register("Sub", since=7, inplace=(0, 1))
def Sub(a, b, *, overwrite=()):
    return binary(np.subtract, a, b, overwrite)


@register("Mul", since=7, inplace=(0, 1))
def Mul(a, b, *, overwrite=()):
    return binary(np.multiply, a, b, overwrite)


@register("Div", since=7, inplace=(0, 1))
def Div(a, b, *, overwrite=()):
    if a.dtype.kind in "iu":
        return np.asarray(np.trunc(a / b).astype(a.dtype) if a.dtype.kind == "i" else a // b)
    return binary(np.divide, a, b, overwrite)


@register("Neg", since=6, inplace=(0,))
def Neg(x, *, overwrite=()):
    return unary(np.negative, x, overwrite)


@register("Sqrt", since=6, inplace=(0,))
def Sqrt(x, *, overwrite=()):
    return unary(np.sqrt, x, overwrite)
