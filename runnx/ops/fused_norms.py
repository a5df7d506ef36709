"""RMS norms and the SiLU gate of decoders' fused patterns (`interp/fusion/rms_norm_blocks.py`):
RMSNorm, AddRMSNorm (a residual add and the norm reading it, onnxruntime's
SkipSimplifiedLayerNormalization) and SiluMul (the SiLU-gated MLP's activation).

They do the unfused arithmetic in its order (numpy's pairwise summation order, numpy's exp), so
their results are bitwise the unfused graph's. Each row is computed alone, so a prompt's rows are
shared among runnx's threads (`runtime/rows.py`) with the same bits.
"""
from __future__ import annotations

import functools
import math

import numpy as np

from runnx.interp.dtypes import ONNX_TO_NUMPY
from runnx.ops import _kernels_numpy_exp, _native
from runnx.ops._elementwise_util import binary, sigmoid
from runnx.ops._fused_common import DOMAIN, KERNEL_DTYPES, fits
from runnx.ops._kernels_fused import add_rms_norm_into, rms_norm_into, silu_mul_blocks, silu_mul_into
from runnx.ops.contrib_normalization import skip_norm
from runnx.ops.registry import register
from runnx.runtime import defer
from runnx.runtime.rows import share_rows


@register("RMSNorm", since=1, domain=DOMAIN)
def RMSNorm(x, weight, *, epsilon, one, axis: int = -1, to: int = 0):
    """weight * Cast(x * (one / sqrt(ReduceMean(x * x, axis) + epsilon)), to) (to=0: no Cast);
    epsilon and one are numpy scalars of the graph's constants' dtypes (their arithmetic)."""
    if _norm_kernel_applies(x, epsilon, one, weight, axis, to):
        out = np.empty_like(x)
        rows = _rows_of(x)
        share_rows(functools.partial(_rms_norm_rows, x.reshape(rows), epsilon.item(), one.item(), weight,
                                     out.reshape(rows)), *rows)
        return out
    squares = np.square(x)
    mean = np.add.reduce(squares, axis=axis, keepdims=True, dtype=squares.dtype)  # np.sum without its wrapper
    mean = np.true_divide(mean, x.shape[axis], out=mean, casting="unsafe")
    np.add(mean, epsilon, out=mean, casting="unsafe")
    np.sqrt(mean, out=mean)
    normed = np.multiply(x, np.divide(one, mean))
    if to:
        normed = normed.astype(ONNX_TO_NUMPY[to], copy=False)
    return np.multiply(weight, normed)


def _norm_kernel_applies(x, epsilon, one, weight, axis: int, to: int) -> bool:
    """Whether RMSNorm of x is the numba kernel's: a C-contiguous float32/64 x normed over its last
    axis by scalars and a vector weight of its dtype (and no Cast to another)."""
    return (_native.enabled and x.flags.c_contiguous
            and norm_fits(x.dtype, x.ndim, x.shape[-1:], epsilon, one, weight, axis, to, 0))


def rms_norm_applies(x, epsilon, one, weight, axis: int, to: int, cast: int) -> bool:
    """Whether AddRMSNorm's sum x (Cast to `cast`, 0: none) is normed by the numba kernel."""
    return (_native.enabled and x.flags.c_contiguous
            and norm_fits(x.dtype, x.ndim, x.shape[-1:], epsilon, one, weight, axis, to, cast))


def norm_fits(dtype, ndim: int, width: tuple, epsilon, one, weight, axis: int, to: int, cast: int) -> bool:
    """`rms_norm_applies` for a C-contiguous x of this dtype, rank and last dimension (a tuple: () at rank 0)."""
    return bool(dtype in KERNEL_DTYPES and ndim and axis in (-1, ndim - 1) and epsilon.dtype == dtype
                and one.dtype == dtype and weight.dtype == dtype and weight.shape == width and epsilon.size == 1
                and one.size == 1 and epsilon.ndim <= ndim and one.ndim <= ndim and _casts_to_itself(to, dtype)
                and _casts_to_itself(cast, dtype))


