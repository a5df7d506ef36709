"""Shared helpers of the math families: broadcasting ufunc application with in-place reuse, erf,
and the numeric-stable building blocks (sigmoid) several activations share."""
from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

from runnx.ops import _native
from runnx.ops._kernels_elementwise import (FOUR, P0, P1, P2, P3, P4, P5, P6, Q0, Q1, Q2, Q3, Q4, erf_float32_into,
                                            erf_float64_into)
from runnx.ops.registry import inplace_target


# In-place results must be bitwise what copy mode computes, down to the memory layout (a later
# reduction's summation order follows it): only a C-contiguous input is written into.


def binary(ufunc, a: np.ndarray, b: np.ndarray, overwrite=()) -> np.ndarray:
    """ufunc(a, b), written into a granted input when it fits (`inplace_target`; the output
    passed by position: a keyword costs numpy 50 ns more to parse)."""
    if overwrite:
        target = inplace_target(a, b, overwrite)
        if target is not None:
            return ufunc(a, b, target)
    result = ufunc(a, b)
    return result if type(result) is np.ndarray else np.asarray(result)


def unary(ufunc, x: np.ndarray, overwrite=()) -> np.ndarray:
    """ufunc(x), written into x when granted and C-contiguous."""
    if overwrite and x.flags.c_contiguous:
        return ufunc(x, x)
    result = ufunc(x)
    return result if type(result) is np.ndarray else np.asarray(result)


def output_buffer(x: np.ndarray, overwrite=()) -> np.ndarray:
    """Where a same-shape, same-dtype result of x may go: x itself when granted and C-contiguous,
    else a new C-ordered array."""
    return x if 0 in overwrite and x.flags.c_contiguous else np.empty(x.shape, x.dtype)


def erf(x: np.ndarray, overwrite=()) -> np.ndarray:
    """Elementwise erf in x's dtype: float64 through libm; float32 by a rational approximation
    (within 6 ulp); float16/bfloat16 through that float32 result, rounded once."""
    if not _native.enabled:
        return _erf_numpy(x)
    kernel = erf_float64_into if x.dtype == np.float64 else erf_float32_into
    converted = x.dtype not in (np.float32, np.float64)
    work = x.astype(np.float32) if converted else x
    # flat is a fresh array when converting or gathering a strided x, else a view of x (writable if granted)
    private = converted or not x.flags.c_contiguous
    flat = np.ascontiguousarray(work).reshape(-1)
    result = flat if private or 0 in overwrite else np.empty_like(flat)
    kernel(flat, result)
    result = result.reshape(x.shape)
    return result.astype(x.dtype) if converted else result


def _erf_numpy(x: np.ndarray) -> np.ndarray:
    """`erf` with numpy (the kernels not compiled yet, `_native`): the float32 kernel's rational
    approximation in numpy's float32 operations (within an ulp of the kernel's, which may fuse a
    multiply-add), float64 through libm's erf element by element."""
    if x.dtype == np.float64:
        return np.frompyfunc(math.erf, 1, 1)(x).astype(np.float64)
    v = np.clip(x.astype(np.float32), -FOUR, FOUR)
    squared = v * v
    p = np.full_like(squared, P0)
    for c in (P1, P2, P3, P4, P5, P6):
        p *= squared
        p += c
    q = np.full_like(squared, Q0)
    for c in (Q1, Q2, Q3, Q4):
        q *= squared
        q += c
    p *= v
    p /= q
    return p.astype(x.dtype, copy=False)


def sigmoid(x: np.ndarray, overwrite=()) -> np.ndarray:
    """1 / (1 + exp(-x)). Where exp(-x) overflows the true value is below the smallest float32/64
    subnormal, so inf -> 0 is right; float16/bfloat16 overflow much earlier (x < -11 already), so
    they take exp(-|x|) only and divide by branch."""
    out = output_buffer(x, overwrite)
    if x.dtype.itemsize <= 2:
        decay = np.exp(-np.abs(x))
        denominator = decay + decay.dtype.type(1)
        positive = x >= 0
        np.divide(decay, denominator, out=out)
        return np.reciprocal(denominator, out=out, where=positive)
    np.negative(x, out=out)
    with np.errstate(over="ignore"):
        np.exp(out, out=out)
    out += out.dtype.type(1)
    return np.reciprocal(out, out=out)


@lru_cache(maxsize=4096)
def broadcast_shape(*shapes: tuple) -> tuple:
    """np.broadcast_shapes, remembered per shapes (a model meets few; it costs microseconds a call)."""
    return np.broadcast_shapes(*shapes)


def broadcast_fold(ufunc, inputs, overwrite=()) -> np.ndarray:
    """ufunc folded left over variadic broadcasting inputs (Sum, Max, Min), into input 0 if granted."""
    shape = broadcast_shape(*(x.shape for x in inputs))
    first = inputs[0]
    if len(inputs) == 1:
        return first
    if (0 in overwrite and first.shape == shape and first.flags.c_contiguous
            and all(x.dtype == first.dtype for x in inputs)):
        out = first
        ufunc(out, inputs[1], out=out)
    else:
        out = np.asarray(ufunc(first, inputs[1]))
        if out.shape != shape:
            out = np.array(np.broadcast_to(out, shape))
    for x in inputs[2:]:
        ufunc(out, x, out=out)
    return out
