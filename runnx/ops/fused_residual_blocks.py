"""Fused blocks ending in a residual add and a norm (`runnx/interp/fusion/products.py`): a product
with the add and norm after it (MatMulAddRMSNorm, MatMulAddLayerNorm), an MLP from a layer's output
projection to the next norm (ResidualGatedMLP, ResidualGeluMLP), and an attention with its query
projection (ProjectedHeadsAttention). A decode step's row runs each as native calls of
`_decode_blocks.py` posting the decode pool's jobs, and so do a short prompt's rows of
ResidualGatedMLP; anything else the kernels of the nodes they replaced. An RMSNorm layer's
projections, rotary embedding and cache growth: `fused_projected_rope.py`.
"""
from __future__ import annotations

import numpy as np

from runnx.ops import _kernels_numpy_exp, _native
from runnx.ops._decode_blocks import (add_norm_into, gated_down, gated_down_into, gated_down_rows, gelu_mlp,
                                     gelu_mlp_into, open_gated_down_rows, projected_gate, projected_gate_into,
                                     projected_gate_down_into, projected_gate_rows, projected_layer_norm,
                                     projected_layer_norm_into)
from runnx.ops._fused_common import DOMAIN
from runnx.ops._matmul import pooled_prompt
from runnx.ops._remembered import Remembered
from runnx.ops.fused_layer_norm_blocks import ErfGelu, HeadsAttention, add_layer_norm, attended_row
from runnx.ops.fused_norms import AddRMSNorm, decayed, defer_gated_mlp, norm_fits
from runnx.ops.fused_products import _NO_BIAS, SharedInputMatMul, _matrix, _product, _vector
from runnx.ops.linalg import _FLOAT32, MatMul
from runnx.ops.registry import register
from runnx.runtime import defer, pool as decode_pool, prompt_jobs, take_leave


@register("MatMulAddRMSNorm", since=1, domain=DOMAIN)
def MatMulAddRMSNorm(x, weight, bias, residual, norm_weight, *, epsilon, one, axis: int = -1, to: int = 0,
                     cast: int = 0, skip: int = 0):
    """AddRMSNorm(residual, MatMul(x, weight) [+ bias]) (`runnx/interp/fusion/products.py`): the sum
    written into the fresh product (addition commutes: the same sums as the unfused nodes')."""
    return AddRMSNorm(residual, _product(x, weight, bias), norm_weight, epsilon=epsilon, one=one, axis=axis, to=to,
                      cast=cast, skip=skip, overwrite=(1,))