def _casts_to_itself(to: int, dtype) -> bool:
    """Whether Cast(to) (0: no Cast) leaves a `dtype` value as it is (float32 exports may cast
    float32 to float32)."""
    return to == 0 or ONNX_TO_NUMPY.get(to) == dtype


@register("AddRMSNorm", since=1, domain=DOMAIN, inplace=(0, 1))
def AddRMSNorm(a, b, weight, *, epsilon, one, axis: int = -1, to: int = 0, cast: int = 0, skip: int = 0,
               overwrite=()):
    """(s, RMSNorm(s)) with s = Cast(a + b, cast) (cast=0: no Cast): a residual add, kept for the
    next one, and the norm reading it. Equal shapes and dtypes, both C-contiguous, no Cast to another
    dtype: one numba call (the sum into a or b when granted). skip=1: the norm is onnxruntime's
    SkipSimplifiedLayerNormalization(a, b, weight, epsilon) as runnx computes it (its statistics in
    float64, `one` unused), which the products patterns take as a norm node."""
    if skip:
        normed, _, _, summed = skip_norm("AddRMSNorm", a, b, weight, None, None, float(epsilon.item()), True, 4)
        return summed, normed
    if (a.shape == b.shape and a.dtype == b.dtype and b.flags.c_contiguous
            and rms_norm_applies(a, epsilon, one, weight, axis, to, cast)):
        residual = a if 0 in overwrite else b if 1 in overwrite else np.empty_like(a)
        out = np.empty_like(a)
        rows = _rows_of(a)
        share_rows(functools.partial(_add_rms_norm_rows, a.reshape(rows), b.reshape(rows), residual.reshape(rows),
                                     epsilon.item(), one.item(), weight, out.reshape(rows)), *rows)
        return residual, out
    residual = binary(np.add, a, b, overwrite)
    if cast:
        residual = residual.astype(ONNX_TO_NUMPY[cast], copy=False)
    return residual, RMSNorm(residual, weight, epsilon=epsilon, one=one, axis=axis, to=to)


@register("SiluMul", since=1, domain=DOMAIN)
def SiluMul(gate, up):
    """gate * Sigmoid(gate) * up: the SiLU-gated MLP's activation."""
    if (_native.enabled and gate.ndim and gate.dtype in KERNEL_DTYPES and up.dtype == gate.dtype
            and up.shape == gate.shape and gate.flags.c_contiguous and up.flags.c_contiguous):
        decay = np.empty_like(gate)
        rows = _rows_of(gate)
        share_rows(functools.partial(_silu_mul_rows, gate.reshape(rows), up.reshape(rows), decay.reshape(rows)), *rows)
        return decay
    activated = sigmoid(gate)
    np.multiply(gate, activated, out=activated)
    if fits(up, activated):
        return np.multiply(activated, up, out=activated)
    return np.multiply(activated, up)


