"""Fused kernels for the patterns `runnx.interp.fusion.layer_norm_blocks` finds (e.g. in encoder-decoder
exports): split-heads attention, erf GELU, residual add with LayerNormalization (private domain
`runnx.fused`; never in a model file).

- HeadsAttention: attention whose heads are split from (batch, length, hidden) by Reshape and
  Transpose, and merged back the same way, the Reshape targets built from other values' shapes.
  The target dimensions are read from those values here, so the Shape/Gather/Unsqueeze/Concat
  nodes that built them no longer run; the query projection's bias is added here too. A decode
  step's one row of batch 1 is one native call (`attended_row`, ProjectedHeadsAttention's too);
  other short queries go to `attend` (fused.py); long queries (the encoder) a block of query rows
  of one head at a time: scores by BLAS into a buffer of up to 16 MiB, the softmax in place (numba,
  vectorised exp), the block's output by BLAS straight into the merged-heads layout.
- SplitHeads: Transpose(Reshape(x + bias)) as one contiguous array: a KV cache entry, and the first
  decoder step's cross-attention keys and values, which every later step then reads in place.
- ErfGelu: x * (erf(x / sqrt 2) + 1) * 0.5 in one pass over cache-sized rows, with the bias of the
  linear layer before it.
- AddLayerNorm: the residual add and the LayerNormalization reading it, the sum kept as an output.

Scale factors other than the query's own are applied to the (small) query instead of the keys,
as in fused.py (the matcher leaves out factors of exactly 1). Anything the fast paths do not cover
(other dtypes, broadcasting between query and keys) takes the unfused nodes' operations.
"""
from __future__ import annotations

import functools

import numba
import numpy as np

from runnx.errors import RunnxError
from runnx.ops import _decode_blocks, _native
from runnx.ops._attention_blocks import pooled_attention
from runnx.ops._elementwise_util import binary, erf
from runnx.ops._fused_common import absent
from runnx.ops._kernels_nn import add_layer_norm_rows
from runnx.ops._kernels_rows import softmax_rows_float32, split_heads_into
from runnx.ops._remembered import Remembered
from runnx.ops.fused import DOMAIN, attend, stand_in
from runnx.ops.normalization import LayerNormalization
from runnx.ops.registry import register
from runnx.ops._shape_util import int_tuple
from runnx.ops.shape import reshape_target
from runnx.ops.softmax import Softmax_13
from runnx.ops._matmul import matmul, own_kernels
from runnx.runtime import defer, settle, take_leave
from runnx.runtime.blas_split import split_among_threads
from runnx.runtime.pool import gelu_rows, shared_call, softmax_rows
from runnx.runtime.rows import share_rows

_ROW_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))  # the LayerNormalization kernel's numba loop
_NO_BIAS = {dtype: absent((0,), dtype) for dtype in _ROW_DTYPES}  # split_heads_into without a bias
_FLOAT32 = np.dtype(np.float32)
_NO_WEIGHT = absent((0, 0))  # attended_row without a query projection
_ATTEND_ROWS = 16  # query rows up to which `attend` (numba, decoding) beats BLAS products a block at a time
# scores per block of query rows at most: 16 MiB of float32, a whole head of an encoder's 1500-row
# attention (blocks the size of an L2 cache were slower: OpenBLAS packs the keys and values again
# for every block)
_BLOCK_SCORES = 1 << 22


def _reshaped(x, given, source, dims: tuple, axes: tuple):
    """Reshape (allowzero 0) of x to `given`, else to dims[i], or dimension axes[i] of `source`
    where axes[i] >= 0."""
    if given is not None:
        target = reshape_target(x.shape, int_tuple(given), 0)
    else:
        target = _target(x.shape, () if source is None else source.shape, dims, axes)
    try:
        return x.reshape(target)
    except ValueError:
        raise RunnxError(f"cannot reshape {x.shape} to {list(target)}") from None


