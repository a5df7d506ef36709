"""runnx's own float32 products (`runnx/ops/_kernels_gemm.py`, chosen by `runnx/ops/_matmul.py`):
right against float64 arithmetic at every edge of their blocking, and each element summed alike
whatever the thread count, the number of rows or columns around it, or the layouts of the
operands."""
from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pytest

from runnx.ops import _kernels_gemm as gemm, _matmul
from runnx.runtime import blas_split, helpers, slots

FEW = _matmul.FEW_ROWS

RNG = np.random.default_rng(7)
needs_avx512 = pytest.mark.skipif(not gemm.AVAILABLE, reason="this CPU has neither AVX-512 nor AVX2 with FMA: numpy's BLAS multiplies")


@pytest.fixture
def own(monkeypatch):
    _matmul.set_own_kernels(True)
    yield
    _matmul.set_own_kernels(None)


def _operands(rows, depth, columns):
    return (RNG.standard_normal((rows, depth), dtype=np.float32),
            RNG.standard_normal((depth, columns), dtype=np.float32))


def _scratch() -> tuple:
    """`gemm_columns`' scratch but b_block: a's panels, b's last panel, an edge tile."""
    return (np.empty(gemm.MC * gemm.KC, np.float32), np.empty(gemm.KC * gemm.NR, np.float32),
            np.empty((gemm.MR, gemm.NR), np.float32))


def _in_place(a, b, first: int, stop: int):
    """a @ b[:, first:stop] by `gemm_columns` reading b in place (no room to pack it), NaN elsewhere."""
    out = np.full((a.shape[0], b.shape[1]), np.nan, np.float32)
    gemm.gemm_columns(a, b, out, first, stop, *_scratch(), False, np.empty(1, np.float32))
    return out


def _close_to_exact(product, a, b):
    exact = np.matmul(a.astype(np.float64), b.astype(np.float64))
    scale = np.matmul(np.abs(a).astype(np.float64), np.abs(b).astype(np.float64)) + 1e-30
    assert product.dtype == np.float32 and product.shape == exact.shape
    assert np.all(np.abs(product - exact) <= 2e-6 * a.shape[-1] ** 0.5 * scale + 1e-30)


@needs_avx512
@pytest.mark.parametrize("rows", [1, 11, 12, 13, 120, 121, 263])
@pytest.mark.parametrize("depth", [1, 255, 256, 257, 600])
@pytest.mark.parametrize("columns", [1, 31, 32, 33, 100])
def test_products_match_float64_arithmetic_at_every_block_edge(own, rows, depth, columns):
    a, b = _operands(rows, depth, columns)
    _close_to_exact(_matmul.matmul(a, b), a, b)


@needs_avx512
def test_own_kernels_take_the_product(own, monkeypatch):
    """The test above measures the own kernels, not numpy's BLAS."""
    calls = []
    original = gemm.product_columns
    monkeypatch.setattr(gemm, "product_columns", lambda *args: calls.append(1) or original(*args))
    a, b = _operands(20, 30, 40)
    _matmul.matmul(a, b)
    assert calls


@needs_avx512
def test_every_element_is_summed_alike_whatever_surrounds_it(own):
    """A row of a prompt comes out the same in a block of one row, a row of it as part of the whole,
    and likewise for columns: each element's sum runs over k in the same blocks and order."""
    a, b = _operands(257, 700, 97)
    whole = _matmul.matmul(a, b)
    assert np.array_equal(_matmul.matmul(a[100:101], b), whole[100:101])
    assert np.array_equal(_matmul.matmul(a[5:130], b), whole[5:130])
    assert np.array_equal(_matmul.matmul(a, np.ascontiguousarray(b[:, 33:70])), whole[:, 33:70])


@needs_avx512
def test_layouts_and_outputs_do_not_change_a_bit(own):
    """Transposed, strided and broadcast operands, `out` arrays with and without contiguous rows,
    and stacks: the same bits as the C-contiguous 2-D product."""
    a, b = _operands(50, 64, 70)
    reference = _matmul.matmul(a, b)
    assert np.array_equal(_matmul.matmul(np.asfortranarray(a), np.asfortranarray(b)), reference)
    assert np.array_equal(_matmul.matmul(a.T.copy().T, b.T.copy().T), reference)
    out = np.full((50, 200), np.nan, np.float32)
    _matmul.matmul(a, b, out=out[:, 10:80])
    assert np.array_equal(out[:, 10:80], reference) and np.isnan(out[:, :10]).all() and np.isnan(out[:, 80:]).all()
    transposed = np.empty((70, 50), np.float32).T  # rows not contiguous: computed, then copied in
    assert np.array_equal(_matmul.matmul(a, b, out=transposed), reference)
    stack = np.stack([a, a[::-1]])
    assert np.array_equal(_matmul.matmul(stack, b), np.stack([reference, reference[::-1]]))
    assert np.array_equal(_matmul.matmul(stack, np.stack([b, b])), np.stack([reference, reference[::-1]]))
    assert np.array_equal(_matmul.matmul(stack[:, None], b[None, None]), np.stack([reference, reference[::-1]])[:, None])