def _rows_of(x) -> tuple[int, int]:
    """(rows, columns) of a C-contiguous x of rank 1 or more, rows over its last axis."""
    columns = x.shape[-1]
    return (x.size // columns if columns else math.prod(x.shape[:-1])), columns


def _rms_norm_rows(x, epsilon: float, one: float, weight, out, start: int, stop: int) -> None:
    rms_norm_into(x[start:stop], epsilon, one, weight, out[start:stop])


def _add_rms_norm_rows(a, b, residual, epsilon: float, one: float, weight, out, start: int, stop: int) -> None:
    add_rms_norm_into(a[start:stop], b[start:stop], residual[start:stop], epsilon, one, weight, out[start:stop])


def _silu_mul_rows(gate, up, decay, start: int, stop: int) -> None:
    """decay[start:stop] = SiLU(gate) * up of those rows: exp(-gate) by numpy (the unfused Sigmoid's
    exp), then `silu_mul_into`, which divides by it; SILU_BLOCK elements at a time, whose three
    passes then read from cache (a long prompt's gate is megabytes: one pass over it each was
    memory's, 2.15 ms for 1000 x 1536 rows against 1.49 in blocks). Elementwise: the same bits.
    float32 rows go in one call (`silu_mul_blocks`, numpy's exp called from it): three Python
    calls a block took the GIL, which the threads sharing the rows then waited for."""
    if gate.dtype == np.float32 and _kernels_numpy_exp.available():
        silu_mul_blocks(_kernels_numpy_exp.EXP, gate[start:stop], up[start:stop], decay[start:stop], SILU_BLOCK)
        return
    step = max(1, SILU_BLOCK // max(1, gate.shape[1]))
    for first in range(start, stop, step):
        last = min(stop, first + step)
        part = np.negative(gate[first:last], out=decay[first:last])
        silu_mul_into(gate[first:last], exp_in_place(part, math.inf), up[first:last])


SILU_BLOCK = 1 << 15  # elements of SiluMul's rows a pass (128 KiB an array: L2 holds all three)


_EXP_FINITE = 88.0  # float32 exp overflows from 88.72 on


def decayed(decay, largest: float):
    """exp(-gate) from a gate block's `decay` output (`_decode_blocks._decay_into`): the block took
    numpy's exp itself where its loop is at hand (`_kernels_numpy_exp.available`), else decay is
    -gate, whose exp numpy takes here (`exp_in_place`)."""
    return decay if _kernels_numpy_exp.available() else exp_in_place(decay, largest)


def exp_in_place(x, largest: float):
    """np.exp(x) into x, whose largest element is `largest` (or more: inf when unknown), with
    numpy's overflow warning silenced (an exp(-gate) of inf is a sigmoid of 0) only when it can
    overflow: numpy's errstate costs a few microseconds."""
    if largest < _EXP_FINITE:
        return np.exp(x, out=x)
    with np.errstate(over="ignore"):
        return np.exp(x, out=x)


def defer_gated_mlp(first, first_arguments: tuple, down, weights: tuple, numbers: tuple, rows: int, width: int,
                    inner: int, both=None) -> tuple:
    """(sum, norm), each (rows, width), of a gated MLP block whose calls are deferred
    (`runtime.defer`) into arrays allocated here: the pool job first(board, workers,
    *first_arguments, loop, summed, gate, decay, up, largest) (an add, norm, the gate and up
    products and exp(-gate): `decayed`), numpy's exp of -gate where the job could not take it, then
    the pool job down(board, workers, gate, exp(-gate), up, *weights, summed, *numbers, sum, norm)
    (SiLU gate, down product, residual add and norm): ResidualGatedMLP's and GatedMLPNBits' `_into`
    blocks. Where the first takes numpy's exp, `both` (the two in one native call, given the
    first's arguments, then *weights, *numbers, sum, norm) is deferred instead: between two calls a
    decode step's worker waits while the calling thread's Python and numba's dispatch, their code
    and data evicted by the gate and up weights, take about 10 us."""
    summed, product, normed = (np.empty((rows, width), np.float32) for _ in range(3))
    gate, decay, up = (np.empty((rows, inner), np.float32) for _ in range(3))
    largest = np.empty(1)
    loop, exp_in_first = _kernels_numpy_exp.EXP, _kernels_numpy_exp.available()
    if both is not None and exp_in_first:
        defer(both, (*first_arguments, loop, summed, gate, decay, up, largest, *weights, *numbers, product, normed),
              job=True)
        return product, normed
    defer(first, (*first_arguments, loop, summed, gate, decay, up, largest), job=True)
    if not exp_in_first:
        defer(_exp_into, (decay, largest))
    defer(down, (gate, decay, up, *weights, summed, *numbers, product, normed), job=True)
    return product, normed


def _exp_into(x, largest) -> None:
    """`exp_in_place` of x whose largest element is `largest`'s one, known only when the call
    before it has run."""
    exp_in_place(x, largest[0])
