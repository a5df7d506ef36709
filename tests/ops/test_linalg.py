"""Linear algebra: Gemm options and its opset-6 broadcast attribute, MatMulInteger zero points,
Einsum, Det, and dtypes kept for half precision."""
import ml_dtypes
import numpy as np
import pytest
from _single_node import run_node

F32 = np.float32
RNG = np.random.default_rng(0)
A = RNG.standard_normal((3, 4)).astype(F32)
B = RNG.standard_normal((4, 5)).astype(F32)


def test_gemm_transposes_and_scales():
    c = np.arange(5, dtype=F32)
    got = run_node("Gemm", [A.T.copy(), B.T.copy(), c], transA=1, transB=1, alpha=0.5, beta=2.0)
    np.testing.assert_allclose(got, 0.5 * A @ B + 2 * c, rtol=1e-5)
    np.testing.assert_allclose(run_node("Gemm", [A, B]), A @ B, rtol=1e-5)  # C optional from opset 11
    np.testing.assert_allclose(run_node("Gemm", [A, B, c], beta=0.0), A @ B, rtol=1e-5)


def test_gemm_opset6_needs_broadcast_for_a_smaller_c():
    c = np.arange(5, dtype=F32)
    np.testing.assert_allclose(run_node("Gemm", [A, B, c], opset=6, broadcast=1), A @ B + c, rtol=1e-5)
    with pytest.raises(Exception, match="broadcast=1"):
        run_node("Gemm", [A, B, c], opset=6)


def test_integer_gemm_stays_integer():
    a = np.array([[1, 2], [3, 4]], np.int32)
    got = run_node("Gemm", [a, a, np.array([1], np.int32)], alpha=2.0)
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, 2 * a @ a + 1)


def test_matmul_integer_zero_points():
    a = np.array([[11, 7, 3], [10, 6, 2]], np.uint8)
    b = np.array([[1, 4], [2, 5], [3, 6]], np.uint8)
    a_zero = np.array([1, 2], np.uint8)  # one per row of A
    b_zero = np.array([0, 1], np.uint8)  # one per column of B
    expected = (a.astype(np.int32) - a_zero.reshape(2, 1)) @ (b.astype(np.int32) - b_zero)
    got = run_node("MatMulInteger", [a, b, a_zero, b_zero])
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(run_node("MatMulInteger", [a, b, np.array(3, np.uint8)]),
                                  (a.astype(np.int32) - 3) @ b.astype(np.int32))
    signed = np.array([[-128, 127]], np.int8)
    np.testing.assert_array_equal(run_node("MatMulInteger", [signed, signed.T.copy()]), [[128 * 128 + 127 * 127]])


def test_einsum():
    x = RNG.standard_normal((2, 3, 4)).astype(F32)
    y = RNG.standard_normal((2, 4, 5)).astype(F32)
    np.testing.assert_allclose(run_node("Einsum", [x, y], equation="bij, bjk -> bik"), x @ y, rtol=1e-5)
    np.testing.assert_allclose(run_node("Einsum", [A], equation="ij"), A)
    np.testing.assert_allclose(run_node("Einsum", [A], equation="ji"), A.T)  # implicit output is sorted: "ij"
    np.testing.assert_allclose(run_node("Einsum", [x], equation="...ij->...ji"), x.transpose(0, 2, 1))
    np.testing.assert_allclose(run_node("Einsum", [A[:, :3].copy()], equation="ii"), np.trace(A[:, :3]), rtol=1e-6)


def test_det_batches_and_half_precision():
    m = RNG.standard_normal((2, 3, 3))
    np.testing.assert_allclose(run_node("Det", [m]), np.linalg.det(m), rtol=1e-12)
    half = np.array([[2, 1], [1, 3]], np.float16)
    got = run_node("Det", [half])
    assert got.dtype == np.float16 and got == 5


def test_half_precision_products_keep_their_dtype():
    bf = A.astype(ml_dtypes.bfloat16)
    got = run_node("MatMul", [bf, B.astype(ml_dtypes.bfloat16)])
    assert got.dtype == ml_dtypes.bfloat16
    np.testing.assert_allclose(got.astype(F32), A @ B, rtol=0.05, atol=0.05)
    assert run_node("Einsum", [bf, bf], equation="ij,ij->i").dtype == ml_dtypes.bfloat16
    assert run_node("Gemm", [A.astype(np.float16), B.astype(np.float16)], alpha=0.5).dtype == np.float16


