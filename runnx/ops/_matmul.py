"""Which kernel multiplies two float32 matrices: runnx's own (`_kernels_gemm.py`, AVX-512) where
numpy's BLAS runs narrower than the CPU or where the weights come cold from memory, else numpy's BLAS.

Every product of a prompt or an encoder goes through `matmul`, so a fused op and the graph it
replaces take the same kernel for the same shapes and round alike. The own kernels take every
product when numba compiles for AVX-512 and every BLAS numpy loaded is OpenBLAS with kernels that
are not AVX-512 ones (OPENBLAS_CORETYPE=Haswell on such a CPU: `own_kernels`). Where OpenBLAS runs
its AVX-512 kernels they take a short prompt's products by a matrix (fewer than SHORT_ROWS rows, b
2-D: `own_product`): such a product reads each weight from memory for a few dozen rows, and the own
kernels fetch the next block of it while they compute the current one, where OpenBLAS waits for
it; from a few hundred rows OpenBLAS's kernels compute faster. MKL is left its products.
Their results do not depend on the thread count: a short prompt's product has its columns shared
with the decode pool's workers (`runtime/pool.py`), a larger product of at least _SPLIT_FROM
multiply-adds its rows among runnx's threads (`runtime/helpers.py`), each element summed alike. Where
they take every float32 product, small ones too, a row comes out the same in a prompt of any length
or a block of one (where they take the short ones only, in any prompt shorter than SHORT_ROWS); up to
FEW_ROWS rows they pack nothing (`gemm.few_rows`, the same arithmetic).
"""
from __future__ import annotations

import threading

import numpy as np

from runnx.ops import _kernels_gemm as gemm, _native
from runnx.runtime import blas_split, helpers
from runnx.runtime import pool as decode_pool, prompt_jobs
from runnx.runtime.jobs import few, post_gemm

_AVX512_OPENBLAS = {"skylakex", "cooperlake", "sapphirerapids"}  # OpenBLAS's AVX-512 kernel sets
_SPLIT_FROM = 1 << 26  # multiply-adds (half a millisecond and more) from which a product is shared among threads
# a product of fewer rows (a short prompt's) and at least _POOL_FROM multiply-adds shares its columns
# with the decode pool's workers, spinning in native code, when the process has them: handing a
# part to a helper thread costs a tenth of a millisecond, a pool job a few microseconds
_POOL_ROWS, _POOL_FROM = 2 * gemm.MC, 1 << 21
# up to this many rows (a decode step's products, an attention's heads) a product that stays on one
# thread is summed without packing anything (`gemm.few_rows`: the same bits); from 4 rows packing pays
FEW_ROWS = 2
SHORT_ROWS = _POOL_ROWS  # a product by a matrix of fewer rows takes the own kernels wherever BLAS is OpenBLAS
_FLOAT32 = np.dtype(np.float32)
_scratch = threading.local()
_enabled: bool | None = None  # every product on the own kernels
_short: bool | None = None  # a short prompt's products by a matrix on the own kernels


def own_kernels() -> bool:
    """Whether float32 products run on runnx's own kernels in this process (module docstring)."""
    global _enabled
    if _enabled is None:
        libraries = blas_split.blas_libraries()
        _enabled = gemm.WIDE and bool(libraries) and all(
            c.internal_api == "openblas" and (getattr(c, "architecture", None) or "").lower() not in _AVX512_OPENBLAS
            for c in libraries)
    return _enabled


def _short_products() -> bool:
    """Whether a short prompt's products by a matrix run on the own kernels in this process (module
    docstring): numba compiles for AVX-512 and every BLAS numpy loaded is OpenBLAS. (With AVX2 the
    tiles hold half the sums, and OpenBLAS's AVX2 kernels multiply faster at every row count: the
    own kernels 0.52-0.91x its speed on a Zen 3 core, scripts/bench_gemm.py, and 0.6-0.75x with
    the weights cold from memory.)"""
    global _short
    if _short is None:
        libraries = blas_split.blas_libraries()
        _short = gemm.WIDE and bool(libraries) and all(c.internal_api == "openblas" for c in libraries)
    return _short


