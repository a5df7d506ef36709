"""Linear algebra: MatMul, Gemm, Einsum, Det (BLAS/LAPACK through numpy), and the fused nodes built
around one-row products (`runnx/interp/fusion/products.py`), whose decode rows are native calls of
`_decode_blocks.py` (an RMSNorm layer's own two: `decoder_layers.py`). Products of 8-bit values:
`linalg_integer.py`.

Results keep the input dtype: numpy returns float32 for bfloat16 products (it accumulates in
float32), which is rounded back once, as the ONNX reference does.
"""
from __future__ import annotations

import numpy as np

from runnx.capture.capacity import prefix_room, whole_buffer
from runnx.errors import RunnxError
from runnx.ops import _native
from runnx.ops._decode_blocks import (appended_products, attended_gelu_mlp, attended_layer_norm, gated_down,
                                     gated_down_rows, gelu_mlp, projected_gate, projected_gate_rows,
                                     projected_layer_norm)
from runnx.ops._kernels_linalg import rows_times_columns, rows_times_matrix
from runnx.ops._matmul import (matmul, own_kernels, pooled_prompt, rest_workers_before, shared_input_products,
                               stacked_product)
from runnx.ops._remembered import Remembered
from runnx.ops.cache import Concat, count_appends
from runnx.ops.fused import DOMAIN as FUSED_DOMAIN, head_repeat, materialised_repeat
from runnx.ops.fused_norms import AddRMSNorm, SiluMul, exp_in_place, norm_fits
from runnx.ops.fused_layer_norm_blocks import (ErfGelu, HeadsAttention, SplitHeads, add_layer_norm, attended_row, attention_row,
                                     split_shape)
from runnx.ops.registry import register
from runnx.runtime import pool as decode_pool
from runnx.runtime.jobs import FEW_ROWS, few

# one row times a float, C-contiguous matrix (decoding) goes to runnx's loop shared with the
# decode-pool's workers when there are any (float32, this many elements on: smaller products are done
# before a worker could help); else to the loop on this thread, which keeps up with OpenBLAS's one-row
# kernel or beats it (scripts/bench_gemv.py, with 1 and 2 threads)
_ROW_KERNEL_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
_POOLED_ELEMENTS = 1 << 16
_FLOAT32 = np.dtype(np.float32)
_NO_BIAS = np.zeros(0, np.float32)


def _in_dtype(result, dtype):
    return np.asarray(result).astype(dtype, copy=False)