@register("ResidualGatedMLP", since=1, domain=DOMAIN, overlaps_jobs=True)
def ResidualGatedMLP(x, weight, bias, residual, norm_weight, gate_weight, up_weight, down_weight, down_bias,
                     down_norm_weight, *, epsilon, one, down_epsilon, down_one, norm: tuple = (-1, 0, 0),
                     down_norm: tuple = (-1, 0, 0), skip: int = 0):
    """(s, n) = MatMulAddRMSNorm(x, weight, bias, residual, norm_weight; epsilon, one), then
    MatMulAddRMSNorm(SiluMul(n @ gate_weight, n @ up_weight), down_weight, down_bias, s, down_...):
    a decoder layer from its attention's output projection to the next layer's norm
    (`runnx/interp/fusion/products.py`); norm and down_norm are the norms' (axis, to, cast), skip
    whether both are onnxruntime's SkipSimplifiedLayerNormalization (AddRMSNorm's `skip`). A decode
    step's float32 row (no biases, both norms the numba kernel's) runs as two native calls posting
    the decode pool's jobs, numpy's exp of the gate in the first (or between them: `decayed`), and
    so do a short prompt's rows (`_gated_mlp_rows`): bitwise the nodes'. Given leave
    (`runtime/open_jobs.py`), a decode row's two calls are deferred, and with pool workers a short
    prompt's down product is left open, its residual add and norm done once it is finished: the
    next node's checks run while the workers compute it. x may be the output of a job the previous
    node left open (a RepeatedKVAttention's): only its native calls read it."""
    leave = take_leave()  # (for its last job only: its nodes' kernels finish theirs)
    if not x.flags.c_contiguous:  # (a copy of x reads it: x may be a job's output left open, an attention's)
        decode_pool.settle()
    skipped = bool(skip)
    block = _gated_mlp_row(x, weight, bias, residual, epsilon, one, norm_weight, gate_weight, up_weight, down_weight,
                           down_bias, down_epsilon, down_one, down_norm_weight, norm, down_norm)
    if block is not None:
        first, down_numbers = block
        if leave:  # the calls deferred (their `_into` forms: the same jobs, so the same bits)
            summed, normed = defer_gated_mlp(projected_gate_into, (*first, skipped), gated_down_into, (down_weight,),
                                             (*down_numbers, down_norm_weight, skipped), 1, residual.shape[-1],
                                             down_weight.shape[0], projected_gate_down_into)
            return summed.reshape(residual.shape), normed.reshape(residual.shape)
        return _gated_down(decode_pool.shared_call(projected_gate, *first, skipped, _kernels_numpy_exp.EXP), residual,
                           down_weight, down_numbers, down_norm_weight, skipped)
    block = _gated_mlp_rows(x, weight, bias, residual, epsilon, one, norm_weight, gate_weight, up_weight, down_weight,
                            down_bias, down_epsilon, down_one, down_norm_weight, norm, down_norm)
    if block is not None:  # (its post finishes a job left open first)
        first = decode_pool.shared_call(projected_gate_rows, *block[0], skipped, _kernels_numpy_exp.EXP)
        return _gated_down_rows(first, residual, down_weight, block[1], down_norm_weight, skipped, leave)
    decode_pool.settle()  # (every other path reads its inputs before any post)
    axis, to, cast = norm
    summed, normed = MatMulAddRMSNorm(x, weight, bias, residual, norm_weight, epsilon=epsilon, one=one, axis=axis,
                                      to=to, cast=cast, skip=skip)
    (gated,) = SharedInputMatMul(normed, gate_weight, up_weight, gated=(0, 1))
    axis, to, cast = down_norm
    return MatMulAddRMSNorm(gated, down_weight, down_bias, summed, down_norm_weight, epsilon=down_epsilon,
                            one=down_one, axis=axis, to=to, cast=cast, skip=skip)


def _gated_mlp_row(x, weight, bias, residual, epsilon, one, norm_weight, gate_weight, up_weight, down_weight,
                   down_bias, down_epsilon, down_one, down_norm_weight, norm: tuple, down_norm: tuple) -> tuple | None:
    """(`projected_gate`'s arguments, `gated_down`'s numbers) when ResidualGatedMLP is a decode block:
    one float32 row through C-contiguous float32 matrices whose sizes chain, no biases, onto a
    residual of the products' shape, both norms the numba kernel's; else None."""
    if (not _native.enabled or bias is not None or down_bias is not None or x.dtype != _FLOAT32 or not x.ndim
            or x.size != x.shape[-1]
            or residual.dtype != _FLOAT32 or not residual.ndim or not residual.flags.c_contiguous
            or residual.shape != x.shape[:-1] + residual.shape[-1:]):
        return None
    numbers = _gated_block_numbers((x.size, residual.ndim, residual.shape[-1], norm, down_norm, epsilon, one,
                                    down_epsilon, down_one), weight, norm_weight, gate_weight, up_weight, down_weight,
                                   down_norm_weight)
    if numbers is None:
        return None
    return (np.ascontiguousarray(x.reshape(-1)), weight, residual.reshape(-1), *numbers[:2], norm_weight, gate_weight,
            up_weight), numbers[2:]


def _gated_mlp_rows(x, weight, bias, residual, epsilon, one, norm_weight, gate_weight, up_weight, down_weight,
                    down_bias, down_epsilon, down_one, down_norm_weight, norm: tuple, down_norm: tuple) -> tuple | None:
    """(`projected_gate_rows`' arguments, `gated_down_rows`' numbers and unit) when ResidualGatedMLP is
    a short prompt's: `_gated_mlp_row`'s conditions for several rows whose products the own kernels
    share with the decode pool (`pooled_prompt`); else None."""
    if (not _native.enabled or bias is not None or down_bias is not None or x.dtype != _FLOAT32 or x.ndim < 2
            or not x.shape[-1] or residual.dtype != _FLOAT32 or not residual.flags.c_contiguous
            or residual.shape != x.shape[:-1] + residual.shape[-1:]):
        return None
    rows, depth, width = x.size // x.shape[-1], x.shape[-1], residual.shape[-1]
    numbers = _gated_block_numbers((depth, residual.ndim, width, norm, down_norm, epsilon, one, down_epsilon,
                                    down_one), weight, norm_weight, gate_weight, up_weight, down_weight,
                                   down_norm_weight)
    inner = up_weight.shape[-1]
    if (numbers is None or not pooled_prompt(rows, depth, (width,)) or not pooled_prompt(rows, width, (inner, inner))
            or not pooled_prompt(rows, inner, (width,))):
        return None
    units = (prompt_jobs.gemm_unit(width), prompt_jobs.gemm_unit(2 * inner))
    return ((np.ascontiguousarray(x).reshape(rows, depth), weight, residual.reshape(rows, width), *numbers[:2],
             norm_weight, gate_weight, up_weight, units), (*numbers[2:], prompt_jobs.gemm_unit(width)))