@functools.lru_cache(maxsize=256)
def _target(shape: tuple, source: tuple, dims: tuple, axes: tuple) -> tuple:
    """The Reshape target for an input of `shape`, its 0 entries resolved (see _reshaped)."""
    target = [source[a] if a >= 0 else d for d, a in zip(dims, axes)]
    if 0 in target[len(shape):]:
        raise RunnxError(f"Reshape target {target} copies a dimension the rank-{len(shape)} input lacks")
    return tuple(shape[i] if d == 0 else d for i, d in enumerate(target))


@register("HeadsAttention", since=1, domain=DOMAIN, shape_only=(6, 8), overlaps_jobs=True, reads_data=(5, 7))
def HeadsAttention(query, query_bias, key, value, bias, query_target, query_source, output_target, output_source, *,
                   query_scale=None, head_scale=None, key_scale=None, nan_fill=None, query_dims: tuple[int, ...] = (),
                   query_axes: tuple[int, ...] = (), output_dims: tuple[int, ...] = (),
                   output_axes: tuple[int, ...] = (), key_perm: tuple[int, ...], value_perm: tuple[int, ...]):
    """Reshape(merged @ ..., output target) of the heads attention:
    heads = Transpose(Reshape((query + query_bias) * query_scale, query target), (0, 2, 1, 3)) * head_scale,
    probabilities = Softmax(heads @ (Transpose(key, key_perm) * key_scale) + bias) (NaN -> nan_fill
    when given), merged = Transpose(probabilities @ Transpose(value, value_perm), (0, 2, 1, 3)).
    Targets: query_target/output_target when given, else query_dims/output_dims with dimension a
    of query_source/output_source where the matching *_axes entry a >= 0; absent biases are 0,
    absent scales 1; the scales and the fill are numpy scalars of the graph's constants' dtypes. A
    decode row given leave defers its native call (`attended_row`); the targets are read here."""
    attended = attended_row(query, None, query_bias, key, value, bias, query_scale, head_scale, key_scale, nan_fill,
                            query_target, query_source, output_target, output_source, query_dims=query_dims,
                            query_axes=query_axes, output_dims=output_dims, output_axes=output_axes,
                            key_perm=key_perm, value_perm=value_perm, leave=take_leave())
    if attended is not None:
        return attended
    settle()  # (what follows reads the inputs' data)
    scaled = _biased(query, query_bias)
    if query_scale is not None:
        scaled = np.multiply(scaled, query_scale, out=scaled if scaled is not query else None)
    split = _reshaped(scaled, query_target, query_source, query_dims, query_axes)
    if split.ndim != 4 or key.ndim != 4 or value.ndim != 4:
        raise RunnxError(f"heads attention needs 4-d heads, keys and values, got shapes {list(split.shape)}, "
                         f"{list(key.shape)}, {list(value.shape)}")
    heads = split.transpose(0, 2, 1, 3)
    for factor in (head_scale, key_scale):
        if factor is not None:
            heads = np.multiply(heads, factor)
    keys = key.transpose(key_perm)  # (batch, heads, depth, kv length)
    values = value.transpose(value_perm)
    fill = _fill(nan_fill)
    if not (_native.enabled and _plain(heads, keys, values, bias, nan_fill)):
        merged = _unfused(heads, keys, values, bias, nan_fill).transpose(0, 2, 1, 3)
    elif heads.shape[2] > _ATTEND_ROWS and heads.dtype == np.float32:
        merged = attention_in_blocks(heads, keys, values, bias, fill)
    else:
        merged = attend(heads, keys.swapaxes(2, 3), values, bias, 1.0, fill).transpose(0, 2, 1, 3)
    return _reshaped(merged, output_target, output_source, output_dims, output_axes)