def test_matmul_batched_by_2d_matches_numpy():
    a = RNG.standard_normal((2, 3, 1, 4)).astype(F32)
    np.testing.assert_allclose(run_node("MatMul", [a, B]), np.matmul(a, B), rtol=1e-5)
    np.testing.assert_allclose(run_node("MatMul", [a[..., ::2, :].transpose(1, 0, 2, 3), B]),
                               np.matmul(a.transpose(1, 0, 2, 3), B), rtol=1e-5)
    assert run_node("MatMul", [np.zeros((2, 0, 4), F32), B]).shape == (2, 0, 5)


@pytest.mark.parametrize("row_shape", [(6,), (1, 6), (1, 1, 6)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("columns", [7, 5000])
def test_matmul_one_row_takes_the_loop_with_numpys_shapes(row_shape, dtype, columns):
    # decoding's one-row products, narrow or as wide as an LM head, take runnx's loop (its
    # summation order is tested in test_decode_pool.py); numpy's shapes and dtype
    from runnx.ops._kernels_linalg import row_times_matrix

    row = RNG.standard_normal(row_shape).astype(dtype)
    matrix = RNG.standard_normal((6, columns)).astype(dtype)
    got = run_node("MatMul", [row, matrix])
    assert got.shape == np.matmul(row, matrix).shape and got.dtype == dtype
    np.testing.assert_array_equal(got.reshape(-1), row_times_matrix(row.reshape(-1), matrix))


@pytest.mark.parametrize("shape", [(2, 1, 4), (1, 3, 4), (16, 4)])
def test_matmul_few_rows_take_the_loop_each_row_as_alone(shape):
    # a short prompt's rows share one pass over the matrix; each comes out bitwise as decoded alone
    from runnx.ops._kernels_linalg import row_times_matrix

    rows = RNG.standard_normal(shape).astype(F32)
    got = run_node("MatMul", [rows, B])
    assert got.shape == np.matmul(rows, B).shape and got.dtype == F32
    expected = [row_times_matrix(row, B) for row in rows.reshape(-1, 4)]
    np.testing.assert_array_equal(got.reshape(-1, 5), np.stack(expected))


@pytest.mark.parametrize("many", ["rows", "sums"])
def test_matmul_many_rows_stay_with_blas(many):
    # more rows than FEW_ROWS, or few rows whose partial sums would not stay in cache (an LM head's)
    from runnx.runtime.jobs import FEW_ROW_SUMS, FEW_ROWS

    height, matrix = (FEW_ROWS + 1, B) if many == "rows" else (2, RNG.standard_normal((4, FEW_ROW_SUMS // 2 + 1)))
    matrix = matrix.astype(F32)
    rows = RNG.standard_normal((height, 1, 4)).astype(F32)
    expected = np.matmul(rows.reshape(-1, 4), matrix).reshape(height, 1, -1)
    np.testing.assert_array_equal(run_node("MatMul", [rows, matrix]), expected)


@pytest.mark.parametrize("bias_shape", [(16,), None])
def test_matmul_add_layer_norm_of_many_rows_is_the_unfused_nodes(bias_shape):
    """An encoder's rows: the residual + (product + bias) and its norm, the bias and the residual
    added within the norm's pass (no numpy adds), bitwise what the Add and LayerNormalization nodes
    give; the caller's residual is left as it was."""
    from runnx.ops.fused_residual_blocks import MatMulAddLayerNorm

    x = RNG.standard_normal((1, 40, 24)).astype(F32)
    weight = RNG.standard_normal((24, 16)).astype(F32)
    bias = None if bias_shape is None else RNG.standard_normal(bias_shape).astype(F32)
    residual = RNG.standard_normal((1, 40, 16)).astype(F32)
    before = residual.copy()
    scale, norm_bias = RNG.standard_normal((2, 16)).astype(F32)
    summed, normed = MatMulAddLayerNorm(x, weight, bias, residual, scale, norm_bias, epsilon=1e-5)
    product = run_node("MatMul", [x, weight])
    want = residual + (product if bias is None else product + bias)
    np.testing.assert_array_equal(summed, want)
    np.testing.assert_array_equal(normed, run_node("LayerNormalization", [want, scale, norm_bias], opset=17))
    np.testing.assert_array_equal(residual, before)


def test_matmul_one_row_result_does_not_depend_on_workers():
    from runnx.runtime import pool as decode_pool
    row = np.random.default_rng(1).standard_normal((1, 1, 512)).astype(np.float32)
    matrix = np.random.default_rng(2).standard_normal((512, 320)).astype(np.float32)  # pooled: >= 64 Ki elements
    try:
        results = []
        for workers in (0, 1, 3):
            decode_pool.set_workers(workers)
            results.append(run_node("MatMul", [row, matrix]))
    finally:
        decode_pool.set_workers(None)
    assert results[0].shape == (1, 1, 320)
    np.testing.assert_array_equal(results[1], results[0])
    np.testing.assert_array_equal(results[2], results[0])
    np.testing.assert_allclose(results[0], np.matmul(row, matrix), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("a_type,b_type", [(np.uint8, np.int8), (np.uint8, np.uint8), (np.int8, np.int8)])
@pytest.mark.parametrize("shape", [(1, 576, 1536), (3, 1535, 77), (2, 4, 3, 65), (20, 64, 33)])  # few rows; many
@pytest.mark.parametrize("zeros", ["none", "scalar", "per row and column"])
def test_matmul_integer_is_exact_on_every_path(a_type, b_type, shape, zeros):
    """A few rows stream the 8-bit matrix once (`integer_rows`, zero points folded out of the loop),
    many go through float64 products: both equal exact integer arithmetic."""
    *lead, depth, width = shape
    info_a, info_b = np.iinfo(a_type), np.iinfo(b_type)
    a = RNG.integers(info_a.min, info_a.max + 1, (*lead, depth)).astype(a_type)
    b = RNG.integers(info_b.min, info_b.max + 1, (depth, width)).astype(b_type)
    inputs = [a, b]
    if zeros == "scalar":
        inputs += [np.array(info_a.max // 2 + 3, a_type), np.array(info_b.max // 3, b_type)]
    elif zeros == "per row and column" and len(lead) == 1:
        inputs += [RNG.integers(info_a.min, info_a.max + 1, lead[0]).astype(a_type),
                   RNG.integers(info_b.min, info_b.max + 1, width).astype(b_type)]
    a_zero = inputs[2].astype(np.int64).reshape(-1, 1) if len(inputs) > 2 and inputs[2].size > 1 else \
        (inputs[2].astype(np.int64) if len(inputs) > 2 else 0)
    b_zero = inputs[3].astype(np.int64) if len(inputs) > 3 else 0
    expected = (a.astype(np.int64) - a_zero) @ (b.astype(np.int64) - b_zero)
    got = run_node("MatMulInteger", inputs)
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("a_type,b_type", [(np.uint8, np.int8), (np.uint8, np.uint8), (np.int8, np.int8),
                                           (np.int8, np.uint8)])
@pytest.mark.parametrize("rows,depth,width", [(1, 576, 1536), (3, 1535, 77), (16, 65, 33), (1, 3, 5)])
@pytest.mark.parametrize("zeros", ["none", "scalar", "per row and column"])
def test_matmul_integer_of_a_constant_weight_is_the_same_bits_through_vnni(monkeypatch, a_type, b_type, rows, depth,
                                                                           width, zeros):
    """A constant weight's few-row product goes through AVX-512 VNNI where the CPU has it (the
    weight repacked once, signed bytes by unsigned ones, the offsets moved into the zero points):
    the same int32 values as the widening kernel and as exact arithmetic, for every signedness."""
    from runnx.ops import _kernels_vnni, linalg_integer as linalg

    info_a, info_b = np.iinfo(a_type), np.iinfo(b_type)
    a = RNG.integers(info_a.min, info_a.max + 1, (rows, depth)).astype(a_type)
    b = RNG.integers(info_b.min, info_b.max + 1, (depth, width)).astype(b_type)
    a_zero = b_zero = None
    if zeros == "scalar":
        a_zero, b_zero = np.array(info_a.max // 2 + 3, a_type), np.array(info_b.min // 3, b_type)
    elif zeros == "per row and column":
        a_zero = RNG.integers(info_a.min, info_a.max + 1, rows).astype(a_type)
        b_zero = RNG.integers(info_b.min, info_b.max + 1, width).astype(b_type)
    expected = ((a.astype(np.int64) - (0 if a_zero is None else a_zero.astype(np.int64).reshape(-1, 1)))
                @ (b.astype(np.int64) - (0 if b_zero is None else b_zero.astype(np.int64))))
    widening = linalg.MatMulInteger(a, b, a_zero, b_zero)  # a writeable weight: the widening kernel
    constant = b.copy()
    constant.flags.writeable = False
    if _kernels_vnni.AVAILABLE:
        def refuse(*args):
            raise AssertionError("a constant weight took the widening kernel on a CPU with VNNI")
        monkeypatch.setattr(linalg, "integer_rows", refuse)
    got = linalg.MatMulInteger(a, constant, a_zero, b_zero)
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, widening)
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("flip", [False, True])
def test_vnni_tile_sums_are_exact_on_any_cpu(flip):
    """The tiles' kernel compiles on every CPU (the pool's unit kernel holds it): `vpdpbusd` where
    the CPU has AVX-512 VNNI, the same sums in portable IR elsewhere (that instruction aborts LLVM
    on a CPU without it). Either way: exact int32 sums of unsigned rows by the repacked weight."""
    from runnx.ops import _kernels_vnni as vnni

    depth, width = 203, 70  # a partial group of four rows and a partial tile of 16 columns
    a = RNG.integers(0, 256, (3, depth)).astype(np.uint8)
    b = RNG.integers(0, 256, (depth, width)).astype(np.uint8) if flip else \
        RNG.integers(-128, 128, (depth, width)).astype(np.int8)
    groups = (depth + 3) // 4
    tiles = np.zeros(((width + vnni.TILE - 1) // vnni.TILE, groups, vnni.TILE, 4), np.uint8)
    column_sums = np.empty(width, np.int32)
    vnni.repack(b, flip, tiles, column_sums)
    words, _ = vnni.unsigned_rows(a, False, groups)
    raw = np.full((3, tiles.shape[0] * vnni.TILE), -7, np.int32)
    vnni.tile_sums_into(tiles, words, raw, 0, tiles.shape[0])
    signed = b.astype(np.int64) - (128 if flip else 0)
    np.testing.assert_array_equal(raw[:, :width], a.astype(np.int64) @ signed)
    np.testing.assert_array_equal(raw[:, width:], 0)  # the zero-filled columns of the last tile


def test_matmul_integer_of_a_constant_weight_is_the_same_on_any_thread_count():
    """The VNNI product is a decode pool job of column tiles (`post_vnni`): with workers or alone,
    the same int32 values, equal to exact arithmetic."""
    from runnx.ops import linalg_integer as linalg
    from runnx.runtime import pool as decode_pool

    a = RNG.integers(0, 256, (2, 576)).astype(np.uint8)
    b = RNG.integers(-128, 128, (576, 1100)).astype(np.int8)
    b.flags.writeable = False
    a_zero, b_zero = np.array(131, np.uint8), np.array(-3, np.int8)
    expected = (a.astype(np.int64) - 131) @ (b.astype(np.int64) + 3)
    workers = decode_pool.worker_count()
    try:
        results = []
        for count in (0, 2, 2):
            decode_pool.set_workers(count)
            results.append(linalg.MatMulInteger(a, b, a_zero, b_zero))
    finally:
        decode_pool.set_workers(workers)
    for result in results:
        np.testing.assert_array_equal(result, expected)


@pytest.mark.parametrize("first, stop", [(0, 1), (0, 3), (0, 4), (5, 6), (3, 38), (0, 513), (17, 530)])
@pytest.mark.parametrize("depth, height", [(576, 1), (37, 1), (64, 3)])
def test_columns_read_in_quarters_are_each_columns_own_dot(first, stop, depth, height):
    """`columns_into` reads its range's columns four quarters side by side (`_lane_dots4`), each
    element the sum `_lane_dot` makes of that column alone: so the bits do not depend on the range
    a column falls in, its place among the quarters, or how many rows come with it; float64's
    product to float32's rounding. Outside the range nothing is written."""
    import numba

    from runnx.ops._kernels_linalg import _lane_dot, columns_into

    @numba.njit
    def one_at_a_time(rows, columns, out, first, stop):
        for n in range(first, stop):
            for m in range(rows.shape[0]):
                out[m, n] = _lane_dot(rows[m], columns, n)

    rows = RNG.standard_normal((height, depth)).astype(np.float32)
    columns = RNG.standard_normal((stop + 7, depth)).astype(np.float32)
    out, expected = np.full((height, stop + 7), 7.0, np.float32), np.full((height, stop + 7), 7.0, np.float32)
    columns_into(rows, columns, out, first, stop)
    one_at_a_time(rows, columns, expected, first, stop)
    assert np.array_equal(out, expected)
    assert (out[:, :first] == 7).all() and (out[:, stop:] == 7).all()
    exact = rows.astype(np.float64) @ columns[first:stop].T.astype(np.float64)
    np.testing.assert_allclose(out[:, first:stop], exact, rtol=1e-4, atol=1e-4 * np.sqrt(depth))