def _gated_down_rows(first, residual, down_weight, down_numbers, down_norm_weight, skip: bool, leave: bool):
    """ResidualGatedMLP's outputs from `projected_gate_rows`' results: `decayed`, then `gated_down_rows`,
    or given leave its down product left open to the pool's workers (`open_gated_down_rows`), the
    residual add and norm its tail: the next node's Python runs while they compute it."""
    summed, gate, decay, up, largest = first
    epsilon, one, unit = down_numbers
    decay = decayed(decay, largest)
    if leave and decode_pool.pool() is not None:
        product = np.empty((gate.shape[0], down_weight.shape[1]), np.float32)
        normed = np.empty(product.shape, np.float32)
        if decode_pool.open_shared_call(open_gated_down_rows, (gate, decay, up, down_weight, unit, product),
                                        (down_weight, product), add_norm_into,
                                        (summed, product, epsilon, one, down_norm_weight, skip, normed)):
            return product.reshape(residual.shape), normed.reshape(residual.shape)
    summed, normed = decode_pool.shared_call(gated_down_rows, gate, decay, up, down_weight, summed, epsilon, one,
                                             down_norm_weight, unit, skip)
    return summed.reshape(residual.shape), normed.reshape(residual.shape)


@Remembered
def _gated_block_numbers(values: tuple, weight, norm_weight, gate_weight, up_weight, down_weight,
                         down_norm_weight) -> tuple | None:
    """The two norms' (epsilon, one) as numbers when a ResidualGatedMLP row of this depth onto a
    residual of this rank and width has matrices that chain and norms that are the numba kernel's
    (`_gated_mlp_row`), else None; values: (depth, rank, width, the norms' (axis, to, cast), their
    epsilon and one scalars)."""
    depth, ndim, width, norm, down_norm, epsilon, one, down_epsilon, down_one = values
    inner = up_weight.shape[-1]
    if not (_matrix(weight, depth, width) and _matrix(gate_weight, width, inner) and _matrix(up_weight, width, inner)
            and _matrix(down_weight, inner, width)
            and norm_fits(_FLOAT32, ndim, (width,), epsilon, one, norm_weight, *norm)
            and norm_fits(_FLOAT32, ndim, (width,), down_epsilon, down_one, down_norm_weight, *down_norm)):
        return None
    return epsilon.item(), one.item(), down_epsilon.item(), down_one.item()


def _gated_down(first, residual, down_weight, down_numbers, down_norm_weight, skip: bool):
    """ResidualGatedMLP's outputs from `projected_gate`'s results: `decayed`, then `gated_down`."""
    summed, gate, decay, up, largest = first
    decay = decayed(decay, largest)
    summed, normed = decode_pool.shared_call(gated_down, gate, decay, up, down_weight, summed, *down_numbers,
                                             down_norm_weight, skip)
    return summed.reshape(residual.shape), normed.reshape(residual.shape)


@register("MatMulAddLayerNorm", since=1, domain=DOMAIN, overlaps_jobs=True)
def MatMulAddLayerNorm(x, weight, bias, residual, scale, norm_bias, *, axis: int = -1, epsilon: float = 1e-5,
                       stash_type: int = 1):
    """AddLayerNorm(residual, MatMul(x, weight) [+ bias]), as MatMulAddRMSNorm. A decode step's
    float32 row is one native call posting the product to the decode pool (`_decode_blocks.py`),
    deferred given leave (`runtime.defer`)."""
    leave = take_leave()
    arguments = _layer_norm_row(x, weight, bias, residual, scale, norm_bias, axis, epsilon)
    if arguments is not None:
        return _into_or_now(leave, projected_layer_norm_into, projected_layer_norm, arguments, residual.shape)
    decode_pool.settle()  # (what follows reads the inputs' data)
    return add_layer_norm(residual, MatMul(x, weight), bias, scale, norm_bias, axis, epsilon, stash_type,
                          overwrite=(1,))


