"""Shared helpers of the math families: broadcasting ufunc application with in-place reuse, erf,
and the numeric-stable building blocks (sigmoid) several activations share."""
from __future__ import annotations

import numpy as np

from runnx.ops._kernels_elementwise import erf_into

# numba and numpy compute these natively; narrower floats go through float32 and are rounded once.
_NATIVE_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))


def binary(ufunc, a: np.ndarray, b: np.ndarray, overwrite=()) -> np.ndarray:
    """ufunc(a, b), written into a (or b) when granted and its shape and dtype already fit."""
    if overwrite:
        shape = a.shape if a.shape == b.shape else np.broadcast_shapes(a.shape, b.shape)
        if 0 in overwrite and a.shape == shape and a.dtype == b.dtype:
            return ufunc(a, b, out=a)
        if 1 in overwrite and b.shape == shape and a.dtype == b.dtype:
            return ufunc(a, b, out=b)
    return np.asarray(ufunc(a, b))


def unary(ufunc, x: np.ndarray, overwrite=()) -> np.ndarray:
    """ufunc(x), written into x when granted."""
    if overwrite:
        return ufunc(x, out=x)
    return np.asarray(ufunc(x))


def output_buffer(x: np.ndarray, overwrite=()) -> np.ndarray:
    """Where a same-shape, same-dtype result of x may go: x itself when granted, else a new array."""
    return x if 0 in overwrite else np.empty_like(x)


def erf(x: np.ndarray, overwrite=()) -> np.ndarray:
    """Elementwise erf in x's dtype (float16/bfloat16 computed in float32, rounded once)."""
    work = x if x.dtype in _NATIVE_FLOATS else x.astype(np.float32)
    flat = np.ascontiguousarray(work).reshape(-1)
    result = np.empty_like(flat)
    erf_into(flat, result)
    result = result.reshape(x.shape)
    if result.dtype != x.dtype:
        result = result.astype(x.dtype)
    if overwrite:
        x[...] = result
        return x
    return result


def sigmoid(x: np.ndarray, overwrite=()) -> np.ndarray:
    """1 / (1 + exp(-x)) without overflow: exp is only taken of -|x|."""
    decay = np.exp(-np.abs(x))
    denominator = 1 + decay
    out = output_buffer(x, overwrite)
    positive = x >= 0
    np.divide(1, denominator, out=out, where=positive)
    np.divide(decay, denominator, out=out, where=~positive)
    return out


def broadcast_fold(ufunc, inputs, overwrite=()) -> np.ndarray:
    """ufunc folded left over variadic broadcasting inputs (Sum, Max, Min), into input 0 if granted."""
    shape = np.broadcast_shapes(*(x.shape for x in inputs))
    first = inputs[0]
    if len(inputs) == 1:
        return first
    if 0 in overwrite and first.shape == shape and all(x.dtype == first.dtype for x in inputs):
        out = first
        ufunc(out, inputs[1], out=out)
    else:
        out = np.asarray(ufunc(first, inputs[1]))
        if out.shape != shape:
            out = np.array(np.broadcast_to(out, shape))
    for x in inputs[2:]:
        ufunc(out, x, out=out)
    return out