def _few_rows(a, b) -> bool:
    """Whether a @ b is one row (decoding) or a few (a short prompt, see `few`) times a float,
    C-contiguous matrix."""
    return (_native.enabled and b.ndim == 2 and a.ndim and a.shape[-1] == b.shape[0] and a.size and a.dtype == b.dtype
            and a.dtype in _ROW_KERNEL_DTYPES and b.flags.c_contiguous and few(a.size // b.shape[0], b.shape[1]))


def _pooled_rows(x, weights) -> bool:
    """Whether every x @ w is one or a few float32 rows times a C-contiguous float32 matrix of at
    least _POOLED_ELEMENTS (`_few_rows` and the pool's checks, in one pass over the weights)."""
    depth = x.shape[-1] if x.ndim else 0
    if x.dtype != _FLOAT32 or not x.size or not depth:
        return False
    height = x.size // depth
    for w in weights:
        if not (w.dtype == _FLOAT32 and w.ndim == 2 and w.shape[0] == depth and w.size >= _POOLED_ELEMENTS
                and w.flags.c_contiguous and few(height, w.shape[1])):
            return False
    return True


def _rows(x):
    """x as the pool's products take it: one row as a vector, a few as a matrix (whatever x's rank:
    the products job is compiled once for each of those two, not once per rank)."""
    return x.reshape(-1) if x.size == x.shape[-1] else x.reshape(-1, x.shape[-1])


def _by_columns(a, b) -> bool:
    """Whether a @ b is a few float32 rows times a large matrix given by its columns (b.T C-contiguous:
    a tied LM head's transposed embedding, kept a view of it: `folding.py`)."""
    return (_native.enabled and b.ndim == 2 and b.dtype == _FLOAT32 and a.dtype == _FLOAT32 and a.size
            and a.shape[-1] == b.shape[0] and b.size >= _POOLED_ELEMENTS and not b.flags.c_contiguous
            and b.T.flags.c_contiguous and a.size // b.shape[0] <= FEW_ROWS)


@register("MatMul", since=1, overlaps_jobs=True)
def MatMul(a, b):
    """a @ b; a decode step's few rows times a float32 matrix go to the decode pool, whose job may be
    left open (`runtime/pool.py`), as do those times a matrix given by its columns."""
    workers = decode_pool.pool()
    if workers is not None and a.flags.c_contiguous and _pooled_rows(a, (b,)):
        (product,) = workers.products(_rows(a), (b,), leave_open=True)
        return product.reshape(a.shape[:-1] + b.shape[1:])
    if _by_columns(a, b):
        if workers is not None:
            return workers.column_products(_rows(a), b.T, leave_open=True).reshape(a.shape[:-1] + b.shape[1:])
        decode_pool.settle()
        rows = np.ascontiguousarray(a).reshape(-1, b.shape[0])
        return rows_times_columns(rows, b.T).reshape(a.shape[:-1] + b.shape[1:])
    decode_pool.settle()  # a may be the output of a job left open
    if _few_rows(a, b):
        return rows_times_matrix(np.ascontiguousarray(a).reshape(-1, b.shape[0]), b).reshape(a.shape[:-1] + b.shape[1:])
    matrix_rows = a.size // a.shape[-1] if b.ndim == 2 and a.shape[-1] else None  # (a product by a matrix)
    rest_workers_before(a.size * b.shape[-1], matrix_rows)
    if a.ndim > 2 and b.ndim == 2 and a.flags.c_contiguous:
        # one GEMM over all leading rows instead of numpy's GEMM (or GEMV) per batch entry
        rows = matmul(a.reshape(-1, a.shape[-1]), b)
        return _in_dtype(rows.reshape(a.shape[:-1] + (b.shape[1],)), a.dtype)
    return _in_dtype(matmul(a, b), a.dtype)


@register("RepeatedKVMatMul", since=1, domain=FUSED_DOMAIN)
def RepeatedKVMatMul(a, kv, axes, expand, target, scale=None, *, transposed: int = 0):
    """MatMul(a, r), r = Reshape(Expand(Unsqueeze(kv, axes), expand), target): a KV cache's heads
    repeated for grouped-query attention as exporters write it; transposed: r's last two axes
    swapped first (Transpose perm (0, 1, 3, 2)); scale: r times that scalar (a Mul after it). The
    query heads sharing a KV head go as one product of their rows against that head, read in place
    in the cache's buffer (r is never made: at a long context it is megabytes a layer a step), each
    element summed as runnx's own kernels sum it for the unfused MatMul, so the same bits
    (`interp/fusion/repeated_kv_products.py`). Where those kernels do not run, or the shapes are not
    a plain head repeat, the nodes' own computation."""
    shapes = head_repeat(kv, axes, expand, target)
    repeat = shapes[3]
    if repeat is not None and _grouped_product_applies(a, kv, scale, repeat, transposed):
        return _grouped_product(a, kv, scale, repeat, transposed)
    repeated = materialised_repeat(kv, shapes)
    if transposed:
        repeated = np.transpose(repeated, (0, 1, 3, 2))
    if scale is not None:
        repeated = np.multiply(repeated, scale)
    return MatMul(a, repeated)


def _grouped_product_applies(a, kv, scale, repeat: int, transposed: int) -> bool:
    """Whether the unfused MatMul of float32 heads (B, G * repeat, S, D) would run on runnx's own
    kernels, which sum each element alike whatever rows come with it."""
    return (_native.enabled and a.dtype == _FLOAT32 and kv.dtype == _FLOAT32 and a.ndim == 4 and a.size and kv.size
            and a.shape[:2] == (kv.shape[0], kv.shape[1] * repeat) and a.shape[3] == kv.shape[3 if transposed else 2]
            and (scale is None or (scale.dtype == _FLOAT32 and scale.size == 1 and scale.ndim <= 4)) and own_kernels())


def _grouped_product(a, kv, scale, repeat: int, transposed: int):
    batch, groups = kv.shape[:2]
    steps = a.shape[2]
    rows = np.ascontiguousarray(a).reshape(batch, groups, repeat * steps, a.shape[3])
    # the Mul's products, of the cache's heads only; else the heads read in place, each the first rows of its
    # head in a C-contiguous buffer (`stacked_product` reads no row past those)
    heads = np.multiply(kv, scale) if scale is not None else _whole_heads(kv)
    columns = kv.shape[2] if transposed else kv.shape[3]
    out = np.empty((batch, groups, repeat * steps, columns), _FLOAT32)
    for b in range(batch):
        stacked_product(rows[b], heads[b], out[b], bool(transposed))
    return out.reshape(batch, groups * repeat, steps, columns)


def _whole_heads(kv):
    """kv (B, G, T, D) itself when C-contiguous, else the capacity buffer (B, G, capacity, D) it is
    the prefix of, else a C-contiguous copy."""
    if kv.flags.c_contiguous:
        return kv
    buffer = whole_buffer(kv, 2)
    return buffer if buffer is not None and buffer.flags.c_contiguous else np.ascontiguousarray(kv)


@register("SharedInputMatMul", since=1, domain=FUSED_DOMAIN, overlaps_jobs=True)
def SharedInputMatMul(x, *inputs, splits: tuple = (), gated: tuple = ()):
    """(MatMul(x, w) for w in weights): the products of one input (a layer's query, key and value
    projections; its gate and up projections), matched by `runnx/interp/fusion/products.py`. A
    decode step's one-row products go to the decode pool as one job (one hand-off, not three), and
    so do a short prompt's (`shared_input_products`), each the bits of its MatMul.
    inputs: the weights, then (bias, target, source) of SplitHeads for each (position, dims, axes)
    of `splits`: product `position` comes out with its heads split. gated (gate, up): those two
    products come out as one, SiluMul(gate, up), after the others."""
    count = len(inputs) - 3 * len(splits)
    weights = inputs[:count]
    if (workers := decode_pool.pool()) is not None and x.flags.c_contiguous and _pooled_rows(x, weights):
        lead = x.shape[:-1]
        rows = workers.products(_rows(x), weights, leave_open=not (splits or gated))
        products = [product.reshape(lead + w.shape[1:]) for product, w in zip(rows, weights)]
    elif x.ndim and x.shape[-1] and (rows := shared_input_products(x.reshape(-1, x.shape[-1]), weights)) is not None:
        products = [product.reshape(x.shape[:-1] + w.shape[1:]) for product, w in zip(rows, weights)]
    else:
        products = [MatMul(x, w) for w in weights]
        decode_pool.settle()  # (MatMul may leave its job open)
    for n, (position, dims, axes) in enumerate(splits):
        bias, target, source = inputs[count + 3 * n:count + 3 * n + 3]
        products[position] = SplitHeads(products[position], bias, target, source, dims=dims, axes=axes)
    if gated:
        gate, up = gated
        return (*(p for i, p in enumerate(products) if i not in gated), SiluMul(products[gate], products[up]))
    return tuple(products)


@register("ProjectedAppend", since=1, domain=FUSED_DOMAIN, inplace=(1, 2), shape_only=(8, 11))
def ProjectedAppend(x, past_key, past_value, query_weight, key_weight, value_weight, key_bias, key_target, key_source,
                    value_bias, value_target, value_source, *, key_dims: tuple[int, ...] = (),
                    key_axes: tuple[int, ...] = (), value_dims: tuple[int, ...] = (),
                    value_axes: tuple[int, ...] = (), key_axis: int, value_axis: int, overwrite=(), ctx=None):
    """(x @ query_weight, Concat(past_key, SplitHeads(x @ key_weight, key_bias, ...)),
    Concat(past_value, SplitHeads(x @ value_weight, value_bias, ...))): a decoder layer's projections
    and its KV cache growth (a self-attention's; `runnx/interp/fusion/products.py`). A decode
    step's float32 row with both caches granted and room in their buffers is one native call
    (`appended_products`) writing the new rows in place; anything else the nodes' kernels."""
    if 1 in overwrite and 2 in overwrite:
        appended = append_arguments(x, past_key, past_value, query_weight, key_weight, value_weight, key_bias,
                                    key_target, key_source, value_bias, value_target, value_source, key_dims, key_axes,
                                    value_dims, value_axes, key_axis, value_axis)
        if appended is not None:
            query = decode_pool.shared_call(appended_products, np.ascontiguousarray(x.reshape(-1)), *appended)
            return appended_outputs(query, x.shape, appended, ctx)
    query, key, value = SharedInputMatMul(x, query_weight, key_weight, value_weight, key_bias, key_target, key_source,
                                          value_bias, value_target, value_source,
                                          splits=((1, key_dims, key_axes), (2, value_dims, value_axes)))
    return (query, Concat(past_key, key, axis=key_axis, overwrite=(0,) if 1 in overwrite else (), ctx=ctx),
            Concat(past_value, value, axis=value_axis, overwrite=(0,) if 2 in overwrite else (), ctx=ctx))


def append_arguments(x, past_key, past_value, query_weight, key_weight, value_weight, key_bias, key_target,
                     key_source, value_bias, value_target, value_source, key_dims, key_axes, value_dims, value_axes,
                     key_axis, value_axis) -> tuple | None:
    """`appended_products`' arguments after the mailbox, workers and row in ProjectedAppend's decode
    case: one float32 row of batch 1 (x, read for its shape and dtype only), C-contiguous float32
    matrices, caches of 4 float32 dimensions growing along axis 2, prefix views of buffers with room
    for the row, whose heads split as the caches hold them. None when any of that does not hold."""
    if (not _native.enabled or key_axis not in (2, -2) or value_axis not in (2, -2)
            or past_key.base is past_value.base):
        return None
    shapes = _split_shapes(x, (key_weight, value_weight), ((key_target, key_source, key_dims, key_axes),
                                                           (value_target, value_source, value_dims, value_axes)))
    if shapes is None or not _query_and_biases_fit((x.size, *shapes), query_weight, key_bias, value_bias):
        return None
    position = append_position(past_key, past_value, shapes)
    if position < 0:
        return None
    return ((query_weight, key_weight, value_weight), _NO_BIAS if key_bias is None else key_bias,
            _NO_BIAS if value_bias is None else value_bias, past_key.base, past_value.base, position)


def append_position(past_key, past_value, shapes: tuple) -> int:
    """Where `appended_products` writes a step's key and value rows: the caches' length, when both
    are float32 prefix views of 4 dimensions of float32 buffers with room for a row, their heads
    split as `shapes` (the key's and the value's products, (1, heads, 1, depth)); else -1."""
    position = past_key.shape[2] if past_key.ndim == 4 else -1
    for past, shape in zip((past_key, past_value), shapes):
        buffer = past.base
        if (past.dtype != _FLOAT32 or past.ndim != 4 or type(buffer) is not np.ndarray or buffer.dtype != _FLOAT32
                or buffer.ndim != 4 or past.shape[2] != position or prefix_room(past, buffer, 2) < 1
                or shape != (1, past.shape[1], 1, past.shape[3])):
            return -1
    return position


def appended_outputs(query, shape: tuple, arguments: tuple, ctx) -> tuple:
    """ProjectedAppend's outputs after `appended_products` with `arguments` gave the query row: the
    query shaped as an x of `shape`, the caches grown by a row (views of their buffers), the new
    rows counted in a profile."""
    key_buffer, value_buffer, position = arguments[3:]
    key, value = key_buffer[:, :, :position + 1], value_buffer[:, :, :position + 1]
    if ctx is not None and ctx.profile is not None:  # the new rows' views only for the counters
        count_appends(ctx, key[:, :, -1:], value[:, :, -1:])
    return query.reshape(shape[:-1] + query.shape), key, value


@Remembered
def _query_and_biases_fit(shapes: tuple, query_weight, key_bias, value_bias) -> bool:
    """Whether ProjectedAppend's query matrix (a row's depth, then the key's and the value's split
    shapes) is C-contiguous float32 and its biases absent or float32 vectors of the splits' widths."""
    depth, key_shape, value_shape = shapes
    return (_matrix(query_weight, depth, query_weight.shape[-1])
            and all(bias is None or _vector(bias, shape[1] * shape[3])
                    for bias, shape in ((key_bias, key_shape), (value_bias, value_shape))))


def _split_shapes(x, weights, splits) -> tuple | None:
    """The (1, heads, 1, depth) shapes of x @ weight split into heads, for each weight and (target,
    source, dims, axes) of its split, when x is one float32 row of batch 1 and the matrices
    C-contiguous float32; else None."""
    if x.dtype != _FLOAT32 or x.ndim != 3 or x.size != x.shape[-1]:
        return None
    return _heads_shapes((x.size, tuple([split[2:] for split in splits])), *weights,
                         *[array for split in splits for array in split[:2]])


@Remembered
def _heads_shapes(values: tuple, *arrays) -> tuple | None:
    """`_split_shapes` for a row of this depth: values (depth, (dims, axes) of each split), arrays
    the weights, then each split's target and source."""
    depth, attributes = values
    count = len(attributes)
    shapes = []
    for n, weight in enumerate(arrays[:count]):
        if not _matrix(weight, depth, weight.shape[-1]):
            return None
        target, source = arrays[count + 2 * n:count + 2 * n + 2]
        shape = split_shape(np.empty((1, 1, weight.shape[1]), np.float32), target, source, *attributes[n])
        if len(shape) != 4 or shape[0] != 1 or shape[2] != 1:
            return None
        shapes.append(shape)
    return tuple(shapes)


@register("BiasedMatMul", since=1, domain=FUSED_DOMAIN)
def BiasedMatMul(x, weight, bias):
    """Add(MatMul(x, weight), bias) for a constant 1-D bias (`runnx/interp/fusion/products.py`): the
    sum written into the fresh product (the same additions as the Add node's)."""
    product = MatMul(x, weight)
    if bias.dtype == product.dtype and product.ndim and bias.shape[0] in (1, product.shape[-1]):
        return np.add(product, bias, out=product)
    return np.add(product, bias)


@register("MatMulAddRMSNorm", since=1, domain=FUSED_DOMAIN)
def MatMulAddRMSNorm(x, weight, bias, residual, epsilon, one, norm_weight, *, axis: int = -1, to: int = 0,
                     cast: int = 0):
    """AddRMSNorm(residual, MatMul(x, weight) [+ bias]) (`runnx/interp/fusion/products.py`): the sum
    written into the fresh product (addition commutes: the same sums as the unfused nodes')."""
    return AddRMSNorm(residual, _product(x, weight, bias), epsilon, one, norm_weight, axis=axis, to=to, cast=cast,
                      overwrite=(1,))


@register("ResidualGatedMLP", since=1, domain=FUSED_DOMAIN)
def ResidualGatedMLP(x, weight, bias, residual, epsilon, one, norm_weight, gate_weight, up_weight, down_weight,
                     down_bias, down_epsilon, down_one, down_norm_weight, *, norm: tuple = (-1, 0, 0),
                     down_norm: tuple = (-1, 0, 0)):
    """(s, n) = MatMulAddRMSNorm(x, weight, bias, residual, epsilon, one, norm_weight), then
    MatMulAddRMSNorm(SiluMul(n @ gate_weight, n @ up_weight), down_weight, down_bias, s, down_...):
    a decoder layer from its attention's output projection to the next layer's norm
    (`runnx/interp/fusion/products.py`); norm and down_norm are the norms' (axis, to, cast). A decode
    step's float32 row (no biases, both norms the numba kernel's) runs as two native calls posting
    the decode pool's jobs, numpy's exp between them (`_decode_blocks.py`), and so do a short
    prompt's rows (`_gated_mlp_rows`): bitwise the nodes'."""
    block = _gated_mlp_row(x, weight, bias, residual, epsilon, one, norm_weight, gate_weight, up_weight, down_weight,
                           down_bias, down_epsilon, down_one, down_norm_weight, norm, down_norm)
    if block is not None:
        return _gated_down(decode_pool.shared_call(projected_gate, *block[0]), residual, down_weight, block[1],
                           down_norm_weight)
    block = _gated_mlp_rows(x, weight, bias, residual, epsilon, one, norm_weight, gate_weight, up_weight, down_weight,
                            down_bias, down_epsilon, down_one, down_norm_weight, norm, down_norm)
    if block is not None:
        return _gated_down_rows(decode_pool.shared_call(projected_gate_rows, *block[0]), residual, down_weight,
                                block[1], down_norm_weight)
    axis, to, cast = norm
    summed, normed = MatMulAddRMSNorm(x, weight, bias, residual, epsilon, one, norm_weight, axis=axis, to=to,
                                      cast=cast)
    (gated,) = SharedInputMatMul(normed, gate_weight, up_weight, gated=(0, 1))
    axis, to, cast = down_norm
    return MatMulAddRMSNorm(gated, down_weight, down_bias, summed, down_epsilon, down_one, down_norm_weight,
                            axis=axis, to=to, cast=cast)


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
    numbers = _gated_block_numbers((x.size, residual.ndim, residual.shape[-1], norm, down_norm), weight, epsilon, one,
                                   norm_weight, gate_weight, up_weight, down_weight, down_epsilon, down_one,
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
    numbers = _gated_block_numbers((depth, residual.ndim, width, norm, down_norm), weight, epsilon, one, norm_weight,
                                   gate_weight, up_weight, down_weight, down_epsilon, down_one, down_norm_weight)
    inner = up_weight.shape[-1]
    if (numbers is None or not pooled_prompt(rows, depth, (width,)) or not pooled_prompt(rows, width, (inner, inner))
            or not pooled_prompt(rows, inner, (width,))):
        return None
    units = (decode_pool.gemm_unit(width), decode_pool.gemm_unit(2 * inner))
    return ((np.ascontiguousarray(x).reshape(rows, depth), weight, residual.reshape(rows, width), *numbers[:2],
             norm_weight, gate_weight, up_weight, units), (*numbers[2:], decode_pool.gemm_unit(width)))


def _gated_down_rows(first, residual, down_weight, down_numbers, down_norm_weight):
    """ResidualGatedMLP's outputs from `projected_gate_rows`' results: numpy's exp, then `gated_down_rows`."""
    summed, gate, decay, up, largest = first
    epsilon, one, unit = down_numbers
    summed, normed = decode_pool.shared_call(gated_down_rows, gate, exp_in_place(decay, largest), up, down_weight,
                                             summed, epsilon, one, down_norm_weight, unit)
    return summed.reshape(residual.shape), normed.reshape(residual.shape)


@Remembered
def _gated_block_numbers(values: tuple, weight, epsilon, one, norm_weight, gate_weight, up_weight, down_weight,
                         down_epsilon, down_one, down_norm_weight) -> tuple | None:
    """The two norms' (epsilon, one) as numbers when a ResidualGatedMLP row of this depth onto a
    residual of this rank and width has matrices that chain and norms that are the numba kernel's
    (`_gated_mlp_row`), else None."""
    depth, ndim, width, norm, down_norm = values
    inner = up_weight.shape[-1]
    if not (_matrix(weight, depth, width) and _matrix(gate_weight, width, inner) and _matrix(up_weight, width, inner)
            and _matrix(down_weight, inner, width)
            and norm_fits(_FLOAT32, ndim, (width,), epsilon, one, norm_weight, *norm)
            and norm_fits(_FLOAT32, ndim, (width,), down_epsilon, down_one, down_norm_weight, *down_norm)):
        return None
    return epsilon.item(), one.item(), down_epsilon.item(), down_one.item()


def _gated_down(first, residual, down_weight, down_numbers, down_norm_weight):
    """ResidualGatedMLP's outputs from `projected_gate`'s results: numpy's exp, then `gated_down`."""
    summed, gate, decay, up, largest = first
    summed, normed = decode_pool.shared_call(gated_down, gate, exp_in_place(decay, largest), up, down_weight, summed,
                                             *down_numbers, down_norm_weight)
    return summed.reshape(residual.shape), normed.reshape(residual.shape)


def _matrix(w, depth: int, width: int) -> bool:
    return w.dtype == _FLOAT32 and w.shape == (depth, width) and w.flags.c_contiguous


@register("MatMulAddLayerNorm", since=1, domain=FUSED_DOMAIN)
def MatMulAddLayerNorm(x, weight, bias, residual, scale, norm_bias, *, axis: int = -1, epsilon: float = 1e-5,
                       stash_type: int = 1):
    """AddLayerNorm(residual, MatMul(x, weight) [+ bias]), as MatMulAddRMSNorm. A decode step's
    float32 row is one native call posting the product to the decode pool (`_decode_blocks.py`)."""
    arguments = _layer_norm_row(x, weight, bias, residual, scale, norm_bias, axis, epsilon)
    if arguments is not None:
        summed, normed = decode_pool.shared_call(projected_layer_norm, *arguments)
        return summed.reshape(residual.shape), normed.reshape(residual.shape)
    return add_layer_norm(residual, MatMul(x, weight), bias, scale, norm_bias, axis, epsilon, stash_type,
                          overwrite=(1,))


@register("ResidualGeluMLP", since=1, domain=FUSED_DOMAIN)
def ResidualGeluMLP(x, weight, bias, residual, scale, norm_bias, up_weight, up_bias, divisor, one, half, down_weight,
                    down_bias, down_scale, down_norm_bias, *, norm: tuple = (-1, 1e-5, 1),
                    down_norm: tuple = (-1, 1e-5, 1)):
    """(s, n) = MatMulAddLayerNorm(x, weight, bias, residual, scale, norm_bias), then
    MatMulAddLayerNorm(ErfGelu(n @ up_weight, up_bias, divisor, one, half), down_weight, down_bias,
    s, down_scale, down_norm_bias): a LayerNorm layer from its last attention's output projection to
    the next layer's norm (`runnx/interp/fusion/products.py`); norm and down_norm are the norms'
    (axis, epsilon, stash_type). A decode step's float32 row is one native call
    (`_decode_blocks.py`); other rows (the encoder's) run the four nodes' kernels in turn."""
    arguments = _gelu_mlp_row(x, weight, bias, residual, scale, norm_bias, up_weight, up_bias, divisor, one, half,
                              down_weight, down_bias, down_scale, down_norm_bias, norm, down_norm)
    if arguments is not None:
        summed, normed = decode_pool.shared_call(gelu_mlp, *arguments)
        return summed.reshape(residual.shape), normed.reshape(residual.shape)
    (axis, epsilon, stash_type), (down_axis, down_epsilon, down_stash_type) = norm, down_norm
    summed, normed = MatMulAddLayerNorm(x, weight, bias, residual, scale, norm_bias, axis=axis, epsilon=epsilon,
                                        stash_type=stash_type)
    activated = ErfGelu(MatMul(normed, up_weight), up_bias, divisor, one, half)
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
    numbers = _gelu_numbers((residual.shape[-1],), up_weight, up_bias, down_weight, down_bias, down_scale,
                            down_norm_bias, divisor, one, half)
    if numbers is None:
        return None
    return (*first, up_weight, _NO_BIAS if up_bias is None else up_bias, *numbers, down_weight,
            _NO_BIAS if down_bias is None else down_bias, down_scale, down_norm_bias, float(down_epsilon))


@Remembered
def _gelu_numbers(width: tuple, up_weight, up_bias, down_weight, down_bias, down_scale, down_norm_bias, divisor, one,
                  half) -> tuple | None:
    """The GELU's (divisor, one, half) as numbers when ResidualGeluMLP's second half over rows of
    this width has C-contiguous float32 matrices that chain, float32 vectors and numbers; else None."""
    (width,), inner = width, up_weight.shape[-1]
    if not (_matrix(up_weight, width, inner) and _matrix(down_weight, inner, width)
            and (up_bias is None or _vector(up_bias, inner)) and (down_bias is None or _vector(down_bias, width))
            and _vector(down_scale, width) and _vector(down_norm_bias, width)
            and all(c.dtype == _FLOAT32 and c.size == 1 for c in (divisor, one, half))):
        return None
    return float(divisor.reshape(-1)[0]), float(one.reshape(-1)[0]), float(half.reshape(-1)[0])


def _layer_norm_row(x, weight, bias, residual, scale, norm_bias, axis: int, epsilon: float) -> tuple | None:
    """MatMulAddLayerNorm's arguments as `projected_layer_norm` takes them when it is one float32
    row through a C-contiguous float32 matrix onto a residual of the product's shape, its bias,
    scale and norm bias float32 vectors over the last axis; else None."""
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


@register("ProjectedHeadsAttention", since=1, domain=FUSED_DOMAIN, shape_only=(11, 13))
def ProjectedHeadsAttention(x, weight, query_bias, key, value, bias, query_scale, head_scale, key_scale, nan_fill,
                            query_target, query_source, output_target, output_source, *,
                            query_dims: tuple[int, ...] = (), query_axes: tuple[int, ...] = (),
                            output_dims: tuple[int, ...] = (), output_axes: tuple[int, ...] = (),
                            key_perm: tuple[int, ...], value_perm: tuple[int, ...]):
    """HeadsAttention(MatMul(x, weight), ...): attention with its query projection
    (`runnx/interp/fusion/products.py`; a decoder's cross-attention). A decode step's float32 row is
    one native call, the product, the query's bias and scale and the attention (`attended_row`)."""
    inputs = (query_bias, key, value, bias, query_scale, head_scale, key_scale, nan_fill, query_target, query_source,
              output_target, output_source)
    attrs = _attention_attrs(query_dims, query_axes, output_dims, output_axes, key_perm, value_perm)
    attended = attended_row(x, weight, *inputs, **attrs)
    return attended if attended is not None else HeadsAttention(MatMul(x, weight), *inputs, **attrs)


@register("AttentionLayerNorm", since=1, domain=FUSED_DOMAIN, shape_only=(11, 13))
def AttentionLayerNorm(query, query_weight, query_bias, key, value, bias, query_scale, head_scale, key_scale, nan_fill,
                       query_target, query_source, output_target, output_source, weight, out_bias, residual, scale,
                       norm_bias, *, query_dims: tuple[int, ...] = (), query_axes: tuple[int, ...] = (),
                       output_dims: tuple[int, ...] = (), output_axes: tuple[int, ...] = (),
                       key_perm: tuple[int, ...], value_perm: tuple[int, ...], norm: tuple = (-1, 1e-5, 1)):
    """MatMulAddLayerNorm(a, weight, out_bias, residual, scale, norm_bias) of the attention a =
    HeadsAttention(query [@ query_weight], ...) (`runnx/interp/fusion/products.py`; a decoder's
    self-attention, its output projection and the cross-attention's norm); norm is the norm's (axis,
    epsilon, stash_type). A decode step's float32 row is one native call (`attended_layer_norm`)."""
    attention = (query, query_weight, query_bias, key, value, bias, query_scale, head_scale, key_scale, nan_fill,
                 query_target, query_source, output_target, output_source)
    attrs = _attention_attrs(query_dims, query_axes, output_dims, output_axes, key_perm, value_perm)
    axis, epsilon, stash_type = norm
    row = attention_row(*attention, **attrs)
    block = row and _layer_norm_row(row[1], weight, out_bias, residual, scale, norm_bias, axis, epsilon)
    if block and row[1].flags.c_contiguous:  # the block's row is then a view of the attention's output
        summed, normed = decode_pool.shared_call(attended_layer_norm, *row[0], *block)
        return summed.reshape(residual.shape), normed.reshape(residual.shape)
    return MatMulAddLayerNorm(_heads_attention(*attention, **attrs), weight, out_bias, residual, scale, norm_bias,
                              axis=axis, epsilon=epsilon, stash_type=stash_type)


@register("AttentionGeluMLP", since=1, domain=FUSED_DOMAIN, shape_only=(11, 13))
def AttentionGeluMLP(query, query_weight, query_bias, key, value, bias, query_scale, head_scale, key_scale, nan_fill,
                     query_target, query_source, output_target, output_source, weight, out_bias, residual, scale,
                     norm_bias, up_weight, up_bias, divisor, one, half, down_weight, down_bias, down_scale,
                     down_norm_bias, *, query_dims: tuple[int, ...] = (), query_axes: tuple[int, ...] = (),
                     output_dims: tuple[int, ...] = (), output_axes: tuple[int, ...] = (),
                     key_perm: tuple[int, ...], value_perm: tuple[int, ...], norm: tuple = (-1, 1e-5, 1),
                     down_norm: tuple = (-1, 1e-5, 1)):
    """ResidualGeluMLP(a, weight, out_bias, residual, scale, norm_bias, up_weight, ...) of the
    attention a = HeadsAttention(query [@ query_weight], ...) (`runnx/interp/fusion/products.py`;
    a decoder's cross-attention and the rest of its layer, an encoder's attention and MLP). A decode
    step's float32 row is one native call (`attended_gelu_mlp`)."""
    attention = (query, query_weight, query_bias, key, value, bias, query_scale, head_scale, key_scale, nan_fill,
                 query_target, query_source, output_target, output_source)
    attrs = _attention_attrs(query_dims, query_axes, output_dims, output_axes, key_perm, value_perm)
    mlp = (weight, out_bias, residual, scale, norm_bias, up_weight, up_bias, divisor, one, half, down_weight, down_bias,
           down_scale, down_norm_bias)
    row = attention_row(*attention, **attrs)
    block = row and _gelu_mlp_row(row[1], *mlp, norm, down_norm)
    if block and row[1].flags.c_contiguous:  # the block's row is then a view of the attention's output
        summed, normed = decode_pool.shared_call(attended_gelu_mlp, *row[0], *block)
        return summed.reshape(residual.shape), normed.reshape(residual.shape)
    return ResidualGeluMLP(_heads_attention(*attention, **attrs), *mlp, norm=norm, down_norm=down_norm)


def _attention_attrs(query_dims, query_axes, output_dims, output_axes, key_perm, value_perm) -> dict:
    """HeadsAttention's attributes as its keyword arguments."""
    return {"query_dims": query_dims, "query_axes": query_axes, "output_dims": output_dims,
            "output_axes": output_axes, "key_perm": key_perm, "value_perm": value_perm}


def _heads_attention(query, query_weight, *inputs, **attrs):
    """HeadsAttention of query, projected by query_weight first when there is one."""
    if query_weight is None:
        return HeadsAttention(query, *inputs, **attrs)
    return ProjectedHeadsAttention(query, query_weight, *inputs, **attrs)


def _vector(v, width: int) -> bool:
    return v is not None and v.dtype == _FLOAT32 and v.shape == (width,) and v.flags.c_contiguous


def _product(x, weight, bias):
    return MatMul(x, weight) if bias is None else BiasedMatMul(x, weight, bias)


@register("Gemm", since=1)
def Gemm_1(a, b, c, *, alpha: float = 1.0, beta: float = 1.0, transA: int = 0, transB: int = 0,
           broadcast: int = 0):
    # before opset 7 C broadcasts only with broadcast=1; numpy's rules give the same result then
    if not broadcast and c.shape != (a.shape[1 if transA else 0], b.shape[0 if transB else 1]):
        raise RunnxError(f"Gemm C of shape {c.shape} needs broadcast=1 (before opset 7)")
    return Gemm(a, b, c, alpha=alpha, beta=beta, transA=transA, transB=transB)


@register("Gemm", since=7)
def Gemm(a, b, c=None, *, alpha: float = 1.0, beta: float = 1.0, transA: int = 0, transB: int = 0):
    dtype = a.dtype
    product = matmul(a.T if transA else a, b.T if transB else b)
    if alpha != 1.0:
        product = product * (dtype.type(alpha) if dtype.kind == "f" else alpha)
    if c is not None and beta != 0.0:
        product = product + (c * (dtype.type(beta) if dtype.kind == "f" else beta) if beta != 1.0 else c)
    return _in_dtype(product, dtype)


@register("Einsum", since=12)
def Einsum(*inputs, equation: str):
    equation = equation.replace(" ", "")
    if not equation:
        raise RunnxError("Einsum equation is empty")
    dtype = inputs[0].dtype
    if dtype.name == "bfloat16":
        # numpy's einsum has no bfloat16 loops: accumulate in float32, round once
        return _in_dtype(np.einsum(equation, *(x.astype(np.float32) for x in inputs), optimize=True), dtype)
    return _in_dtype(np.einsum(equation, *inputs, optimize=True), dtype)


@register("Det", since=11)
def Det(x):
    if x.dtype in (np.float32, np.float64):
        return np.asarray(np.linalg.det(x))
    # LAPACK has no half-precision routines: factorise in float32 and round the result once
    return _in_dtype(np.linalg.det(x.astype(np.float32)), x.dtype)
