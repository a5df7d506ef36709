"""Tensor creation: Constant (folded at load time), ConstantOfShape, Range, EyeLike.

Ops whose output size comes from a tensor's values check it against the session's element limit
before allocating."""
from __future__ import annotations

import math

import numpy as np

from runnx.errors import InvalidModelError, RunnxError
from runnx.interp.dtypes import numpy_dtype
from runnx.ops._shape_util import int_values, scalar_value
from runnx.ops.registry import register


@register("Constant", since=1)
def Constant(*, value: np.ndarray | None = None, value_float: float | None = None,
             value_floats: tuple[float, ...] | None = None, value_int: int | None = None,
             value_ints: tuple[int, ...] | None = None, value_string: str | None = None,
             value_strings: tuple[str, ...] | None = None, sparse_value: np.ndarray | None = None):
    given = [(k, v) for k, v in (("value", value), ("value_float", value_float), ("value_floats", value_floats),
                                ("value_int", value_int), ("value_ints", value_ints),
                                ("value_string", value_string), ("value_strings", value_strings),
                                ("sparse_value", sparse_value)) if v is not None]
    if len(given) != 1:
        raise InvalidModelError(f"Constant needs exactly one value attribute, got {[k for k, _ in given] or 'none'}")
    name, data = given[0]
    if name in ("value", "sparse_value"):
        return data
    if name in ("value_float", "value_floats"):
        return np.array(data, dtype=np.float32)
    if name in ("value_int", "value_ints"):
        return np.array(data, dtype=np.int64)
    return np.array(data, dtype=object)


@register("ConstantOfShape", since=9)
def ConstantOfShape(shape, *, value: np.ndarray | None = None, ctx):
    dims = int_values(shape)
    if any(d < 0 for d in dims):
        raise RunnxError(f"ConstantOfShape shape {dims} has a negative dimension")
    ctx.check_elements(dims, "ConstantOfShape output")
    if value is None:
        return np.zeros(dims, dtype=np.float32)
    if value.size != 1:
        raise InvalidModelError(f"ConstantOfShape value must hold one element, got shape {value.shape}")
    return np.full(dims, value.reshape(-1)[0], dtype=value.dtype)


def _range(start, limit, delta, compute_dtype, ctx):
    """start + i * delta for i < ceil((limit - start) / delta), computed in `compute_dtype`."""
    first, last, step = (scalar_value(v, name) for v, name in ((start, "start"), (limit, "limit"), (delta, "delta")))
    if step == 0:
        raise RunnxError("Range delta cannot be 0")
    if start.dtype.kind in "iu":
        count = max(-((first - last) // step), 0)  # the ceiling, exactly
    else:
        count = max(math.ceil((last - first) / step), 0)
    ctx.check_elements([count], "Range output")
    if start.dtype.kind in "iu" and compute_dtype == start.dtype and max(abs(first), abs(last), abs(step)) < 2**52:
        return np.arange(first, first + count * step, step, dtype=start.dtype)  # exact: the same integers
    steps = np.arange(count).astype(compute_dtype)
    return (steps * delta.astype(compute_dtype) + start.astype(compute_dtype)).astype(start.dtype, copy=False)


@register("Range", since=11)
def Range(start, limit, delta, *, ctx):
    return _range(start, limit, delta, start.dtype, ctx)


@register("Range", since=27)
def Range_27(start, limit, delta, *, stash_type: int = 1, ctx):
    """float16 and bfloat16 ranges are computed in the stash type (float32 by default)."""
    narrow = start.dtype.name in ("float16", "bfloat16")  # bfloat16: ml_dtypes', by name (not imported)
    return _range(start, limit, delta, numpy_dtype(stash_type) if narrow else start.dtype, ctx)


@register("EyeLike", since=9)
def EyeLike(x, *, dtype: int | None = None, k: int = 0):
    if x.ndim != 2:
        raise RunnxError(f"EyeLike needs a 2-D input, got shape {x.shape}")
    return np.eye(x.shape[0], x.shape[1], k, dtype=x.dtype if dtype is None else numpy_dtype(dtype))