def attended_row(x, weight, query_bias, key, value, bias, query_scale, head_scale, key_scale, nan_fill, query_target,
                 query_source, output_target, output_source, *, query_dims: tuple, query_axes: tuple,
                 output_dims: tuple, output_axes: tuple, key_perm: tuple, value_perm: tuple, leave: bool = False):
    """HeadsAttention of query x @ weight (weight None: x) when that is one float32 row of batch 1
    attending without broadcasting (`_plain`; a NaN fill is `_query_row`'s to check), as one native
    call (`_decode_blocks.attended_row`: the query's product, bias and scale, then the decode pool's
    attention job), else None; given leave, that call deferred (`runtime.defer`: the same call).
    A decode step's HeadsAttention in Python cost ~20 us hot and 2-3x that in a step (its objects
    out of cache). x, key, value and bias are read by the native call only (a pending call may
    write them: `runtime/open_jobs.py`)."""
    if not x.flags.c_contiguous:  # (a copy of x reads it)
        settle()
    if (not _native.enabled or x.dtype != _FLOAT32 or not x.ndim or x.size != x.shape[-1] or head_scale is not None
            or key_scale is not None or key.ndim != 4 or value.ndim != 4):
        return None
    query = _query_row((x.size, query_scale, nan_fill), weight, query_bias)
    if query is None:
        return None
    width, fill = query
    row = np.empty(x.shape[:-1] + (width,), np.float32)
    split = _reshaped(row, query_target, query_source, query_dims, query_axes)
    if split.ndim != 4 or split.shape[:2] != (1, 1):
        return None
    heads = split.transpose(0, 2, 1, 3)
    keys, values = key.transpose(key_perm), value.transpose(value_perm)
    if keys.dtype != _FLOAT32 or not _plain(heads, keys, values, bias, None):
        return None
    if bias is not None:
        bias = bias.reshape((1,) * (4 - bias.ndim) + bias.shape)
    out = np.empty(heads.shape[:3] + values.shape[3:], np.float32)
    arguments = (np.ascontiguousarray(x.reshape(-1)), _NO_WEIGHT if weight is None else weight,
                 _NO_BIAS[_FLOAT32] if query_bias is None else query_bias,
                 _NO_BIAS[_FLOAT32] if query_scale is None else query_scale.reshape(1), row.reshape(-1), heads,
                 keys.swapaxes(2, 3), values, bias, fill, out)
    merged = out.transpose(0, 2, 1, 3)
    if leave and merged.flags.c_contiguous:  # (its Reshape a view: reads nothing)
        defer(_decode_blocks.attended_row, arguments, job=True)
    else:
        shared_call(_decode_blocks.attended_row, *arguments)
    return _reshaped(merged, output_target, output_source, output_dims, output_axes)


@Remembered
def _query_row(values: tuple, weight, query_bias) -> tuple | None:
    """(the query row's width, the fill) for a row of this depth (a 1-tuple) when the weight is
    absent or a C-contiguous float32 matrix, the bias absent or a float32 vector, the scale and the
    fill absent or float32 numbers; else None."""
    depth, query_scale, nan_fill = values
    width = depth if weight is None else weight.shape[-1]
    if ((weight is not None and not (weight.dtype == _FLOAT32 and weight.shape == (depth, width)
                                     and weight.flags.c_contiguous))
            or (query_bias is not None and not (query_bias.dtype == _FLOAT32 and query_bias.shape == (width,)))
            or (query_scale is not None and not _float32_number(query_scale))
            or (nan_fill is not None and not _float32_number(nan_fill))):
        return None
    return width, _fill(nan_fill)


def _fill(nan_fill) -> float:
    """What a NaN softmax row becomes: nan_fill's number, or NaN itself."""
    return np.nan if nan_fill is None else float(nan_fill.reshape(-1)[0])


def _float32_number(x) -> bool:
    return x.dtype == _FLOAT32 and x.size == 1


def _plain(heads, keys, values, bias, nan_fill) -> bool:
    """Whether attention without broadcasting computes what the unfused nodes do: heads, keys and
    values of one dtype and matching batch and head counts, a bias broadcasting into the scores."""
    batch, count, length, depth = heads.shape
    dtype, size = heads.dtype, keys.shape[3]
    if keys.dtype != dtype or values.dtype != dtype or dtype.kind != "f":
        return False
    if keys.shape[:3] != (batch, count, depth) or values.shape[:3] != (batch, count, size):
        return False
    if nan_fill is not None and (nan_fill.dtype != dtype or nan_fill.size != 1):
        return False
    if bias is None:
        return True
    if bias.dtype != dtype or bias.ndim > 4:
        return False
    b0, b1, b2, b3 = (1,) * (4 - bias.ndim) + bias.shape
    return b0 in (1, batch) and b1 in (1, count) and b2 in (1, length) and b3 in (1, size)


