"""Shared helpers of the neural-network families: padding rules and strided window views.

Conv and the pooling ops agree on how `auto_pad`, `pads`, `strides`, `dilations` and `ceil_mode`
turn an input shape into an output shape; they all read their windows through `windows`, a
zero-copy strided view of the padded input, so that no kernel loops over pixels in Python.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
from numpy.lib.stride_tricks import as_strided

from runnx.errors import RunnxError
from runnx.ops._matmul import matmul


def spatial_attrs(rank: int, kernel: tuple[int, ...], strides, dilations, pads):
    """strides, dilations and pads with the ONNX defaults (1s and 0s) filled in for `rank` spatial axes."""
    if len(kernel) != rank:
        raise RunnxError(f"kernel_shape {kernel} does not match {rank} spatial dimensions")
    strides = tuple(strides) if strides else (1,) * rank
    dilations = tuple(dilations) if dilations else (1,) * rank
    pads = tuple(pads) if pads else (0,) * (2 * rank)
    if len(strides) != rank or len(dilations) != rank or len(pads) != 2 * rank:
        raise RunnxError(f"strides {strides}, dilations {dilations} or pads {pads} do not match rank {rank}")
    return strides, dilations, pads


class Padding(NamedTuple):
    begin: tuple[int, ...]  # padding before each spatial axis
    end: tuple[int, ...]  # declared (or auto_pad) padding after each axis
    reach: tuple[int, ...]  # padding after each axis that every window fits in (> end under ceil_mode)
    out_shape: tuple[int, ...]


def resolve_padding(in_shape, kernel, strides, dilations, pads, auto_pad: str, ceil_mode: int = 0):
    """The Padding of a sliding window over spatial shape `in_shape`."""
    rank = len(in_shape)
    begin, end, reach, out = [], [], [], []
    for i in range(rank):
        size, k, s, d = in_shape[i], kernel[i], strides[i], dilations[i]
        extent = (k - 1) * d + 1
        if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
            n = -(-size // s)
            total = max(0, (n - 1) * s + extent - size)
            small, large = total // 2, total - total // 2
            b, e = (small, large) if auto_pad == "SAME_UPPER" else (large, small)
        elif auto_pad in ("NOTSET", "VALID"):
            # VALID is zero padding; ceil_mode still applies to it (as in onnxruntime and ONNX shape inference)
            b, e = (pads[i], pads[i + rank]) if auto_pad == "NOTSET" else (0, 0)
            span = size + b + e - extent
            if ceil_mode:
                n = -(-span // s) + 1
                if (n - 1) * s >= size + b:  # the last window would start in the end padding
                    n -= 1
            else:
                n = span // s + 1
        else:
            raise RunnxError(f"unknown auto_pad '{auto_pad}'")
        if n < 1:
            raise RunnxError(f"window of extent {extent} does not fit spatial size {size} (+ padding)")
        begin.append(b)
        end.append(e)
        reach.append(max(e, (n - 1) * s + extent - size - b))
        out.append(n)
    return Padding(tuple(begin), tuple(end), tuple(reach), tuple(out))


def pad_spatial(x: np.ndarray, begin, end, value) -> np.ndarray:
    """x with its trailing spatial axes padded by `value` (no copy when there is nothing to pad)."""
    if not any(begin) and not any(end):
        return x
    lead = x.ndim - len(begin)
    width = [(0, 0)] * lead + [(b, max(e, 0)) for b, e in zip(begin, end)]
    return np.pad(x, width, constant_values=value)


def windows(x: np.ndarray, kernel, strides, dilations, out_shape) -> np.ndarray:
    """Read-only view (*lead, *out_shape, *kernel) of the windows over the trailing spatial axes of x."""
    rank = len(kernel)
    lead = x.ndim - rank
    spatial_strides = x.strides[lead:]
    shape = x.shape[:lead] + tuple(out_shape) + tuple(kernel)
    strides = (x.strides[:lead] + tuple(st * s for st, s in zip(spatial_strides, strides))
               + tuple(st * d for st, d in zip(spatial_strides, dilations)))
    return as_strided(x, shape, strides, writeable=False)


def lowest(dtype: np.dtype):
    """The value that never wins a max: -inf for floats, the minimum for integers."""
    return -np.inf if dtype.kind == "f" else np.iinfo(dtype).min




def convolve(x: np.ndarray, w: np.ndarray, group: int, strides, dilations, begin, end, out_shape) -> np.ndarray:
    """N-d grouped cross-correlation by im2col + one batched BLAS matmul: (N, C, *in) * (M, C/group, *k)."""
    n, channels = x.shape[:2]
    m = w.shape[0]
    kernel = w.shape[2:]
    if channels != w.shape[1] * group or m % group:
        raise RunnxError(f"input channels {channels} and weight {w.shape} do not match group {group}")
    c_group, m_group = channels // group, m // group
    positions = math.prod(out_shape)
    depth = c_group * math.prod(kernel)
    padded = pad_spatial(x, begin, end, 0)
    if all(k == 1 for k in kernel) and all(s == 1 for s in strides):
        cols = padded.reshape(n, group, depth, positions)
    else:
        view = windows(padded, kernel, strides, dilations, out_shape)  # (N, C, *out, *k)
        rank = len(kernel)
        order = (0, 1) + tuple(range(2 + rank, 2 + 2 * rank)) + tuple(range(2, 2 + rank))
        cols = view.transpose(order).reshape(n, group, depth, positions)
    out = matmul(w.reshape(group, m_group, depth), cols)  # (N, G, M/G, positions)
    return out.reshape((n, m) + tuple(out_shape))
