"""Shared helpers for elementwise kernels: broadcasting ufunc application with in-place reuse."""
from __future__ import annotations

import numpy as np


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