def attention_in_blocks(heads, keys, values, bias, fill: float):
    """(batch, length, heads, width) attention output: the decode pool's prompt-attention job
    (`_attention_blocks.pooled_attention`) where runnx's own products run; elsewhere head by head in
    blocks of query rows (whole heads up to `_BLOCK_SCORES` scores), the heads shared among BLAS's
    threads, each running BLAS alone (`runtime/blas_split.py`). When BLAS has one thread, or another
    caller is splitting, one head after the other: with one thread in blocks, with more whole heads,
    since every BLAS product wakes BLAS's threads and many short ones between softmaxes thrash
    (measured 5-20x)."""
    batch, count, length, _ = heads.shape
    size = keys.shape[3]
    merged = np.empty((batch, length, count, values.shape[3]), np.float32)
    if bias is not None:
        bias = np.broadcast_to(bias, (batch, count, length, size))
    if pooled_attention(heads, keys.swapaxes(2, 3), values, bias, None, fill, merged.transpose(0, 2, 1, 3)):
        return merged

    blocks = -(-length // max(1, _BLOCK_SCORES // max(size, 1)))  # of even sizes, not a short last one
    block = max(1, -(-length // max(blocks, 1)))

    def attend_head(part, rows=block, softmax=softmax_rows_float32):
        b, h = part
        buffer = np.empty((rows, size), np.float32)
        for start in range(0, length, rows):
            stop = min(start + rows, length)
            scores = buffer[:stop - start]
            matmul(heads[b, h, start:stop], keys[b, h], out=scores)
            if bias is not None:
                np.add(scores, bias[b, h, start:stop], out=scores)
            softmax(scores, fill)
            matmul(scores, values[b, h], out=merged[b, start:stop, h])

    parts = [(b, h) for b in range(batch) for h in range(count)]
    if not split_among_threads(attend_head, parts, calls_blas=not own_kernels()):
        # more threads: whole heads, the softmax shared with the decode pool's workers
        rows, softmax = (length, softmax_rows) if numba.get_num_threads() > 1 else (block, softmax_rows_float32)
        for part in parts:
            attend_head(part, rows, softmax)
    return merged


_CAUSAL_BLOCK = 256  # query rows a block of causal attention: the keys past a block's last row are skipped
_ABOVE_DIAGONAL = np.triu(np.ones((_CAUSAL_BLOCK, _CAUSAL_BLOCK), bool), 1)  # a block's keys past each row
_ABOVE_DIAGONAL.flags.writeable = False


def causal_attention_in_blocks(heads, keys, values, offset: int):
    """(batch, length, heads, width) causal attention output of scaled float32 heads (batch, heads,
    length, depth) over keys and values (batch, kv_heads, total, depth / width), heads sharing a
    KV head in turn (grouped-query attention): query row i is at position offset + i and sees the
    keys up to it. The decode pool's prompt-attention job (`_attention_blocks.pooled_attention`)
    where runnx's own products run; elsewhere in blocks of `_CAUSAL_BLOCK` query rows, each reading
    only the keys up to its last row (about half the products of the whole score matrix for a first
    prompt), the masked part of a block's last columns set to -inf before the row softmax; the heads
    shared among BLAS's threads as in `attention_in_blocks`."""
    batch, count, length, _ = heads.shape
    groups = keys.shape[1]
    merged = np.empty((batch, length, count, values.shape[3]), np.float32)
    ends = np.arange(offset + 1, offset + length + 1).reshape(1, 1, length)
    if pooled_attention(heads, keys, values, None, ends, 0.0, merged.transpose(0, 2, 1, 3)):
        return merged
    size = min(length, _CAUSAL_BLOCK) * (offset + length)

    def attend_head(part, scratch):
        b, h = part
        g = h // (count // groups)
        for start in range(0, length, _CAUSAL_BLOCK):
            stop = min(start + _CAUSAL_BLOCK, length)
            rows, seen = stop - start, offset + stop
            scores = scratch[:rows * seen].reshape(rows, seen)
            matmul(heads[b, h, start:stop], keys[b, g, :seen].T, out=scores)
            np.copyto(scores[:, offset + start:], -np.inf, where=_ABOVE_DIAGONAL[:rows, :rows])
            softmax_rows_float32(scores, 0.0)
            matmul(scores, values[b, g, :seen], out=merged[b, start:stop, h])

    parts = [(b, h) for b in range(batch) for h in range(count)]
    if not split_among_threads(lambda part: attend_head(part, np.empty(size, np.float32)), parts,
                               calls_blas=not own_kernels()):
        scratch = np.empty(size, np.float32)
        for part in parts:
            attend_head(part, scratch)
    return merged


def _unfused(heads, keys, values, bias, nan_fill):
    """The unfused nodes' operations: (batch, heads, length, width) (heads and batch may broadcast)."""
    scores = matmul(heads, keys)
    if bias is not None:
        scores = np.add(scores, bias)
    probabilities = Softmax_13(scores, axis=-1, overwrite=(0,))
    if nan_fill is not None:
        probabilities = np.where(np.isnan(probabilities), nan_fill, probabilities)
    return matmul(probabilities, values)


def _biased(x, bias):
    """x + bias (a fresh array), or x itself without a bias."""
    return x if bias is None else np.add(bias, x)


@register("SplitHeads", since=1, domain=DOMAIN, shape_only=(3,))
def SplitHeads(x, bias, target, source, *, dims: tuple[int, ...] = (), axes: tuple[int, ...] = ()):
    """Transpose(Reshape(x + bias, target), (0, 2, 1, 3)) as a C-contiguous array (absent bias: 0);
    the target as in HeadsAttention. Rows of a plain (batch, length, hidden) x are split and biased
    in one pass (`split_heads_into`); one row needs no copy, only the bias add."""
    if _splits_in_one_pass(x, bias):
        split = _reshaped(x, target, source, dims, axes)
        batch, length, heads, depth = split.shape if split.ndim == 4 else (0, 0, 0, 0)
        if x.shape == (batch, length, heads * depth):
            out = np.empty((batch, heads, length, depth), x.dtype)
            split_heads_into(x, _NO_BIAS[x.dtype] if bias is None else bias, out)
            return out
    split = _reshaped(_biased(x, bias), target, source, dims, axes)
    if split.ndim != 4:
        raise RunnxError(f"splitting heads needs a 4-d target, got shape {list(split.shape)}")
    return np.ascontiguousarray(split.transpose(0, 2, 1, 3))


def split_shape(x, target, source, dims: tuple, axes: tuple) -> tuple:
    """The shape SplitHeads gives x (RunnxError when the target does not fit it)."""
    split = _reshaped(x, target, source, dims, axes)
    return split.shape[:1] + split.shape[2:3] + split.shape[1:2] + split.shape[3:] if split.ndim == 4 else ()


@register("SplitHeadsShape", since=1, domain=DOMAIN, shape_only=(0, 1, 3))
def SplitHeadsShape(x, weight, target, source, *, dims: tuple[int, ...] = (), axes: tuple[int, ...] = ()):
    """A stand-in with the shape of SplitHeads(x @ weight, None, target, source) (zero strides), for
    nodes that only read the shape of split heads a fused node computes inside itself."""
    product = stand_in(x.dtype, x.shape[:-1] + weight.shape[-1:])
    return stand_in(x.dtype, split_shape(product, target, source, dims, axes))


def _splits_in_one_pass(x, bias) -> bool:
    """Whether `split_heads_into` can split x (batch, length, hidden) with its bias added: more than
    one row (one needs no copy: a decode step's keys and values skip this), float32 or float64,
    C-contiguous, the bias absent or a vector over the hidden axis."""
    return (_native.enabled and x.ndim == 3 and x.shape[1] > 1 and x.dtype in _ROW_DTYPES and x.flags.c_contiguous
            and (bias is None or (bias.shape == x.shape[2:] and bias.dtype == x.dtype)))


@register("AddLayerNorm", since=1, domain=DOMAIN, inplace=(0, 1))
def AddLayerNorm(a, b, scale, bias, *, axis: int = -1, epsilon: float = 1e-5, stash_type: int = 1, overwrite=()):
    """(s, LayerNormalization(s, scale, bias)) with s = a + b: a residual add, kept for the next one,
    and the norm reading it (onnxruntime's SkipLayerNormalization)."""
    return add_layer_norm(a, b, None, scale, bias, axis, epsilon, stash_type, overwrite)


def add_layer_norm(a, b, offset, scale, bias, axis: int, epsilon: float, stash_type: int, overwrite=()):
    """AddLayerNorm(a, b + offset) (offset None: b; MatMulAddLayerNorm's product and its bias).
    float32/float64 rows of one shape with vector scale, bias and offset over the last axis are one
    numba pass (`add_layer_norm_rows`: the sum, written into a or b when granted, and its norm);
    anything else numpy's adds (broadcasting) and the LayerNormalization kernel."""
    dtype, columns = a.dtype, a.shape[-1] if a.ndim else 0
    if (_native.enabled and axis in (-1, a.ndim - 1) and dtype in _ROW_DTYPES and a.size and a.shape == b.shape
            and b.dtype == dtype
            and a.flags.c_contiguous and b.flags.c_contiguous and _row_vector(scale, columns, dtype)
            and _row_vector(bias, columns, dtype) and (offset is None or _row_vector(offset, columns, dtype))):
        summed = a if 0 in overwrite else b if 1 in overwrite else np.empty(a.shape, dtype)
        out = np.empty(a.shape, dtype)
        rows = (a.size // columns, columns)
        share_rows(functools.partial(_add_layer_norm_rows, a.reshape(rows), b.reshape(rows),
                                     _NO_BIAS[dtype] if offset is None else offset, scale, bias, float(epsilon),
                                     summed.reshape(rows), out.reshape(rows)), *rows)
        return summed, out
    if offset is not None:
        b = binary(np.add, b, offset, (0,) if 1 in overwrite else ())
    residual = binary(np.add, a, b, overwrite)
    return residual, LayerNormalization(residual, scale, bias, axis=axis, epsilon=epsilon, stash_type=stash_type)[0]


def _add_layer_norm_rows(a, b, offset, scale, bias, epsilon: float, summed, out, start: int, stop: int) -> None:
    add_layer_norm_rows(a[start:stop], b[start:stop], offset, scale, bias, epsilon, summed[start:stop], out[start:stop])


def _row_vector(v, columns: int, dtype) -> bool:
    """Whether v is a vector over a row of `columns` of this dtype (a decode step asks once: no generator)."""
    return v is not None and v.shape == (columns,) and v.dtype == dtype


@register("ErfGelu", since=1, domain=DOMAIN)
def ErfGelu(x, bias=None, *, divisor, one, half):
    """((v * (Erf(v / divisor) + one)) * half with v = x + bias (bias absent: v = x): the erf GELU
    and the bias add of the linear layer before it; divisor, one and half are numpy scalars of the
    graph's constants' dtypes (their arithmetic)."""
    fast = (_native.enabled and x.dtype == np.float32 and x.ndim >= 1 and x.size
            and all(c.dtype == np.float32 for c in (divisor, one, half))
            and (bias is None or (bias.dtype == np.float32 and bias.shape in ((x.shape[-1],), (1, x.shape[-1])))))
    if not fast:
        v = x if bias is None else np.add(x, bias)
        return np.multiply(np.multiply(v, np.add(erf(np.divide(v, divisor)), one)), half)
    columns = x.shape[-1]
    rows = np.ascontiguousarray(x).reshape(-1, columns)
    out = np.empty(rows.shape, np.float32)
    row_bias = np.zeros(0, np.float32) if bias is None else np.ascontiguousarray(bias).reshape(columns)
    gelu_rows(rows, row_bias, divisor, one, half, out)
    return out.reshape(x.shape)
