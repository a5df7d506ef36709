"""onnxruntime's contrib quantised operators against onnxruntime: MatMulNBits (bits, block sizes,
odd K tails, packed and typed zero points, streamed and BLAS-panel row counts), MatMulBnb4 (FP4 and
NF4, blocks spanning columns, odd K and odd code counts, compiled and numpy paths), GatherBlockQuantized,
DynamicQuantizeMatMul and MatMulIntegerToFloat."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import runnx
from runnx.errors import RunnxError
from tests.ops._contrib_node import assert_close, contrib_model, run_both

RNG = np.random.default_rng(43)


def _nbits_inputs(rows, K, N, bits, block_size, zero_points, dtype=np.float32, rng=None):
    """A, packed B, scales and zero points (None, packed uint8, or typed) of random values (from
    the module's generator unless `rng` is given)."""
    rng = RNG if rng is None else rng
    blocks = (K + block_size - 1) // block_size
    a = rng.standard_normal(rows + (K,)).astype(dtype)
    b = rng.integers(0, 256, (N, blocks, block_size * bits // 8), dtype=np.uint8)
    scales = (rng.random(N * blocks) * 0.1 + 0.01).astype(dtype)
    if zero_points == "packed":
        zeros = rng.integers(0, 256, N * ((blocks * bits + 7) // 8), dtype=np.uint8)
    elif zero_points == "typed":
        zeros = rng.uniform(0, 2 ** bits - 1, N * blocks).astype(dtype)
    else:
        zeros = None
    return a, b, scales, zeros


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("zero_points", [None, "packed", "typed"])
@pytest.mark.parametrize("K,block_size", [(64, 16), (32, 32), (67, 32), (128, 32), (200, 64), (130, 128), (300, 256)])
@pytest.mark.parametrize("rows", [(1,), (2, 3), (19,), (70,)])  # streamed or tiled (up to 64 rows), and panels
def test_matmul_nbits(bits, zero_points, K, block_size, rows):
    N = 33
    a, b, scales, zeros = _nbits_inputs(rows, K, N, bits, block_size, zero_points)
    if bits == 8 and zero_points == "typed":  # onnxruntime's CPU kernel refuses these: numpy is the reference
        model, feeds = contrib_model("MatMulNBits", [a, b, scales, zeros], ["y"], initializers=(1, 2, 3), K=K, N=N,
                                     bits=bits, block_size=block_size)
        got = runnx.load(model).run(feeds)["y"]
        blocks = b.shape[1]
        weights = (b.reshape(N, -1)[:, :K].astype(np.float64)
                   - np.repeat(zeros.reshape(N, blocks), block_size, axis=1)[:, :K])
        weights *= np.repeat(scales.reshape(N, blocks), block_size, axis=1)[:, :K]
        want = a @ weights.T  # (float32 sums of up to K terms of ~|want| each: atol scales with them)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * max(1.0, float(np.abs(want).max())))
        return
    got, expected = run_both("MatMulNBits", [a, b, scales, zeros], initializers=(1, 2, 3), K=K, N=N, bits=bits,
                             block_size=block_size)
    assert_close(got, expected, rtol=1e-4, atol=1e-4)


def _nbits_reference(a, b, scales, zeros, K, N, bits, block_size):
    """a @ dequantized(b).T in float64 by numpy: values low bits first in each byte, packed zero
    points each column's bytes afresh (or 2^(bits-1) without them)."""
    blocks, per_byte = b.shape[1], 8 // bits
    shifts = np.arange(per_byte, dtype=np.uint8) * bits
    values = ((b.reshape(N, -1, 1) >> shifts) & (2 ** bits - 1)).reshape(N, -1)[:, :K].astype(np.float64)
    if zeros is None:
        zero = np.full((N, blocks), 2.0 ** (bits - 1))
    else:
        zero = ((zeros.reshape(N, -1, 1) >> shifts) & (2 ** bits - 1)).reshape(N, -1)[:, :blocks]
    weights = (values - np.repeat(zero, block_size, axis=1)[:, :K]) * np.repeat(
        scales.reshape(N, blocks), block_size, axis=1)[:, :K]
    return a.astype(np.float64) @ weights.T


@pytest.mark.parametrize("zero_points", [None, "packed"])
@pytest.mark.parametrize("K,block_size", [(64, 16), (100, 32), (256, 64)])
@pytest.mark.parametrize("rows", [(1,), (3,), (19,)])
def test_matmul_nbits_two_bits(zero_points, K, block_size, rows):
    """2 bits (onnxruntime's CPU kernel has none: numpy is the reference), streamed and BLAS panels."""
    N = 21
    a, b, scales, zeros = _nbits_inputs(rows, K, N, 2, block_size, zero_points)
    model, feeds = contrib_model("MatMulNBits", [a, b, scales, zeros], ["y"], initializers=(1, 2, 3), K=K, N=N,
                                 bits=2, block_size=block_size)
    got = runnx.load(model).run(feeds)["y"]
    np.testing.assert_allclose(got, _nbits_reference(a, b, scales, zeros, K, N, 2, block_size), rtol=1e-4,
                               atol=1e-4)


@pytest.mark.parametrize("K,block_size", [(576, 32), (320, 64)])
@pytest.mark.parametrize("count", [8, 64])
def test_matmul_nbits_few_rows_stream_deterministically(monkeypatch, K, block_size, count):
    """Decoding's few-row products and a short prompt's (up to `tiled_rows()`) read the packed
    weights (no panel dequantized), and a row's result does not depend on the rows beside it: one
    row alone equals it inside a batch, bit for bit."""
    from runnx.ops import contrib_quantized

    count = min(count, contrib_quantized.tiled_rows())

    def refuse(*args):
        raise AssertionError("a panel was dequantized for a few rows")
    monkeypatch.setattr(contrib_quantized, "nbits_dequantize", refuse)
    monkeypatch.setattr(contrib_quantized, "nibble_lanes_panel", refuse)
    N = 70
    a, b, scales, zeros = _nbits_inputs((count,), K, N, 4, block_size, "packed")
    attributes = dict(K=K, N=N, bits=4, block_size=block_size)
    batch = contrib_quantized.MatMulNBits(a, b, scales, zeros, **attributes)
    for row in (0, 5, count - 1):
        alone = contrib_quantized.MatMulNBits(a[row:row + 1], b, scales, zeros, **attributes)
        np.testing.assert_array_equal(alone[0], batch[row])
    np.testing.assert_allclose(batch, _nbits_reference(a, b, scales, zeros, K, N, 4, block_size), rtol=1e-4,
                               atol=1e-4)


def test_matmul_nbits_bias_two_dimensional_scales_and_accuracy_level():
    K, N, block_size = 96, 10, 32
    rng = np.random.default_rng(7)  # its own inputs: accuracy_level 4's error is near the tolerance on some
    a, b, scales, zeros = _nbits_inputs((4,), K, N, 4, block_size, "packed", rng=rng)
    bias = rng.standard_normal(N).astype(np.float32)
    inputs = [a, b, scales.reshape(N, -1), zeros, None, bias]
    got, expected = run_both("MatMulNBits", inputs, initializers=(1, 2, 3, 5), K=K, N=N, block_size=block_size)
    assert_close(got, expected, rtol=1e-4, atol=1e-4)
    # accuracy_level 4 lets onnxruntime quantize A to int8 per block: close, not equal
    got, expected = run_both("MatMulNBits", inputs, initializers=(1, 2, 3, 5), K=K, N=N, block_size=block_size,
                             accuracy_level=4)
    np.testing.assert_allclose(got[0], expected[0], rtol=0.05, atol=0.05)


def test_matmul_nbits_float16():
    K, N, block_size = 80, 12, 16
    a, b, scales, zeros = _nbits_inputs((3,), K, N, 4, block_size, "packed", dtype=np.float16)
    got, expected = run_both("MatMulNBits", [a, b, scales, zeros], initializers=(1, 2, 3), K=K, N=N,
                             block_size=block_size)
    assert_close(got, expected, rtol=1e-2, atol=1e-2)


def test_matmul_nbits_trivial_g_idx_accepted_reordered_refused():
    K, N, block_size = 64, 4, 32
    a, b, scales, _ = _nbits_inputs((2,), K, N, 4, block_size, None)
    trivial = (np.arange(K) // block_size).astype(np.int32)
    got, expected = run_both("MatMulNBits", [a, b, scales, None, trivial], initializers=(1, 2, 4), K=K, N=N,
                             block_size=block_size)
    assert_close(got, expected, rtol=1e-4, atol=1e-4)
    model, feeds = contrib_model("MatMulNBits", [a, b, scales, None, trivial[::-1].copy()], ["y"],
                                 initializers=(1, 2, 4), K=K, N=N, block_size=block_size)
    with pytest.raises(RunnxError, match="g_idx"):
        runnx.load(model).run(feeds)


def test_matmul_nbits_wrong_weight_shape_is_refused():
    a, b, scales, _ = _nbits_inputs((2,), 64, 4, 4, 32, None)
    model, feeds = contrib_model("MatMulNBits", [a, b[:, :1], scales], ["y"], initializers=(1, 2), K=64, N=4,
                                 block_size=32)
    with pytest.raises(RunnxError, match=r"B must be uint8 of shape \[4, 2, 16\]"):
        runnx.load(model).run(feeds)


def _bnb4_inputs(rows, K, N, block_size):
    """A, packed codes (every byte value: all 16 codes in both nibbles) and absmax of random values."""
    a = RNG.standard_normal(rows + (K,)).astype(np.float32)
    b = RNG.integers(0, 256, (K * N + 1) // 2, dtype=np.uint8)
    absmax = (RNG.random((K * N + block_size - 1) // block_size) + 0.05).astype(np.float32)
    return a, b, absmax


BNB4_SHAPES = [(64, 33, 16), (67, 33, 32), (200, 31, 64), (131, 17, 128), (300, 9, 256), (576, 40, 64)]


@pytest.mark.parametrize("quant_type", [0, 1], ids=["fp4", "nf4"])
@pytest.mark.parametrize("K,N,block_size", BNB4_SHAPES)  # odd K; K not a multiple of the block; K*N odd
@pytest.mark.parametrize("rows", [(1,), (2, 3), (19,), (70,)])  # streamed or tiled (up to 64 rows), and panels
def test_matmul_bnb4(quant_type, K, N, block_size, rows):
    a, b, absmax = _bnb4_inputs(rows, K, N, block_size)
    got, expected = run_both("MatMulBnb4", [a, b, absmax], initializers=(1, 2), K=K, N=N, block_size=block_size,
                             quant_type=quant_type)
    assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("K,N,block_size", [(67, 33, 32), (200, 31, 64)])
@pytest.mark.parametrize("rows", [(1,), (19,)])
def test_matmul_bnb4_numpy_path(monkeypatch, K, N, block_size, rows):
    """With the kernels off (`_native`) every row count goes through numpy-dequantized panels."""
    from runnx.ops import _native
    monkeypatch.setattr(_native, "enabled", False)
    a, b, absmax = _bnb4_inputs(rows, K, N, block_size)
    got, expected = run_both("MatMulBnb4", [a, b, absmax], initializers=(1, 2), K=K, N=N, block_size=block_size,
                             quant_type=1)
    assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_matmul_bnb4_few_rows_never_dequantize(monkeypatch):
    """Decoding's one-row products stream the packed codes: no panel is dequantized."""
    from runnx.ops import contrib_quantized

    def refuse(*args):
        raise AssertionError("a panel was dequantized for one row")
    monkeypatch.setattr(contrib_quantized, "bnb4_dequantize", refuse)
    a, b, absmax = _bnb4_inputs((1,), 128, 16, 64)
    got, expected = run_both("MatMulBnb4", [a, b, absmax], initializers=(1, 2), K=128, N=16, block_size=64,
                             quant_type=1)
    assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_matmul_bnb4_float16_activations():
    """onnxruntime's CPU kernel takes float32 only: float16 A (and absmax) is the float32 product of
    the same values, rounded to float16 once."""
    K, N, block_size = 128, 24, 32
    a, b, absmax = _bnb4_inputs((3,), K, N, block_size)
    a16, absmax16 = a.astype(np.float16), absmax.astype(np.float16)
    _, expected = run_both("MatMulBnb4", [a16.astype(np.float32), b, absmax16.astype(np.float32)],
                           initializers=(1, 2), K=K, N=N, block_size=block_size, quant_type=0)
    model, feeds = contrib_model("MatMulBnb4", [a16, b, absmax16], ["y"], initializers=(1, 2), K=K, N=N,
                                 block_size=block_size, quant_type=0)
    got = runnx.load(model).run(feeds)["y"]
    assert got.dtype == np.float16
    np.testing.assert_allclose(got.astype(np.float32), expected[0], rtol=2e-3, atol=2e-3)

@pytest.mark.parametrize("attributes, inputs, message", [
    ({"quant_type": 2}, None, "quant_type must be 0 \\(FP4\\) or 1 \\(NF4\\), got 2"),
    ({"block_size": 48}, None, "block_size must be a power of 2"),
    ({"transB": 0}, None, "only transB=1"),
    ({}, "short_b", "B must be uint8 with 2048 bytes"),
    ({}, "short_absmax", "absmax has 63 values, expected 64"),
])
def test_matmul_bnb4_bad_input_is_refused(attributes, inputs, message):
    a, b, absmax = _bnb4_inputs((2,), 64, 64, 64)
    if inputs == "short_b":
        b = b[:-1]
    if inputs == "short_absmax":
        absmax = absmax[:-1]
    model, feeds = contrib_model("MatMulBnb4", [a, b, absmax], ["y"], initializers=(1, 2),
                                 **{"K": 64, "N": 64, "block_size": 64, "quant_type": 1, **attributes})
    with pytest.raises(RunnxError, match=message):
        runnx.load(model).run(feeds)


@pytest.mark.parametrize("bits,width,block_size", [(4, 64, 32), (4, 70, 16), (8, 48, 16)])
@pytest.mark.parametrize("with_zero_points", [True, False])
def test_gather_block_quantized_packed_uint8(bits, width, block_size, with_zero_points):
    rows, per_byte = 11, 8 // bits
    blocks = (width + block_size - 1) // block_size
    data = RNG.integers(0, 256, (rows, (width + per_byte - 1) // per_byte), dtype=np.uint8)
    scales = (RNG.random((rows, blocks)) + 0.1).astype(np.float32)
    zeros = RNG.integers(0, 256, (rows, (blocks + per_byte - 1) // per_byte), dtype=np.uint8)
    indices = np.array([[3, 0, 10], [-1, 5, 3]], np.int64)
    inputs = [data, indices, scales, zeros if with_zero_points else None]
    got, expected = run_both("GatherBlockQuantized", inputs, initializers=(0, 2, 3), bits=bits,
                             block_size=block_size)
    assert_close(got, expected)


@pytest.mark.parametrize("bits,width,block_size", [(4, 576, 32), (4, 70, 16), (2, 40, 16), (8, 48, 32)])
@pytest.mark.parametrize("with_zero_points", [True, False])
def test_gather_block_quantized_compiled_rows_are_numpys_bits(bits, width, block_size, with_zero_points, monkeypatch):
    """An embedding table's gathered rows (a prompt's thousands) dequantized by the compiled kernel are
    the bits of numpy's arithmetic (int32 differences times the scales in float64, rounded once), in
    the indices' shape."""
    from runnx.ops import _native, contrib_quantized

    rows, per_byte = 50, 8 // bits
    blocks = (width + block_size - 1) // block_size
    data = RNG.integers(0, 256, (rows, (width + per_byte - 1) // per_byte), dtype=np.uint8)
    scales = (RNG.standard_normal((rows, blocks)) * 0.05).astype(np.float32)
    zeros = RNG.integers(0, 256, (rows, (blocks + per_byte - 1) // per_byte), dtype=np.uint8) if with_zero_points else None
    indices = RNG.integers(-rows, rows, (3, 700))
    attributes = dict(bits=bits, block_size=block_size)
    compiled = contrib_quantized.GatherBlockQuantized(data, indices, scales, zeros, **attributes)
    monkeypatch.setattr(_native, "enabled", False)
    expected = contrib_quantized.GatherBlockQuantized(data, indices, scales, zeros, **attributes)
    assert compiled.shape == expected.shape == (3, 700, data.shape[1] * per_byte) and compiled.dtype == np.float32
    np.testing.assert_array_equal(compiled.view(np.int32), expected.view(np.int32))


def test_gather_block_quantized_int4_data():
    data = RNG.integers(-8, 8, (6, 64)).astype(ml_dtypes.int4)
    scales = (RNG.random((6, 2)) + 0.1).astype(np.float16)
    got, expected = run_both("GatherBlockQuantized", [data, np.array([4, 1], np.int32), scales],
                             initializers=(0, 2), block_size=32)
    assert_close(got, expected)


@pytest.mark.parametrize("b_dtype", [np.uint8, np.int8])
@pytest.mark.parametrize("per_column", [True, False])
def test_dynamic_quantize_matmul(b_dtype, per_column):
    # |B| <= 63 keeps onnxruntime's u8 x s8 pair sums below int16 saturation (see the caveat):
    # with larger weights its AVX2 kernel is not exact, runnx is
    low, high = (0, 64) if b_dtype == np.uint8 else (-63, 64)
    b = RNG.integers(low, high, (24, 7)).astype(b_dtype)
    shape = (7,) if per_column else ()
    b_scale = (RNG.random(shape) * 0.1 + 0.01).astype(np.float32)
    b_zero = RNG.integers(0, 10, shape).astype(b_dtype)
    inputs = [RNG.standard_normal((2, 5, 24)).astype(np.float32), b, b_scale, b_zero,
              RNG.standard_normal(7).astype(np.float32)]
    got, expected = run_both("DynamicQuantizeMatMul", inputs, initializers=(1, 2, 3, 4))
    assert_close(got, expected, rtol=1e-5, atol=1e-4)


def test_matmul_integer_to_float_is_exact_integer_arithmetic_scaled():
    a = RNG.integers(0, 256, (3, 40)).astype(np.uint8)
    b = RNG.integers(-128, 128, (40, 6)).astype(np.int8)
    a_scale, b_scale = np.array(0.02, np.float32), (RNG.random(6) * 0.1).astype(np.float32)
    a_zero, b_zero = np.array(131, np.uint8), RNG.integers(-5, 5, 6).astype(np.int8)
    bias = RNG.standard_normal(6).astype(np.float32)
    model, feeds = contrib_model("MatMulIntegerToFloat", [a, b, a_scale, b_scale, a_zero, b_zero, bias], ["y"],
                                 initializers=(1, 3, 5, 6))
    got = runnx.load(model).run(feeds)["y"]
    # full-range u8 x s8: onnxruntime's AVX2 kernel saturates 16-bit pair sums, so the reference
    # is exact integer arithmetic here
    exact = (a.astype(np.int64) - 131) @ (b.astype(np.int64) - b_zero)
    np.testing.assert_allclose(got, (exact * (a_scale * b_scale)).astype(np.float32) + bias, rtol=1e-6, atol=1e-5)
    small = np.clip(b, -63, 63)
    got, expected = run_both("MatMulIntegerToFloat", [a, small, a_scale, b_scale, a_zero, b_zero, bias],
                             initializers=(1, 3, 5, 6))
    assert_close(got, expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("zero_points", [None, "packed", "typed"])
@pytest.mark.parametrize("K,block_size", [(64, 16), (67, 32), (130, 128), (301, 64)])
def test_matmul_nbits_4_bit_panels_hold_the_same_values_in_lanes_order(zero_points, K, block_size):
    """Many rows multiply a panel of 4-bit columns dequantized in lanes order (even positions, then
    odd ones): the same values as the natural order's, bit for bit, odd K included; the rows are
    reordered alike."""
    from runnx.ops._kernels_contrib import ZERO_DEFAULT, ZERO_PACKED, ZERO_TYPED, nbits_dequantize, nibble_lanes_panel
    from runnx.ops.contrib_quantized import lanes_order

    N = 9
    a, b, scales, zeros = _nbits_inputs((5,), K, N, 4, block_size, zero_points)
    empty_packed, empty_typed = np.zeros(0, np.uint8), np.zeros(0, np.float32)
    mode, packed, typed = {None: (ZERO_DEFAULT, empty_packed, empty_typed),
                           "packed": (ZERO_PACKED, zeros, empty_typed),
                           "typed": (ZERO_TYPED, empty_packed, zeros)}[zero_points]
    natural, lanes = np.empty((N - 2, K), np.float32), np.empty((N - 2, K), np.float32)
    nbits_dequantize(b, scales, packed, typed, mode, 4, block_size, 2, natural)
    nibble_lanes_panel(b, scales, packed, typed, mode, block_size, 2, lanes)
    order = np.concatenate([np.arange(0, K, 2), np.arange(1, K, 2)])
    np.testing.assert_array_equal(lanes, natural[:, order])
    np.testing.assert_array_equal(lanes_order(a), a[:, order])


@pytest.mark.parametrize("K,N,block_size", [(576, 70, 32), (320, 1100, 64), (200, 33, 32)])
@pytest.mark.parametrize("rows", [(1,), (3,)])
def test_matmul_nbits_4_bit_rows_are_the_same_bits_on_any_thread_count(K, N, block_size, rows):
    """The 4-bit few-row product is a job of column blocks for the decode pool: computed with
    workers (several blocks at once) or alone, it gives the same bits, read-only weights or not,
    and its remembered tiles (the weights repacked with their scales and zero points) belong to
    their weights: other weights of the same shapes get their own."""
    from runnx.ops import contrib_quantized
    from runnx.runtime import pool as decode_pool

    a, b, scales, zeros = _nbits_inputs(rows, K, N, 4, block_size, "packed")
    attributes = dict(K=K, N=N, bits=4, block_size=block_size)
    workers = decode_pool.worker_count()
    try:
        decode_pool.set_workers(0)
        alone = contrib_quantized.MatMulNBits(a, b, scales, zeros, **attributes)
        for array in (b, scales, zeros):
            array.flags.writeable = False
        decode_pool.set_workers(2)
        for _ in range(5):
            np.testing.assert_array_equal(contrib_quantized.MatMulNBits(a, b, scales, zeros, **attributes), alone)
        other = (scales * 2).astype(scales.dtype)
        other.flags.writeable = False
        np.testing.assert_array_equal(contrib_quantized.MatMulNBits(a, b, other, zeros, **attributes), 2 * alone)
        changed = b.copy()
        changed[0, 0, 0] ^= 0x11
        changed.flags.writeable = False
        moved = contrib_quantized.MatMulNBits(a, changed, scales, zeros, **attributes)
        assert not np.array_equal(moved[..., 0], alone[..., 0]) and np.array_equal(moved[..., 1:], alone[..., 1:])
    finally:
        decode_pool.set_workers(workers)
    np.testing.assert_allclose(alone, _nbits_reference(a, b, scales, zeros, K, N, 4, block_size), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("K,N,block_size", [(576, 70, 32), (130, 33, 128)])
@pytest.mark.parametrize("rows", [(1,), (5,)])
def test_matmul_nbits_4_bit_tiles_keep_zero_points_as_given(K, N, block_size, rows):
    """A few-row 4-bit product streams its tiles: 16 bytes of weights and a float32 scale for each
    32 values of a column, and the zero points as the model gives them (a byte for 4-bit ones, one
    shared row for the default), each multiplied by its scale in the kernel. The same zero points
    given as bytes, as floats of the scales' type, or left to the default (8), give the same bits."""
    from runnx.ops.contrib_quantized import MatMulNBits
    from runnx.ops.nibble_tiles import _nibble_tiles

    a, b, scales, _ = _nbits_inputs(rows, K, N, 4, block_size, None)
    blocks, chunks, tiles = b.shape[1], b.shape[1] * block_size // 32, (N + 15) // 16
    attributes = dict(K=K, N=N, bits=4, block_size=block_size)
    default = MatMulNBits(a, b, scales, None, **attributes)
    eights = np.full(N * ((blocks + 1) // 2), 0x88, np.uint8)
    np.testing.assert_array_equal(MatMulNBits(a, b, scales, eights, **attributes), default)
    typed = np.full(N * blocks, 8, np.float32)
    np.testing.assert_array_equal(MatMulNBits(a, b, scales, typed, **attributes), default)
    np.testing.assert_allclose(default, _nbits_reference(a, b, scales, None, K, N, 4, block_size), rtol=1e-4,
                               atol=1e-4)

    weights, tile_scales, zeros = _nibble_tiles((), b, scales, None)
    assert (weights.nbytes, tile_scales.nbytes) == (tiles * chunks * 16 * 16, tiles * chunks * 16 * 4)
    assert zeros.dtype == np.uint8 and zeros.shape == (1, 1, 16) and (zeros == 8).all()
    assert _nibble_tiles((), b, scales, eights)[2].shape == (tiles, chunks, 16)
    assert _nibble_tiles((), b, scales, eights)[2].dtype == np.uint8
    assert _nibble_tiles((), b, scales, typed)[2].dtype == np.float32


@pytest.mark.parametrize("K,N,block_size", [(576, 70, 32), (256, 48, 64), (130, 33, 128)])
@pytest.mark.parametrize("zero_points", [None, "packed", "typed"])
def test_matmul_nbits_4_bit_prompt_rows_are_each_the_one_row_bits(K, N, block_size, zero_points):
    """A prompt's rows go GROUPED_ROWS at a time over one unpacking of each tile (`_tiles_dot`), the rest one
    by one, or from UNPACKED_ROWS rows over each chunk unpacked once into floats: every row is the
    bits of that row alone (a decode step's product), whatever the number of rows around it, for each
    kind of zero point and a last tile short of 16 columns."""
    from runnx.ops.contrib_quantized import MatMulNBits
    from runnx.ops._kernels_nibble_tiles import GROUPED_ROWS, UNPACKED_ROWS

    a, b, scales, zeros = _nbits_inputs((35,), K, N, 4, block_size, zero_points)
    for array in (b, scales, zeros):
        if array is not None:
            array.flags.writeable = False
    attributes = dict(K=K, N=N, bits=4, block_size=block_size)
    each = np.concatenate([MatMulNBits(a[m:m + 1], b, scales, zeros, **attributes) for m in range(35)])
    runnx.runtime.settle()
    for count in (GROUPED_ROWS, GROUPED_ROWS + 3, 2 * GROUPED_ROWS, max(UNPACKED_ROWS, 1), 35):
        np.testing.assert_array_equal(MatMulNBits(a[:count], b, scales, zeros, **attributes), each[:count])
        runnx.runtime.settle()
    if zero_points != "typed":  # (the reference reads zero points as packed nibbles)
        np.testing.assert_allclose(each, _nbits_reference(a, b, scales, zeros, K, N, 4, block_size), rtol=1e-4,
                                   atol=1e-4)


@pytest.mark.parametrize("zero_points", [None, "packed", "typed"])
def test_rows_over_unpacked_chunks_are_each_the_one_row_bits(zero_points):
    """`tile_rows_unpacked` (each chunk of a tile unpacked once into floats for all rows), which
    `tile_rows` takes from UNPACKED_ROWS rows where the CPU has it, run directly on every CPU: each
    row is `tile_rows`'s one-row bits, for 1, 2, 7 and 13 rows and a range of tiles inside the weight,
    and it writes no column outside that range."""
    from runnx.ops._kernels_nibble_tiles import tile_rows, tile_rows_unpacked
    from runnx.ops.nibble_tiles import _nibble_tiles

    K, N, block_size = 576, 80, 32
    a, b, scales, zeros = _nbits_inputs((13,), K, N, 4, block_size, zero_points)
    tiles, tile_scales, tile_zeros = _nibble_tiles((), b, scales, zeros)
    chunks = tiles.shape[1]
    lanes = np.zeros((13, 2, 16 * chunks), np.float32)
    lanes[:, 0, :K // 2], lanes[:, 1, :K // 2] = a[:, 0::2], a[:, 1::2]
    sums = lanes.reshape(13, 2, chunks, 16).sum(axis=(1, 3), dtype=np.float32)
    each = np.empty((13, N), np.float32)
    for m in range(13):
        tile_rows(lanes[m:m + 1], sums[m:m + 1], tiles, tile_scales, tile_zeros, each[m:m + 1], 0, tiles.shape[0])
    assert np.abs(each).max() > 0
    for count in (1, 2, 7, 13):
        out = np.full((count, N), np.nan, np.float32)
        tile_rows_unpacked(lanes[:count], sums[:count], tiles, tile_scales, tile_zeros, out, 1, 4)
        np.testing.assert_array_equal(out[:, 16:64], each[:count, 16:64])
        assert np.isnan(out[:, :16]).all() and np.isnan(out[:, 64:]).all()


@pytest.mark.parametrize("tiles,chunks", [(1, 1), (3, 2), (5, 18), (2, 48)])
def test_a_weights_bytes_transposed_in_registers_are_its_tiles_and_nothing_else_is_written(tiles, chunks):
    """`transpose_tiles` (16 x 16 byte blocks transposed by vector shuffles) writes tile t's chunk c
    as byte j of columns 16 t .. 16 t + 15 at [t, c, j]: numpy's transposing copy, every byte distinct
    enough to catch a lane out of place; columns past the tiles are not read, nothing past them written."""
    from runnx.ops._kernels_nibble_layout import transpose_tiles

    rng = np.random.default_rng(tiles * 100 + chunks)
    weights = rng.integers(0, 256, (16 * tiles + 7, chunks, 16), dtype=np.uint8)
    out = np.full((tiles + 1, chunks, 16, 16), 0xA5, np.uint8)
    transpose_tiles(weights, out[:tiles])
    expected = weights[:16 * tiles].reshape(tiles, 16, chunks, 16).transpose(0, 2, 3, 1)
    np.testing.assert_array_equal(out[:tiles], expected)
    assert (out[tiles] == 0xA5).all()
    with pytest.raises(ValueError, match="fewer columns"):
        transpose_tiles(weights[:16 * tiles - 1], out[:tiles])


def test_repacking_into_tiles_of_another_shape_is_refused():
    """`repack` writes by index into buffers it is handed: tiles too few for the weight's columns, or
    of another number of chunks, raise before anything is written."""
    from runnx.ops._kernels_contrib import ZERO_DEFAULT
    from runnx.ops._kernels_nibble_layout import repack

    weights = np.zeros((33, 4, 16), np.uint8)  # 33 columns: three tiles, 4 chunks of a block each
    scales, none_u8, none_f32 = np.ones(33 * 4, np.float32), np.empty(0, np.uint8), np.empty(0, np.float32)
    zeros_u8, zeros_f32 = np.empty((0, 1, 16), np.uint8), np.empty((0, 1, 16), np.float32)
    for count, chunks in ((2, 4), (3, 3)):
        tiles = np.full((count, chunks, 16, 16), 0xA5, np.uint8)
        with pytest.raises(ValueError, match="another shape"):
            repack(weights, scales, none_u8, none_f32, ZERO_DEFAULT, tiles, np.empty((count, chunks, 16), np.float32),
                   zeros_u8, zeros_f32)
        assert (tiles == 0xA5).all()


@pytest.mark.parametrize("N,block_size", [(77, 32), (48, 64), (5, 128)])
@pytest.mark.parametrize("zero_points", [None, "packed", "typed"])
def test_4_bit_tiles_are_the_weights_bytes_in_their_layout_padding_zero(N, block_size, zero_points):
    """`repack` fills buffers from np.empty: tile t's chunk c holds byte j of columns 16 t .. 16 t + 15
    at [t, c, j], the chunk's scales and zero points beside it, every padding column zero."""
    from runnx.ops.nibble_tiles import _nibble_tiles

    K = 4 * block_size
    _, b, scales, zeros = _nbits_inputs((1,), K, N, 4, block_size, zero_points)
    tiles, tile_scales, tile_zeros = _nibble_tiles((), b, scales, zeros)
    count, chunks = -(-N // 16), K // 32
    padded = np.zeros((count * 16, chunks, 16), np.uint8)
    padded[:N] = b.reshape(N, chunks, 16)
    np.testing.assert_array_equal(tiles, padded.reshape(count, 16, chunks, 16).transpose(0, 2, 3, 1))
    per_chunk = np.zeros((count * 16, chunks), np.float32)
    per_chunk[:N] = np.repeat(scales.reshape(N, -1), block_size // 32, axis=1)
    np.testing.assert_array_equal(tile_scales, per_chunk.reshape(count, 16, chunks).transpose(0, 2, 1))
    if zero_points is None:
        assert tile_zeros.shape == (1, 1, 16) and (tile_zeros == 8).all()
        return
    blocks = K // block_size
    if zero_points == "packed":  # two 4-bit zero points a byte, the first block's in the low nibble
        pairs = zeros.reshape(N, -1)
        block_zeros = np.stack([pairs & 15, pairs >> 4], axis=2).reshape(N, -1)[:, :blocks]
    else:
        block_zeros = zeros.reshape(N, blocks)
    zeros_per_chunk = np.zeros((count * 16, chunks), tile_zeros.dtype)
    zeros_per_chunk[:N] = np.repeat(block_zeros, block_size // 32, axis=1)
    assert tile_zeros.dtype == (np.uint8 if zero_points == "packed" else np.float32)
    np.testing.assert_array_equal(tile_zeros, zeros_per_chunk.reshape(count, 16, chunks).transpose(0, 2, 1))


@pytest.mark.parametrize("columns", [(32, 16, 48), (32, 20), (16, 21, 16)])
@pytest.mark.parametrize("zero_points", [None, "packed", "typed"])
def test_joined_4_bit_tiles_are_the_tiles_of_the_joined_weights(columns, zero_points):
    """SharedInputMatMulNBits' tiles: each part repacked into its share when the parts before the
    last have whole tiles, else the parts joined then repacked; the same arrays either way."""
    from runnx.ops.nibble_tiles import _joined_tiles, _nibble_tiles

    K, block_size = 128, 32
    parts = [_nbits_inputs((1,), K, n, 4, block_size, zero_points)[1:] for n in columns]
    joined = _joined_tiles((K, block_size, columns), *[x for part in parts for x in part])
    weights = np.concatenate([b for b, _, _ in parts])
    scales = np.concatenate([s.reshape(-1) for _, s, _ in parts])
    zeros = None if zero_points is None else np.concatenate([z.reshape(-1) for _, _, z in parts])
    for got, expected in zip(joined, _nibble_tiles((), weights, scales, zeros)):
        np.testing.assert_array_equal(got, expected)
        assert not got.flags.writeable


@pytest.mark.parametrize("rows, panels", [(600, 3), (3000, 1)])
def test_many_rows_take_panels_at_least_as_large_as_their_rows_with_the_same_bits(rows, panels, monkeypatch):
    """A prompt's 4-bit product dequantizes panels of columns of at least the rows' bytes (each
    panel's product packs every row again): 600 rows of 256 (600 KB) in 1 MB panels of 1024 columns,
    3000 rows (3 MB) in one (several panels: as many for each thread BLAS would use, when it
    multiplies them); each element the bits of narrow panels' products where runnx's own
    kernels multiply (any block of columns sums alike), within float32 rounding where
    OpenBLAS does (its kernels for a last, narrower block of columns may round otherwise)."""
    from runnx.ops import contrib_quantized
    from runnx.ops._matmul import own_product
    from runnx.ops.contrib_quantized import MatMulNBits
    from runnx.runtime.blas_split import blas_threads

    threads = 1 if own_product(rows, True) or panels == 1 else blas_threads()
    panels = -(-panels // threads) * threads

    a, b, scales, zeros = _nbits_inputs((rows,), 256, 2500, 4, 32, "packed", rng=np.random.default_rng(3))
    monkeypatch.setattr(contrib_quantized, "_PANEL_BYTES", 1 << 20)
    monkeypatch.setattr(contrib_quantized, "_OWN_PANEL_BYTES", 1 << 20)
    products = []
    matmul = contrib_quantized.matmul
    monkeypatch.setattr(contrib_quantized, "matmul", lambda x, y, out: products.append(y.shape) or matmul(x, y, out=out))
    wide = MatMulNBits(a, b, scales, zeros, K=256, N=2500, bits=4, block_size=32)
    assert len(products) == panels
    narrow = np.empty_like(wide)
    for first in range(0, 2500, 64):  # the same product, 64 columns at a time
        narrow[:, first:first + 64] = MatMulNBits(a, b[first:first + 64], scales.reshape(2500, -1)[first:first + 64],
                                                  zeros.reshape(2500, -1)[first:first + 64], K=256,
                                                  N=min(64, 2500 - first), bits=4, block_size=32)
    if own_product(rows, True):
        np.testing.assert_array_equal(wide, narrow)
    else:
        np.testing.assert_allclose(wide, narrow, rtol=1e-5, atol=1e-4)  # (sums of 256 terms up to ~10)


@pytest.mark.parametrize("zero_points", [None, "packed", "typed"])
@pytest.mark.parametrize("K,N,block_size", [(576, 70, 32), (67, 40, 32), (301, 33, 64), (130, 16, 128), (33, 17, 32)])
def test_4_bit_tiles_give_the_panels_of_the_weights_own_bytes(zero_points, K, N, block_size):
    """A prompt's panels dequantized from a weight's tiles (`tile_lanes_panel`) are the panels of its
    own bytes (`nibble_lanes_panel`), bit for bit: any column range (within a tile, across tiles, the
    last tile's), odd K and partial last blocks, every kind of zero point."""
    from runnx.ops._kernels_contrib import nibble_lanes_panel
    from runnx.ops._kernels_nibble_layout import tile_lanes_panel
    from runnx.ops.nibble_tiles import _nibble_tiles, nbits_zero_points

    _, b, scales, zeros = _nbits_inputs((1,), K, N, 4, block_size, zero_points)
    tiles = _nibble_tiles((), b, scales, zeros)
    mode, packed, typed = nbits_zero_points(zeros, N, b.shape[1], 4, np.float32)
    for first, count in [(0, N), (3, 9), (15, min(2, N - 15)), (N - 1, 1), (N // 2, N - N // 2)]:
        expected, got = np.empty((count, K), np.float32), np.full((count, K), np.nan, np.float32)
        nibble_lanes_panel(b, scales, packed, typed, mode, block_size, first, expected)
        tile_lanes_panel(*tiles, first, got)
        np.testing.assert_array_equal(got.view(np.int32), expected.view(np.int32))


def test_a_prompt_reads_4_bit_tiles_for_fewer_rows_alone_where_its_panels_are_blas_products(monkeypatch):
    """`tiled_rows`: a pool's workers share the tiles' job, and runnx's own float kernels multiply
    the panels (AVX-512): then up to TILED_ROWS rows read the tiles; on one thread with BLAS's panel
    products, up to ALONE_TILED_ROWS; and a product of more rows than that dequantizes panels."""
    from runnx.ops import contrib_quantized
    from runnx.runtime import pool as decode_pool

    for workers, own, expected in ((object(), False, contrib_quantized.TILED_ROWS),
                                   (None, True, contrib_quantized.TILED_ROWS),
                                   (None, False, contrib_quantized.ALONE_TILED_ROWS)):
        monkeypatch.setattr(decode_pool, "pool", lambda workers=workers: workers)
        monkeypatch.setattr(contrib_quantized, "own_product", lambda rows, matrix, own=own: own)
        assert contrib_quantized.tiled_rows() == expected
    assert contrib_quantized.ALONE_TILED_ROWS < contrib_quantized.TILED_ROWS
    panels = []
    monkeypatch.setattr(contrib_quantized, "_panels", lambda rows, lanes, out, fill: panels.append(rows.shape))
    K, N, block_size, rows = 96, 20, 32, contrib_quantized.ALONE_TILED_ROWS + 1
    a, b, scales, zeros = _nbits_inputs((rows,), K, N, 4, block_size, "packed")
    contrib_quantized.MatMulNBits(a, b, scales, zeros, K=K, N=N, bits=4, block_size=block_size)
    assert panels == [(rows, K)]


def test_a_prompts_4_bit_panels_are_dealt_evenly_to_the_threads_blas_would_use(monkeypatch):
    """Where BLAS multiplies a prompt's 4-bit panels with two threads, `_panels` deals whole panels
    to the threads instead, as many to each, none wider than one thread's would be, with the values
    one thread gives; a single panel (a long prompt's) stays one product for BLAS's threads."""
    from runnx.ops import contrib_quantized

    K, N, block_size = 96, 3000, 32
    rows = contrib_quantized.TILED_ROWS + 8
    a, b, scales, zeros = _nbits_inputs((rows,), K, N, 4, block_size, "packed")
    attributes = dict(K=K, N=N, bits=4, block_size=block_size)
    monkeypatch.setattr(contrib_quantized, "own_product", lambda rows, matrix: False)
    monkeypatch.setattr(contrib_quantized, "blas_threads", lambda: 1)
    alone = contrib_quantized.MatMulNBits(a, b, scales, zeros, **attributes)
    dealt = []

    def split(work, parts):
        dealt.append(list(parts))
        for part in parts:
            work(part)
        return True
    monkeypatch.setattr(contrib_quantized, "split_among_threads", split)
    monkeypatch.setattr(contrib_quantized, "blas_threads", lambda: 2)
    shared = contrib_quantized.MatMulNBits(a, b, scales, zeros, **attributes)
    one_thread_width = contrib_quantized._PANEL_BYTES // (K * 4)
    assert len(dealt) == 1 and len(dealt[0]) % 2 == 0 and len(dealt[0]) >= -(-N // one_thread_width)
    widths = np.diff(dealt[0] + [N])
    assert widths[0] <= one_thread_width and (widths[:-1] == widths[0]).all() and widths[-1] <= widths[0]
    np.testing.assert_allclose(shared, alone, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(shared, _nbits_reference(a, b, scales, zeros, K, N, 4, block_size), rtol=1e-4,
                               atol=1e-4)
    dealt.clear()
    long_rows = np.repeat(a, -(-contrib_quantized._PANEL_BYTES * 4 // a.nbytes), axis=0)  # rows of 4 MB: one panel
    contrib_quantized.MatMulNBits(long_rows, b, scales, zeros, **attributes)
    assert dealt == []


@pytest.mark.parametrize("zero_points", [None, "packed", "typed"])
def test_a_prompt_over_kept_tiles_reads_them_with_the_bits_of_the_weights_own_bytes(zero_points, monkeypatch):
    """Once a constant 4-bit weight has tiles, a prompt's product (more than TILED_ROWS rows) reads
    its panels from them, never the weight's own bytes (which `_release_weights` may hand back), and
    gives the bits of the product over those bytes; so do SharedInputMatMulNBits' products over their
    joined tiles, each part from its own columns."""
    from runnx.ops import _kernels_contrib, contrib_quantized
    from runnx.ops.contrib_quantized import MatMulNBits, SharedInputMatMulNBits

    K, block_size, columns = 96, 32, (48, 20, 33)
    rows = contrib_quantized.TILED_ROWS + 30
    a = RNG.standard_normal((1, rows, K)).astype(np.float32)
    parts = []
    for n in columns:
        _, b, scales, zeros = _nbits_inputs((1,), K, n, 4, block_size, zero_points)
        for array in (b, scales, zeros):
            if array is not None:
                array.flags.writeable = False  # (constants: their tiles are kept)
        parts.append((b, scales, zeros))
    expected = [MatMulNBits(a, *part, K=K, N=n, bits=4, block_size=block_size) for part, n in zip(parts, columns)]
    read = []
    monkeypatch.setattr(contrib_quantized, "nibble_lanes_panel",
                        lambda *args: read.append(args) or _kernels_contrib.nibble_lanes_panel(*args))
    for part, n, want in zip(parts, columns, expected):
        MatMulNBits(a[:, :1], *part, K=K, N=n, bits=4, block_size=block_size)  # one row: its tiles made and kept
        got = MatMulNBits(a, *part, K=K, N=n, bits=4, block_size=block_size)
        np.testing.assert_array_equal(got, want)
    flat = [x for part in parts for x in part]
    SharedInputMatMulNBits(a[:, :1], *flat, K=K, columns=columns, block_size=block_size)  # its joined tiles kept
    for got, want in zip(SharedInputMatMulNBits(a, *flat, K=K, columns=columns, block_size=block_size), expected):
        np.testing.assert_array_equal(got, want)
    assert read == []


@pytest.mark.parametrize("bits,block_size", [(4, 32), (4, 16), (8, 64), (2, 128)])
@pytest.mark.parametrize("depth", [1, 31, 576, 1000])
def test_nbits_lanes_are_a_copy_and_each_blocks_sum_in_order(bits, block_size, depth):
    """The rows of a k-bit product (`nbits_lanes`: every block's chain side by side) against the
    one loop a position and a block they replace: the lanes a copy, zero past K, and each block's
    sum a float64 chain in k's order from row[0] * 0 (inf and NaN in a row included), bit for bit."""
    from runnx.ops._kernels_contrib import nbits_lanes

    per_byte = 8 // bits
    blocks = -(-depth // block_size) + 1  # (one more than K needs: its sum is the chain's start)
    rows = (RNG.standard_normal((5, depth)) * 300).astype(np.float32)
    rows[1, 0], rows[2, -1], rows[3, 0] = np.inf, np.nan, -0.0
    lanes = np.full((5, per_byte, blocks * block_size // per_byte), 7, np.float32)
    sums = np.full((5, blocks), 7, np.float32)
    nbits_lanes(rows, block_size, lanes, sums)
    padded = np.zeros((5, blocks * block_size), np.float32)
    padded[:, :depth] = rows
    for lane in range(per_byte):
        np.testing.assert_array_equal(lanes[:, lane].view(np.int32), padded[:, lane::per_byte].view(np.int32))
    for m, row in enumerate(rows):
        for block in range(blocks):
            total = np.float64(row[0]) * 0.0
            for value in row[block * block_size:min(depth, (block + 1) * block_size)]:
                total += np.float64(value)
            assert np.float32(total).view(np.int32) == sums[m, block].view(np.int32), (m, block)