@needs_avx512
def test_an_output_overlapping_an_input_gets_the_product_of_the_inputs(own):
    a, b = _operands(40, 40, 40)
    expected = _matmul.matmul(a, b)
    _matmul.matmul(a, b, out=a)
    assert np.array_equal(a, expected)


@needs_avx512
def test_products_shared_among_threads_are_the_same_bits(own, monkeypatch):
    """A product split among threads (large enough, `_SPLIT_FROM`: by rows, or by columns for a
    few rows) equals the same product on one thread, bit for bit."""
    a, b = _operands(1000, 300, 130)
    monkeypatch.setattr(blas_split, "blas_threads", lambda: 1)
    alone = _matmul.matmul(a, b)
    parts = []
    original = helpers.run_parts
    monkeypatch.setattr(helpers, "run_parts", lambda work, shares: parts.append(len(shares)) or original(work, shares))
    monkeypatch.setattr(blas_split, "blas_threads", lambda: 2)
    monkeypatch.setattr(_matmul, "_SPLIT_FROM", 1)
    for _ in range(5):
        assert np.array_equal(_matmul.matmul(a, b), alone)
    assert np.array_equal(_matmul.matmul(a[:50], b), alone[:50])  # a short prompt: split by columns
    assert np.array_equal(_matmul.matmul(a[:1], b), alone[:1])  # one row, large enough: split too, not few_rows
    assert parts == [2] * 7


@needs_avx512
def test_a_short_prompts_product_shares_its_columns_with_the_pool(own, monkeypatch):
    """A product of a few dozen rows (a short prompt's) is a pool job of column blocks when the
    process has workers, bitwise the one-thread product; never inside a part of a split (whose
    threads are the cores), nor for a product too small for a hand-off."""
    from runnx.runtime import pool as decode_pool
    monkeypatch.setattr(decode_pool, "_workers", None)
    decode_pool.set_workers(1)
    try:
        workers = decode_pool.pool()
        a, b = _operands(40, 600, 1100)
        alone = np.empty((40, 1100), np.float32)
        _matmul._product((a, b, alone, 0, 1100, False))
        shared = workers.shared_units
        deadline = time.monotonic() + 60  # a loaded machine may give the worker no core for a while
        while workers.shared_units == shared and time.monotonic() < deadline:
            assert np.array_equal(_matmul.matmul(a, b), alone)
        assert workers.shared_units > shared  # the worker took units of it
        posted = workers.box[slots.POSTED]
        helpers.run_parts(lambda part: _matmul.matmul(*part), [(a, b), (a, b)])
        small = _matmul.matmul(a[:3, :20], np.ascontiguousarray(b[:20, :30]))
        _close_to_exact(small, a[:3, :20], b[:20, :30])
        assert workers.box[slots.POSTED] == posted  # inside parts, and a small product: no job
    finally:
        decode_pool.set_workers(None)


@needs_avx512
@pytest.mark.parametrize("rows, depth, columns", [(3, 1, 1), (13, 300, 33), (131, 257, 545), (40, 600, 1100)])
def test_b_given_by_its_columns_is_packed_not_copied_and_gives_the_same_bits(own, monkeypatch, rows, depth, columns):
    """b as a transposed view (a weight panel dequantized column by column, keys for scores): the
    kernel packs its columns (`columns_given`), across the KC and BLOCK_COLUMNS edges and the
    rows-in-place limit, on one thread or two, and every element is the contiguous b's."""
    a, b = _operands(rows, depth, columns)
    reference = _matmul.matmul(a, b)
    _close_to_exact(reference, a, b)
    by_columns = np.ascontiguousarray(b.T).T
    assert np.array_equal(_matmul.matmul(a, by_columns), reference)  # (a short prompt's: a pool job, if any)
    monkeypatch.setattr(_matmul, "_POOL_FROM", 1 << 62)  # on this thread, where the spy sees the calls
    given = []
    original = gemm.product_columns
    monkeypatch.setattr(gemm, "product_columns", lambda *args: given.append(args[8]) or original(*args))
    assert np.array_equal(_matmul.matmul(a, by_columns), reference)
    assert given and all(given) != by_columns.flags.c_contiguous  # (a 1 x 1 b is both)
    stack = np.stack([by_columns, by_columns])  # a stack of transposed operands (heads' keys)
    assert np.array_equal(_matmul.matmul(np.stack([a, a]), stack), np.stack([reference, reference]))
    monkeypatch.setattr(blas_split, "blas_threads", lambda: 2)
    monkeypatch.setattr(_matmul, "_SPLIT_FROM", 1)
    assert np.array_equal(_matmul.matmul(a, by_columns), reference)
    assert np.array_equal(_matmul.matmul(a[:1], by_columns), reference[:1])