def _into_or_now(leave: bool, into, now, arguments: tuple, shape: tuple) -> tuple:
    """A LayerNorm block's (sum, norm) of `shape`: `into`(..., sum, norm) deferred given leave
    (`runtime.defer`), else `now` (the same block allocating them) called at once."""
    if leave:
        width = shape[-1]
        summed, normed = np.empty(width, np.float32), np.empty((1, width), np.float32)
        defer(into, (*arguments, summed, normed), job=True)
    else:
        summed, normed = decode_pool.shared_call(now, *arguments)
    return summed.reshape(shape), normed.reshape(shape)


@register("ResidualGeluMLP", since=1, domain=DOMAIN, overlaps_jobs=True)
def ResidualGeluMLP(x, weight, bias, residual, scale, norm_bias, up_weight, up_bias, down_weight, down_bias,
                    down_scale, down_norm_bias, *, divisor, one, half, norm: tuple = (-1, 1e-5, 1),
                    down_norm: tuple = (-1, 1e-5, 1)):
    """(s, n) = MatMulAddLayerNorm(x, weight, bias, residual, scale, norm_bias), then
    MatMulAddLayerNorm(ErfGelu(n @ up_weight, up_bias; divisor, one, half), down_weight, down_bias,
    s, down_scale, down_norm_bias): a LayerNorm layer from its last attention's output projection to
    the next layer's norm (`runnx/interp/fusion/products.py`); norm and down_norm are the norms'
    (axis, epsilon, stash_type), divisor, one and half ErfGelu's. A decode step's float32 row is one
    native call (`_decode_blocks.py`), deferred given leave (`runtime.defer`); other rows (the
    encoder's) run the four nodes' kernels in turn."""
    leave = take_leave()
    arguments = _gelu_mlp_row(x, weight, bias, residual, scale, norm_bias, up_weight, up_bias, divisor, one, half,
                              down_weight, down_bias, down_scale, down_norm_bias, norm, down_norm)
    if arguments is not None:
        return _into_or_now(leave, gelu_mlp_into, gelu_mlp, arguments, residual.shape)
    decode_pool.settle()  # (what follows reads the inputs' data)
    (axis, epsilon, stash_type), (down_axis, down_epsilon, down_stash_type) = norm, down_norm
    summed, normed = MatMulAddLayerNorm(x, weight, bias, residual, scale, norm_bias, axis=axis, epsilon=epsilon,
                                        stash_type=stash_type)
    activated = ErfGelu(MatMul(normed, up_weight), up_bias, divisor=divisor, one=one, half=half)
    return MatMulAddLayerNorm(activated, down_weight, down_bias, summed, down_scale, down_norm_bias, axis=down_axis,
                              epsilon=down_epsilon, stash_type=down_stash_type)


def _gelu_mlp_row(x, weight, bias, residual, scale, norm_bias, up_weight, up_bias, divisor, one, half, down_weight,
                  down_bias, down_scale, down_norm_bias, norm: tuple, down_norm: tuple) -> tuple | None:
    """ResidualGeluMLP's arguments as `gelu_mlp` takes them when it is one float32 row through
    C-contiguous float32 matrices whose sizes chain, both halves as `_layer_norm_row` needs, its
    GELU constants float32 numbers; else None."""
    (axis, epsilon, _), (down_axis, down_epsilon, _) = norm, down_norm
    first = _layer_norm_row(x, weight, bias, residual, scale, norm_bias, axis, epsilon)
    if first is None or down_axis not in (-1, residual.ndim - 1):
        return None
    numbers = _gelu_numbers((residual.shape[-1], divisor, one, half), up_weight, up_bias, down_weight, down_bias,
                            down_scale, down_norm_bias)
    if numbers is None:
        return None
    return (*first, up_weight, _NO_BIAS if up_bias is None else up_bias, *numbers, down_weight,
            _NO_BIAS if down_bias is None else down_bias, down_scale, down_norm_bias, float(down_epsilon))


