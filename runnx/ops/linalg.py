"""Linear algebra: MatMul (a decode step's rows to the decode pool, a prompt's to runnx's own
kernels or numpy's BLAS: `_matmul.py`), RepeatedKVMatMul, Gemm, Einsum, Det (BLAS/LAPACK through
numpy). The fused nodes built around products: `fused_products.py` and `fused_residual_blocks.py`;
products of 8-bit values: `linalg_integer.py`.

Results keep the input dtype: numpy returns float32 for bfloat16 products (it accumulates in
float32), which is rounded back once, as the ONNX reference does.
"""
from __future__ import annotations

import numpy as np

from runnx.capture.capacity import whole_buffer
from runnx.errors import RunnxError
from runnx.ops import _native
from runnx.ops._kernels_linalg import chunk_count, rows_times_columns, rows_times_matrix
from runnx.ops._matmul import matmul, own_kernels, rest_workers_before, stacked_product
from runnx.ops.fused import DOMAIN as FUSED_DOMAIN, repeated_heads
from runnx.ops.registry import register
from runnx.runtime import defer, pool as decode_pool, take_leave
from runnx.runtime.jobs import FEW_ROWS, few, post_products

# one row times a float, C-contiguous matrix (decoding) goes to runnx's loop shared with the
# decode-pool's workers when there are any (float32, this many elements on: smaller products are done
# before a worker could help); else to the loop on this thread, which keeps up with OpenBLAS's one-row
# kernel or beats it (scripts/bench_gemv.py, with 1 and 2 threads)
_ROW_KERNEL_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
_POOLED_ELEMENTS = 1 << 16
_FLOAT32 = np.dtype(np.float32)


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
    """a @ b; a decode step's few rows times a float32 matrix are a decode pool job, deferred given
    leave (`runtime.defer`: the same job, so the same bits), as are those times a matrix given by
    its columns (finished: an LM head's, the plan's last step)."""
    if take_leave() and _native.enabled and a.flags.c_contiguous and _pooled_rows(a, (b,)):
        rows = _rows(a)
        product = np.empty(rows.size // rows.shape[-1] * b.shape[1], np.float32)
        scratch = np.empty(chunk_count(rows.shape[-1]) * product.size, np.float32)
        defer(post_products, (rows, (b,), (product,), scratch, 0.0, 1.0), job=True)
        return product.reshape(a.shape[:-1] + b.shape[1:])
    workers = decode_pool.pool()
    if workers is not None and a.flags.c_contiguous and _pooled_rows(a, (b,)):
        (product,) = workers.products(_rows(a), (b,))
        return product.reshape(a.shape[:-1] + b.shape[1:])
    if _by_columns(a, b):
        if workers is not None:
            return workers.column_products(_rows(a), b.T).reshape(a.shape[:-1] + b.shape[1:])
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
def RepeatedKVMatMul(a, kv, scale=None, *, repeat: int, transposed: int = 0):
    """MatMul(a, r), r = kv with each head repeated `repeat` times (`fused.repeated_heads`): a KV
    cache's heads repeated for grouped-query attention, as exporters write it with
    Reshape(Expand(Unsqueeze(kv))) and the graph proves (`interp/fusion/matcher.py`); transposed: r's last two axes
    swapped first (Transpose perm (0, 1, 3, 2)); scale: r times that scalar (a Mul after it). The
    query heads sharing a KV head go as one product of their rows against that head, read in place
    in the cache's buffer (r is never made: at a long context it is megabytes a layer a step), each
    element summed as runnx's own kernels sum it for the unfused MatMul, so the same bits
    (`interp/fusion/repeated_kv_products.py`). Where those kernels do not run, the nodes' own
    computation."""
    if kv.ndim != 4:
        raise RunnxError(f"a KV cache whose heads repeat must be (batch, heads, length, depth), got {list(kv.shape)}")
    if _grouped_product_applies(a, kv, scale, repeat, transposed):
        return _grouped_product(a, kv, scale, repeat, transposed)
    repeated = repeated_heads(kv, repeat)
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