def own_product(rows: int, matrix: bool) -> bool:
    """Whether a float32 product of `rows` rows (all of a's) by b runs on the own kernels; `matrix`:
    b is 2-D (a weight, a panel of one)."""
    return _native.enabled and (own_kernels() or (matrix and rows < SHORT_ROWS and _short_products()))


def set_own_kernels(enabled: bool | None) -> None:
    """Force the choice (tests and benchmarks compare the two): True every product on the own
    kernels, False none; None: detect it again."""
    global _enabled, _short
    _enabled = _short = None if enabled is None else bool(enabled) and gemm.AVAILABLE


def rest_workers_before(multiply_adds: int, rows: int | None = None) -> None:
    """Let the decode pool's spinning workers sleep before a product of `multiply_adds` that numpy's
    BLAS computes (its threads need the cores); not when runnx's own kernels take it (`rows`: a
    product of so many rows by a matrix; None: of stacks): they share a short prompt's with the
    workers, or rest them before they split one among helper threads (`_matrix_product`)."""
    own = own_product(rows, True) if rows is not None else _native.enabled and own_kernels()
    if not own:
        decode_pool.rest_workers(multiply_adds)


def _takes(a, b) -> bool:
    return (a.dtype == _FLOAT32 and b.dtype == _FLOAT32 and a.ndim >= 2 and b.ndim >= 2 and a.shape[-1] == b.shape[-2]
            and a.size and b.size and own_product(a.size // a.shape[-1], b.ndim == 2))


def _writable(out, shape) -> bool:
    """Whether the kernels can write a product of `shape` straight into out (rows contiguous)."""
    return (out.dtype == _FLOAT32 and out.shape == shape and out.strides[-1] == 4 and out.flags.writeable
            and all(step >= 0 and step % 4 == 0 for step in out.strides))


def _buffers():
    """This thread's scratch: a's panels, b's last columns' panel, an edge tile, a block of b's
    panels (packed from b's columns) and a streamed product's sums (`gemm.product_columns`)."""
    buffers = getattr(_scratch, "buffers", None)
    if buffers is None:
        buffers = _scratch.buffers = (np.empty(gemm.MC * gemm.KC, np.float32), np.empty(gemm.KC * gemm.NR, np.float32),
                                      np.empty((gemm.MR, gemm.NR), np.float32),
                                      np.empty(gemm.KC * gemm.BLOCK_COLUMNS, np.float32),
                                      np.empty((gemm.STREAMED_ROWS, gemm.STREAMED_COLUMNS), np.float32))
    return buffers


def _read_only(array):
    """array as a read-only view: the kernels are compiled (and loaded from numba's cache) once for
    a weight, which is read-only, and a computed value alike."""
    if array.flags.writeable:
        array = array.view()
        array.flags.writeable = False
    return array


def _product(part):
    a, b, out, first_column, stop_column, columns_given = part
    a_panels, b_panel, edge, b_block, sums = _buffers()
    gemm.product_columns(_read_only(a), _read_only(b), out, first_column, stop_column, a_panels, b_panel, edge,
                         columns_given, b_block, sums)


def shared_input_products(a, weights: tuple) -> list | None:
    """[a @ w for w in weights] (each C-contiguous) as one job of the decode pool's (`columns_products`:
    one hand-off for all, each element the bits of its product alone) when a is a short prompt's
    C-contiguous float32 rows (M, K) whose products MatMul would give runnx's own kernels one by
    one (`_matrix_product`) and each weight a C-contiguous float32 (K, N); else None, nothing done."""
    rows, depth = a.shape
    if (not 1 < len(weights) <= decode_pool.MAX_MATRICES or a.dtype != _FLOAT32 or not a.flags.c_contiguous
            or not own_product(rows, True)):
        return None
    for w in weights:  # (few rows by a narrow weight: MatMul's products loop, whose sums are not these)
        if (w.dtype != _FLOAT32 or w.ndim != 2 or w.shape[0] != depth or not w.flags.c_contiguous
                or few(rows, w.shape[1])):
            return None
    if not _pooled(rows, rows * depth * sum(w.shape[1] for w in weights)):
        return None
    outs = tuple([np.empty((rows, w.shape[1]), np.float32) for w in weights])
    if not prompt_jobs.columns_products(_read_only(a), tuple([_read_only(w) for w in weights]), outs):
        return None
    return list(outs)


def _pooled(rows: int, multiply_adds: int) -> bool:
    """Whether a product of `rows` rows and `multiply_adds` is a short prompt's that the decode pool's
    threads share by columns (`columns_product`, `columns_products`) rather than one thread's."""
    return FEW_ROWS < rows < _POOL_ROWS and multiply_adds >= _POOL_FROM and not helpers.inside_parts()


def pooled_prompt(rows: int, depth: int, widths: tuple) -> bool:
    """Whether float32 products of a short prompt's `rows` C-contiguous rows of `depth` by C-contiguous
    matrices of these widths (one job of them all) are those MatMul and SharedInputMatMul give the
    own kernels and share with the decode pool by columns: a native block posting `post_gemm(s)` for
    them then computes their bits."""
    return (own_product(rows, True) and _pooled(rows, rows * depth * sum(widths))
            and not any(few(rows, width) for width in widths))


def _matrix_product(a, b, out, columns_given: bool = False) -> None:
    """out = a @ b for 2-D C-contiguous a and b (b.T when `columns_given`: b's columns as its rows),
    out's rows contiguous."""
    rows, columns = a.shape[0], out.shape[1]
    multiply_adds = rows * a.shape[1] * columns
    threads = blas_split.blas_threads() if multiply_adds >= _SPLIT_FROM else 1
    if _pooled(rows, multiply_adds) and prompt_jobs.columns_product(_read_only(a), _read_only(b), out, columns_given):
        return
    if rows <= FEW_ROWS and threads < 2 and out.flags.c_contiguous:
        gemm.few_rows(_read_only(a), _read_only(b), out, columns_given, np.empty(columns, np.float32))
        return
    panels = -(-columns // gemm.NR)
    if threads < 2 or (rows < threads * gemm.MC and panels < threads):
        _product((a, b, out, 0, columns, columns_given))
        return
    decode_pool.rest_workers()  # spinning decode workers would hold the cores
    if rows >= threads * gemm.MC:  # each thread its rows (its own part of a to pack)
        tiles = -(-rows // gemm.MR)
        bounds = [min(rows, (tiles * t // threads) * gemm.MR) for t in range(threads + 1)]
        parts = [(a[start:stop], b, out[start:stop], 0, columns, columns_given)
                 for start, stop in zip(bounds[:-1], bounds[1:])]
    else:  # a short prompt: each thread its columns
        bounds = [min(columns, (panels * t // threads) * gemm.NR) for t in range(threads + 1)]
        parts = [(a, b, out, start, stop, columns_given) for start, stop in zip(bounds[:-1], bounds[1:])]
    helpers.run_parts(_product, parts)


def matmul(a, b, out=None):
    """np.matmul(a, b, out=out), float32 products of matrices (or stacks of them) on the own kernels
    when they take them (`own_product`)."""
    if not _takes(a, b):
        return np.matmul(a, b) if out is None else np.matmul(a, b, out=out)
    batch = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    shape = batch + (a.shape[-2], b.shape[-1])
    if out is not None and (not _writable(out, shape) or np.may_share_memory(out, a) or np.may_share_memory(out, b)):
        out[...] = matmul(a, b)
        return out
    result = np.empty(shape, np.float32) if out is None else out
    if b.ndim == 2 and a.flags.c_contiguous and result.flags.c_contiguous:  # all rows times b: one product
        matrix, columns_given = _rows_or_columns(b)
        _matrix_product(a.reshape(-1, a.shape[-1]), matrix, result.reshape(-1, shape[-1]), columns_given)
        return result
    if (a.shape[-2] <= FEW_ROWS and a.shape[:-2] == batch and b.shape[:-2] == batch and result.flags.c_contiguous
            and a.shape[-2] * b.shape[-2] * b.shape[-1] < _SPLIT_FROM):
        _few_rows_stack(a, b, result)  # an attention's heads: one call, nothing packed
        return result
    a, b = np.broadcast_to(a, batch + a.shape[-2:]), np.broadcast_to(b, batch + b.shape[-2:])
    for index in np.ndindex(batch):
        matrix, columns_given = _rows_or_columns(b[index])
        _matrix_product(np.ascontiguousarray(a[index]), matrix, result[index], columns_given)
    return result


def _few_rows_stack(a, b, out) -> None:
    """out = a @ b for stacks of one shape whose matrices have at most FEW_ROWS rows, in one call of
    `gemm.few_rows_stack` (b's matrices read by their rows, or by their columns when those are
    contiguous: a transposed operand)."""
    depth, columns = b.shape[-2:]
    a_stack = np.ascontiguousarray(a).reshape(-1, a.shape[-2], depth)
    b_stack = b.reshape(-1, depth, columns)
    columns_given = not b_stack.flags.c_contiguous and b_stack.transpose(0, 2, 1).flags.c_contiguous
    b_stack = b_stack.transpose(0, 2, 1) if columns_given else np.ascontiguousarray(b_stack)
    stacked_product(a_stack, b_stack, out.reshape(-1, a.shape[-2], columns), columns_given)


# rows of a stack's matrices up to which `stacked_product` packs nothing: a cache head's depth (64)
# is short, so packing its columns pays later than a weight's (FEW_ROWS)
GROUPED_FEW_ROWS = 4


def stacked_product(a, b, out, columns_given: bool) -> None:
    """out[s] = a[s] @ b[s] for C-contiguous stacks a (S, M, K), out (S, M, N) and b (S, K', N) or,
    columns given, (S, N', K), whose matrices may hold rows past the K (N) read (a KV cache's heads
    in their capacity buffer): up to GROUPED_FEW_ROWS rows unpacked (`few_rows_stack`), more packed
    (`_matrix_product`), the same bits either way (module docstring)."""
    if a.shape[1] <= GROUPED_FEW_ROWS:
        gemm.few_rows_stack(_read_only(a), _read_only(b), out, columns_given, np.empty(out.shape[2], np.float32))
        return
    used = out.shape[2] if columns_given else a.shape[2]
    for s in range(a.shape[0]):
        _matrix_product(a[s], b[s, :used], out[s], columns_given)


def _rows_or_columns(b):
    """(b, False) with b's rows contiguous, or (b.T, True) when b's columns are (a transposed
    operand, a weight panel dequantized by columns): the kernel packs those, no copy is made."""
    if not b.flags.c_contiguous and b.T.flags.c_contiguous:
        return b.T, True
    return np.ascontiguousarray(b), False


def load_kernels() -> None:
    """Load the kernels from numba's cache (or compile them) for the types their calls give them: an
    output with contiguous rows and one without (a head's rows in a merged-heads layout); a few
    rows times b by its rows or its columns, alone and in stacks; a short prompt's pool job
    (`runtime.jobs.post_gemm`, run alone here), b by its rows and by its columns."""
    if own_product(FEW_ROWS + 1, True):
        for columns_given in (False, True):
            decode_pool.alone(post_gemm, _read_only(np.ones((FEW_ROWS + 1, 2), np.float32)),
                              _read_only(np.ones((2, 2), np.float32)), np.empty((FEW_ROWS + 1, 2), np.float32),
                              columns_given, gemm.NR)
        many = np.ones((FEW_ROWS + 1, 1), np.float32)
        matmul(many, many[:1])
        matmul(many, many[:1], out=np.empty((FEW_ROWS + 1, 2), np.float32)[:, :1])
        row, columns = np.ones((1, 3), np.float32), np.ones((2, 3), np.float32)
        matmul(row, columns.T)
        matmul(row, np.ones((3, 2), np.float32))
    if own_product(FEW_ROWS + 1, False):  # stacks: an attention's heads
        row, columns = np.ones((1, 3), np.float32), np.ones((2, 3), np.float32)
        matmul(row.reshape(1, 1, 3), columns.reshape(1, 2, 3).transpose(0, 2, 1))
        matmul(row.reshape(1, 1, 3), np.ones((1, 3, 2), np.float32))
        heads = np.ones((2, 3, 3), np.float32)  # a cache's heads in their buffer, two rows of three read
        stacked_product(np.ones((2, 3, 2), np.float32), heads, np.empty((2, 3, 3), np.float32), False)
        stacked_product(np.ones((2, 3, 3), np.float32), heads, np.empty((2, 3, 2), np.float32), True)