@needs_avx512
def test_a_decoders_load_loads_the_products_kernel_with_one_thread_too():
    """`start_in_background` (a decoder's or an encoder's load) loads the products' kernel from
    numba's cache on a thread of its own, for every type its calls give it (a fresh process)."""
    code = """
import numpy as np
from runnx.ops import _kernels_gemm as gemm, _matmul
from runnx.runtime import pool as d, pool_start
_matmul.set_own_kernels(True)
d.set_workers(0)
pool_start.start_in_background()
pool_start._starting.join()
before = len(gemm.product_columns.overloads)
a = np.ones((40, 30), np.float32)
w = np.ones((30, 50), np.float32)
w.flags.writeable = False
_matmul.matmul(a, w)
_matmul.matmul(a, a.T.copy())
_matmul.matmul(a, w, out=np.empty((40, 2, 50), np.float32)[:, 0])
print(before > 0, before == len(gemm.product_columns.overloads))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "True"]


def test_a_helpers_failure_is_raised_after_every_part_has_ended():
    ended = []

    def work(part):
        if part == 1:
            raise ValueError("part 1")
        ended.append(part)

    with pytest.raises(ValueError, match="part 1"):
        helpers.run_parts(work, [0, 1, 2])
    assert sorted(ended) == [0, 2]


def test_other_dtypes_and_vectors_take_numpy(own):
    a = RNG.standard_normal((5, 6))
    b = RNG.standard_normal((6, 4))
    assert np.array_equal(_matmul.matmul(a, b), np.matmul(a, b))
    v = RNG.standard_normal(6).astype(np.float32)
    assert np.array_equal(_matmul.matmul(v, b.astype(np.float32)), np.matmul(v, b.astype(np.float32)))
    with pytest.raises(ValueError):
        _matmul.matmul(a, a)


class _Library:
    def __init__(self, internal_api, architecture=None):
        self.internal_api, self.architecture = internal_api, architecture


@pytest.mark.parametrize("libraries,expected", [
    ([_Library("openblas", "Haswell")], True),
    ([_Library("openblas", "SkylakeX")], False),
    ([_Library("openblas", "Cooperlake")], False),
    ([_Library("mkl")], False),
    ([], False),
])
def test_own_kernels_run_only_where_blas_is_narrower_than_the_cpu(monkeypatch, libraries, expected):
    monkeypatch.setattr(blas_split, "blas_libraries", lambda: libraries)
    monkeypatch.setattr(_matmul, "_enabled", None)
    assert _matmul.own_kernels() is (expected and gemm.WIDE)
    monkeypatch.setattr(gemm, "WIDE", False)  # an AVX2 CPU: OpenBLAS's AVX2 kernels are as wide as its own
    monkeypatch.setattr(_matmul, "_enabled", None)
    assert _matmul.own_kernels() is False
    monkeypatch.setattr(_matmul, "_enabled", None)


@pytest.mark.parametrize("libraries,short", [
    ([_Library("openblas", "Haswell")], True),
    ([_Library("openblas", "SkylakeX")], True),
    ([_Library("openblas", "SkylakeX"), _Library("mkl")], False),
    ([_Library("mkl")], False),
    ([], False),
])
def test_a_short_prompts_products_by_a_matrix_take_the_own_kernels_wherever_blas_is_openblas(monkeypatch, libraries,
                                                                                               short):
    """Where OpenBLAS runs its AVX-512 kernels, products by a matrix of fewer than SHORT_ROWS rows
    (cold weights) still take the own kernels; longer ones and stacks (an attention's) are BLAS's.
    On a CPU with AVX2 only, OpenBLAS takes them all."""
    monkeypatch.setattr(blas_split, "blas_libraries", lambda: libraries)
    monkeypatch.setattr(_matmul, "_enabled", None)
    monkeypatch.setattr(_matmul, "_short", None)
    every = _matmul.own_kernels()
    short = short and gemm.WIDE  # (an AVX2 CPU: OpenBLAS's kernels multiply them faster)
    assert _matmul.own_product(1, True) is (every or short)
    assert _matmul.own_product(_matmul.SHORT_ROWS - 1, True) is (every or short)
    assert _matmul.own_product(_matmul.SHORT_ROWS, True) is every
    assert _matmul.own_product(3, False) is every
    a = RNG.standard_normal((_matmul.SHORT_ROWS - 1, 8), dtype=np.float32)
    calls = []
    original = gemm.product_columns
    monkeypatch.setattr(gemm, "product_columns", lambda *args: calls.append(1) or original(*args))
    product = _matmul.matmul(a, RNG.standard_normal((8, 40), dtype=np.float32))
    assert bool(calls) is (every or short) and product.shape == (_matmul.SHORT_ROWS - 1, 40)
    _matmul.set_own_kernels(False)
    assert not _matmul.own_product(1, True)
    monkeypatch.setattr(_matmul, "_enabled", None)
    monkeypatch.setattr(_matmul, "_short", None)


@needs_avx512
@pytest.mark.parametrize("depth", [1, 64, 255, 257, 600])
@pytest.mark.parametrize("columns", [1, 15, 16, 33, 512])
@pytest.mark.parametrize("columns_given", [False, True])
def test_a_few_rows_are_summed_unpacked_to_the_same_bits(own, monkeypatch, depth, columns, columns_given):
    """Up to FEW_ROWS rows (a decode step's products, an attention's heads) skip the packing, which
    costs more than one row's multiply-adds: `few_rows` sums each element in the tiles' order, so
    every row has the bits the packed kernel gives it inside a larger product, b given by its rows
    or its columns, alone or in a stack of heads (one call for the stack)."""
    a = RNG.standard_normal((3, 2, FEW + 1, depth), dtype=np.float32)
    b = RNG.standard_normal((3, 2, columns, depth) if columns_given else (3, 2, depth, columns), dtype=np.float32)
    b = b.transpose(0, 1, 3, 2) if columns_given else b
    packed = _matmul.matmul(a, b)  # FEW + 1 rows: packed, head by head
    _matmul.matmul(a[:, :, :FEW], b)  # compiled before the spies stand in (a compile would call them)
    calls = []
    for name in ("few_rows", "few_rows_stack"):
        original = getattr(gemm, name)
        monkeypatch.setattr(gemm, name,
                            lambda *args, original=original, name=name: calls.append(name) or original(*args))
    assert np.array_equal(_matmul.matmul(a[:, :, :FEW], b), packed[:, :, :FEW])
    assert np.array_equal(_matmul.matmul(a[1, 1, :1], b[1, 1]), packed[1, 1, :1])
    assert calls == ["few_rows_stack", "few_rows"]
    _close_to_exact(packed, a, b)


@needs_avx512
@pytest.mark.parametrize("rows", [3, 12, 13, 32, 48])
@pytest.mark.parametrize("depth", [1, 31, 33, 256, 600])
@pytest.mark.parametrize("columns, first, stop, span", [(128, 0, 128, 192), (545, 0, 545, 2016), (545, 64, 545, 96),
                                                         (2100, 0, 2100, 2016), (700, 32, 417, 480)])
def test_a_streamed_product_is_the_same_bits_as_the_blocked_one(rows, depth, columns, first, stop, span):
    """`gemm_streamed` reads b a slice of rows at a time across whole rows (for the hardware's
    streamer), in tiles of another shape, and keeps each tile's chains in memory between slices:
    every element the same bits as `gemm_columns`, across KC blocks, slices, partial tiles and
    panels, column ranges and passes narrower than the range; nothing written outside the range."""
    a, b = _operands(rows, depth, columns)
    blocked = _in_place(a, b, first, stop)
    streamed = np.full((rows, columns), np.nan, np.float32)
    gemm.gemm_streamed(a, b, streamed, first, stop, np.empty((gemm.streamed_rows(rows), span), np.float32))
    np.testing.assert_array_equal(streamed, blocked)
    assert np.isnan(streamed[:, :first]).all() and np.isnan(streamed[:, stop:]).all()
    _close_to_exact(streamed[:, first:stop], a, b[:, first:stop])


@needs_avx512
@pytest.mark.parametrize("rows", [gemm.PACKED_FROM, 121, 263])
@pytest.mark.parametrize("depth", [1, 255, 257, 600])
@pytest.mark.parametrize("columns, first, stop", [(65, 0, 65), (100, 0, 100), (1100, 0, 1100), (1100, 64, 777)])
def test_b_packed_into_panels_gives_the_bits_of_b_read_in_place(rows, depth, columns, first, stop):
    """From PACKED_FROM rows of a, `gemm_columns` packs each block of b into panels when it has the
    scratch for them (`b_block`; without it, b is read in place): the same tiles over the same
    chains, every element the same bits, across KC blocks, column blocks, a range's partial panels
    and ranges that start and end inside a block; nothing written outside the range."""
    a, b = _operands(rows, depth, columns)
    in_place = _in_place(a, b, first, stop)
    packed = np.full((rows, columns), np.nan, np.float32)
    block = np.full(gemm.KC * gemm.BLOCK_COLUMNS, np.nan, np.float32)
    gemm.gemm_columns(a, b, packed, first, stop, *_scratch(), False, block)
    np.testing.assert_array_equal(packed.view(np.int32), in_place.view(np.int32))
    assert not np.isnan(block).all()  # (b's blocks went through it)
    assert np.isnan(packed[:, :first]).all() and np.isnan(packed[:, stop:]).all()
    _close_to_exact(packed[:, first:stop], a, b[:, first:stop])


@needs_avx512
@pytest.mark.parametrize("rows", [1, 12, 13, 64, 121, 250])
@pytest.mark.parametrize("depth", [1, 64, 80, 256])
@pytest.mark.parametrize("columns, spare", [(5, 0), (32, 0), (64, 1), (100, 0), (1500, 0)])
def test_a_product_by_panels_made_ahead_is_the_same_bits_as_the_blocked_one(rows, depth, columns, spare):
    """`panels_product` reads b as panels `key_panels_into` made (more of them than the product's
    columns need: a block's keys are the first of its head's), and is `gemm_columns`' bits: one KC
    block, row blocks of MC, partial tiles and panels, a's rows read in place by `gemm_columns`
    (64 columns and fewer) or packed."""
    from runnx.ops._kernels_attention_blocks import key_panels_into
    a, b = _operands(rows, depth, columns)
    panels = -(-columns // gemm.NR) + spare
    extra = max(0, panels * gemm.NR - 3 - columns)  # keys past the product's columns, short of the last panel
    keys = np.concatenate([b.T, RNG.standard_normal((extra, depth), dtype=np.float32)])
    made = np.full((1, 1, panels * depth, gemm.NR), np.nan, np.float32)
    key_panels_into(keys[None, None], made)
    padding = made[0, 0].reshape(panels, depth, gemm.NR).transpose(1, 0, 2).reshape(depth, -1)[:, keys.shape[0]:]
    assert (padding == 0).all()  # (the last panel's columns past the keys)
    blocked = np.full((rows, columns), np.nan, np.float32)
    gemm.gemm_columns(a, b, blocked, 0, columns, np.empty(gemm.MC * gemm.KC, np.float32),
                      np.empty(gemm.KC * gemm.NR, np.float32), np.empty((gemm.MR, gemm.NR), np.float32), False,
                      np.empty(1, np.float32))
    product = np.full((rows, columns), np.nan, np.float32)
    gemm.panels_product(a, made[0, 0], product, np.empty(gemm.MC * gemm.KC, np.float32),
                        np.empty((gemm.MR, gemm.NR), np.float32))
    np.testing.assert_array_equal(product.view(np.int32), blocked.view(np.int32))
    _close_to_exact(product, a, b)


@needs_avx512
def test_a_short_prompts_product_by_a_wide_weight_is_streamed_and_others_are_not(own):
    """A few dozen rows by a weight's range of 4 panels or more stream; more rows, narrower ranges
    and b given by its columns take the blocked kernel. The products are the same bits either way."""
    assert gemm.streams(32, 1536, False) and gemm.streams(1, gemm.STREAMED_FROM, False)
    assert not gemm.streams(gemm.STREAMED_ROWS + 1, 1536, False)
    assert not gemm.streams(32, gemm.STREAMED_FROM - 1, False) and not gemm.streams(32, 1536, True)
    a, b = _operands(32, 300, 700)
    streamed = _matmul.matmul(a, b)
    _close_to_exact(streamed, a, b)
    assert np.array_equal(streamed[:1], _matmul.matmul(a[:1], b))  # (one row: unpacked chains)
