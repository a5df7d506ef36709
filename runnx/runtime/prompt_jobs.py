"""A short prompt's pool jobs: its products by a matrix shared out by columns, and its attention by
blocks of query positions (`runtime/pool.py`'s workers; what each unit computes: `units.py`).

A product's columns go in units, about one a thread (`GEMM_UNITS_PER_THREAD`), each unit a
`product_columns` call that sums every element alike wherever the unit falls, so the values are the
one-thread product's; a job of several products of one input (a layer's q, k and v) has each
product's units after the one before's, one hand-off for all.
"""
from __future__ import annotations

from runnx.ops import _kernels_gemm as gemm
from runnx.runtime.jobs import post_attention_blocks, post_gemm, post_gemms
from runnx.runtime.pool import BUSY, pool, shared_call

# a prompt's product is cut into about this many units of columns a thread: one, since each unit packs
# a's rows again and a short prompt's weights stream faster the wider its rows are (`product_columns`);
# more units, letting a fast thread take a slow one's share, measured slower on two cores
GEMM_UNITS_PER_THREAD = 1


def columns_product(a, b, out, columns_given: bool) -> bool:
    """out = a @ b (`post_gemm`: C-contiguous float32 a (M, K), b (K, N) or its columns (N, K), out's
    rows contiguous), its columns shared with the pool's workers; False, having done nothing, when
    there are none or another thread has the pool. The same compiled kernel on every thread, each
    element summed alike in any unit: the one-thread product's values."""
    workers = pool()
    if workers is None:
        return False
    unit = unit_columns(workers.worker_threads, out.shape[1])
    return workers.call(post_gemm, a, b, out, columns_given, unit) is not BUSY


def columns_products(a, weights: tuple, outs: tuple) -> bool:
    """outs[p] = a @ weights[p] for each p (`post_gemms`: the products of one input as one job, at most
    MAX_MATRICES; arrays as `columns_product` takes them, the weights' rows given), their columns
    shared with the pool's workers; False, having done nothing, when there are none or another
    thread has the pool. Each element the bits of its product alone."""
    workers = pool()
    if workers is None:
        return False
    widths = tuple([out.shape[1] for out in outs])
    unit = unit_columns(workers.worker_threads, sum(widths), widths)
    return workers.call(post_gemms, a, weights, outs, False, unit) is not BUSY


def unit_columns(workers: int, columns: int, widths: tuple = ()) -> int:
    """Columns a unit of a products job over `columns` columns, with `workers` pool workers beside
    the calling thread (`GEMM_UNITS_PER_THREAD`; none: one unit). For a job of several products
    (their `widths`), a product whose last unit would be narrower than a streamed range
    (`gemm.STREAMED_FROM` columns: computed without `gemm_streamed`) is cut into equal units
    instead: a layer's q, k and v of 576, 192 and 192 columns go in units of 288, not of 480 and a
    last 96 of q (two threads, a 32-token prompt: 214-225 us a layer against 241-255). Any unit
    gives the same bits."""
    unit = _whole_panels(columns, GEMM_UNITS_PER_THREAD * (workers + 1))
    for width in widths:
        if width > unit and 0 < width % unit < gemm.STREAMED_FROM:
            even = _whole_panels(width, -(-width // unit))
            if even >= gemm.STREAMED_FROM:  # (a product too narrow for that streams in no unit)
                unit = even
    return unit


def _whole_panels(columns: int, parts: int) -> int:
    """The fewest whole panels (`gemm.NR` columns) covering a `parts`-th of `columns`, at least one."""
    return max(gemm.NR, -(-columns // (parts * gemm.NR)) * gemm.NR)


def gemm_unit(columns: int, widths: tuple = ()) -> int:
    """Columns a unit of a prompt's products job over `columns` columns (`unit_columns`: of these
    products' `widths`) that native code posts (`shared_call`), for the process's pool."""
    workers = pool()
    return unit_columns(workers.worker_threads if workers is not None else 0, columns, widths)


def attention_blocks(scaled, key_panels, value, bias, ends, fill: float, positions: int, out) -> None:
    """A prompt's attention into out (`post_attention_blocks`: float32 arrays, each KV head's keys as
    the panels of their columns and values C-contiguous), its blocks of query positions shared with
    the pool's workers when there are any: the same compiled code on every thread, each block
    computed whole by one, so the same values whatever the thread count."""
    shared_call(post_attention_blocks, scaled, key_panels, value, bias, ends, float(fill), positions, out)