@Remembered
def _gelu_numbers(values: tuple, up_weight, up_bias, down_weight, down_bias, down_scale,
                  down_norm_bias) -> tuple | None:
    """The GELU's (divisor, one, half) as numbers when ResidualGeluMLP's second half over rows of
    this width (values: the width, then those three scalars) has C-contiguous float32 matrices that
    chain, float32 vectors and float32 numbers; else None."""
    width, divisor, one, half = values
    inner = up_weight.shape[-1]
    if not (_matrix(up_weight, width, inner) and _matrix(down_weight, inner, width)
            and (up_bias is None or _vector(up_bias, inner)) and (down_bias is None or _vector(down_bias, width))
            and _vector(down_scale, width) and _vector(down_norm_bias, width)
            and all(c.dtype == _FLOAT32 for c in (divisor, one, half))):
        return None
    return float(divisor), float(one), float(half)


def _layer_norm_row(x, weight, bias, residual, scale, norm_bias, axis: int, epsilon: float) -> tuple | None:
    """MatMulAddLayerNorm's arguments as `projected_layer_norm` takes them when it is one float32
    row through a C-contiguous float32 matrix onto a residual of the product's shape, its bias,
    scale and norm bias float32 vectors over the last axis; else None. x and the residual are read
    by the native call only (a pending call may write them: `runtime/open_jobs.py`)."""
    if not (x.flags.c_contiguous and residual.flags.c_contiguous):  # (a copy reads them)
        decode_pool.settle()
    if (not _native.enabled or x.dtype != _FLOAT32 or not x.ndim or x.size != x.shape[-1]
            or residual.dtype != _FLOAT32 or not residual.ndim):
        return None
    width = residual.shape[-1]
    if not (residual.shape == x.shape[:-1] + (width,) and axis in (-1, residual.ndim - 1)
            and _layer_norm_fits((x.size, width), weight, bias, scale, norm_bias)):
        return None
    return (np.ascontiguousarray(x.reshape(-1)), weight, _NO_BIAS if bias is None else bias,
            np.ascontiguousarray(residual.reshape(-1)), scale, norm_bias, float(epsilon))


@Remembered
def _layer_norm_fits(sizes: tuple, weight, bias, scale, norm_bias) -> bool:
    """Whether `_layer_norm_row`'s constants fit a row of this (depth, width): a C-contiguous float32
    matrix, float32 vectors."""
    depth, width = sizes
    return (_matrix(weight, depth, width) and _vector(scale, width) and _vector(norm_bias, width)
            and (bias is None or _vector(bias, width)))


@register("ProjectedHeadsAttention", since=1, domain=DOMAIN, shape_only=(7, 9), overlaps_jobs=True,
          reads_data=(6, 8))
def ProjectedHeadsAttention(x, weight, query_bias, key, value, bias, query_target, query_source, output_target,
                            output_source, *, query_scale=None, head_scale=None, key_scale=None, nan_fill=None,
                            query_dims: tuple[int, ...] = (), query_axes: tuple[int, ...] = (),
                            output_dims: tuple[int, ...] = (), output_axes: tuple[int, ...] = (),
                            key_perm: tuple[int, ...], value_perm: tuple[int, ...]):
    """HeadsAttention(MatMul(x, weight), ...): attention with its query projection
    (`runnx/interp/fusion/products.py`; a decoder's cross-attention). A decode step's float32 row is
    one native call, the product, the query's bias and scale and the attention (`attended_row`),
    deferred given leave (`runtime.defer`)."""
    inputs = (query_bias, key, value, bias)
    targets = (query_target, query_source, output_target, output_source)
    numbers = (query_scale, head_scale, key_scale, nan_fill)
    attrs = {"query_dims": query_dims, "query_axes": query_axes, "output_dims": output_dims,
             "output_axes": output_axes, "key_perm": key_perm, "value_perm": value_perm}
    attended = attended_row(x, weight, *inputs, *numbers, *targets, **attrs, leave=take_leave())
    if attended is not None:
        return attended
    decode_pool.settle()  # (what follows reads the inputs' data)
    return HeadsAttention(MatMul(x, weight), *inputs, *targets, **attrs, query_scale=query_scale,
                          head_scale=head_scale, key_scale=key_scale, nan_fill=nan_fill)
