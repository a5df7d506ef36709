"""Fused LayerNorm-block kernels against numpy written the unfused way (runnx/ops/fused_layer_norm_blocks.py)."""
import math

import numpy as np
import pytest

from runnx.ops import fused_layer_norm_blocks
from runnx.ops._kernels_rows import softmax_rows_float32
from runnx.ops.fused_layer_norm_blocks import AddLayerNorm, ErfGelu, HeadsAttention, SplitHeads
from runnx.ops.normalization import LayerNormalization

RNG = np.random.default_rng(0)
SPLIT = (0, 2, 1, 3)


def _softmax(scores):
    shifted = np.exp(scores - scores.max(axis=-1, keepdims=True, initial=-np.inf))
    return shifted / shifted.sum(axis=-1, keepdims=True)


def _reference(query, key, value, bias, query_scale, nan_fill, heads, key_perm, value_perm, query_bias=0):
    """The unfused nodes in float64: split heads, scaled scores (+ bias), softmax, NaN -> fill, merge."""
    batch, length, hidden = query.shape
    q = ((query.astype(np.float64) + query_bias) * query_scale).reshape(batch, length, heads, -1).transpose(SPLIT)
    scores = q @ key.astype(np.float64).transpose(key_perm)
    if bias is not None:
        scores = scores + bias
    with np.errstate(invalid="ignore"):
        probabilities = _softmax(scores)
    if nan_fill is not None:
        probabilities = np.where(np.isnan(probabilities), nan_fill, probabilities)
    merged = probabilities @ value.astype(np.float64).transpose(value_perm)
    return merged.transpose(SPLIT).reshape(batch, length, -1)


def _attend(query, key, value, bias=None, nan_fill=None, heads=4, key_perm=(0, 1, 3, 2), value_perm=(0, 1, 2, 3),
            query_bias=None):
    """HeadsAttention with targets read from shapes, as the fused node of a Whisper decoder has them:
    (source dims 0 and 1, -1, depth) for the split and (source dims 0 and 1, -1) for the merge."""
    depth = query.shape[-1] // heads
    scale = query.dtype.type(1 / math.sqrt(depth))  # (the scales and fill: numpy scalars, as attributes)
    fill = None if nan_fill is None else query.dtype.type(nan_fill)
    got = HeadsAttention(query, query_bias, key, value, bias, None, query, None, query, query_scale=scale,
                         nan_fill=fill, query_dims=(0, 0, -1, depth), query_axes=(0, 1, -1, -1), output_dims=(0, 0, -1),
                         output_axes=(0, 1, -1), key_perm=key_perm, value_perm=value_perm)
    want = _reference(query, key, value, bias, scale, fill, heads, key_perm, value_perm,
                      0 if query_bias is None else query_bias)
    return got, want


@pytest.mark.parametrize("length, size", [(1, 9), (5, 300), (37, 37), (2, 1), (3, 0)])
def test_heads_attention_over_a_cache_with_a_mask(length, size):
    query = RNG.standard_normal((2, length, 32)).astype(np.float32)
    key, value = RNG.standard_normal((2, 2, 4, size, 8)).astype(np.float32)
    bias = np.where(RNG.random((2, 1, length, size)) < 0.3, -np.inf, 0).astype(np.float32)
    got, want = _attend(query, key, value, bias, nan_fill=0.0)
    assert got.shape == (2, length, 32) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("workers", [0, 1])
def test_a_decode_row_attends_in_one_native_call_as_the_nodes_do(workers, monkeypatch):
    """Batch 1, one query position (a Whisper decode step's self-attention over its cache, a mask
    row, the query's bias): `attended_row` (one native call) against the nodes' operations and the
    path that does without it; a fully masked row gives fill times the values' sum there too."""
    from runnx.runtime import pool as decode_pool

    calls = []
    shared_call = fused_layer_norm_blocks.shared_call
    monkeypatch.setattr(fused_layer_norm_blocks, "shared_call", lambda job, *a: calls.append(job) or shared_call(job, *a))
    rng = np.random.default_rng(5)  # its own: the module's generator's state depends on xdist's order
    query = rng.standard_normal((1, 1, 32)).astype(np.float32)
    key, value = rng.standard_normal((2, 1, 4, 700, 8)).astype(np.float32)
    query_bias = rng.standard_normal(32).astype(np.float32)
    try:
        decode_pool.set_workers(workers)
        for masked in (0.3, 1.0):
            bias = np.where(rng.random((1, 1, 1, 700)) < masked, -np.inf, 0).astype(np.float32)
            got, want = _attend(query, key, value, bias, nan_fill=0.25, query_bias=query_bias)
            assert len(calls) == 1
            with monkeypatch.context() as patch:
                patch.setattr(fused_layer_norm_blocks, "attended_row", lambda *a, **k: None)
                apart, _ = _attend(query, key, value, bias, nan_fill=0.25, query_bias=query_bias)
            assert len(calls) == 1
            calls.clear()
            # sums of up to 700 terms in another order: an element near zero among outputs ~10 is
            # a few units of float32's last place of the terms apart
            scale = max(1.0, float(np.abs(want).max()))
            np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6 * scale)
            np.testing.assert_allclose(got, apart, rtol=1e-6, atol=1e-7 * scale)
        np.testing.assert_allclose(got.reshape(4, 8), 0.25 * value[0, :, :].sum(axis=1), rtol=1e-5)
    finally:
        decode_pool.set_workers(None)


def test_heads_attention_in_the_encoder_layout_a_block_of_rows_at_a_time(monkeypatch):
    """Keys (batch, kv, heads, depth) transposed (0, 2, 3, 1), values transposed (0, 2, 1, 3); blocks
    of 7 query rows (the last one short)."""
    monkeypatch.setattr(fused_layer_norm_blocks, "_BLOCK_SCORES", 7 * 50)
    query = RNG.standard_normal((1, 50, 24)).astype(np.float32) * 4
    key, value = RNG.standard_normal((2, 1, 50, 3, 8)).astype(np.float32)
    query_bias = RNG.standard_normal(24).astype(np.float32)
    got, want = _attend(query, key, value, heads=3, key_perm=(0, 2, 3, 1), value_perm=SPLIT, query_bias=query_bias)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)


def test_fully_masked_rows_give_fill_times_the_value_sum_or_nan_without_a_fill():
    query = RNG.standard_normal((1, 2, 8)).astype(np.float32)
    key, value = RNG.standard_normal((2, 1, 2, 3, 4)).astype(np.float32)
    bias = np.zeros((1, 1, 2, 3), np.float32)
    bias[0, 0, 1] = -np.inf  # the second query row sees nothing
    filled, want = _attend(query, key, value, bias, nan_fill=0.5, heads=2)
    np.testing.assert_allclose(filled, want, rtol=1e-5)
    np.testing.assert_allclose(filled[0, 1].reshape(2, 4), 0.5 * value[0].sum(axis=1), rtol=1e-5)
    unfilled, _ = _attend(query, key, value, bias, heads=2)
    assert np.isnan(unfilled[0, 1]).all() and not np.isnan(unfilled[0, 0]).any()


def test_heads_attention_takes_the_unfused_path_for_float64_and_broadcast_keys():
    query = RNG.standard_normal((1, 3, 16))
    key, value = RNG.standard_normal((2, 1, 2, 5, 8))
    got, want = _attend(query, key, value, heads=2)
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, want, rtol=1e-12)
    shared = RNG.standard_normal((2, 1, 1, 5, 8)).astype(np.float32)  # one KV head broadcast to both query heads
    got, want = _attend(query.astype(np.float32), shared[0], shared[1], heads=2)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)


def test_heads_attention_uses_given_targets_and_extra_scales():
    query = RNG.standard_normal((1, 4, 16)).astype(np.float32)
    key, value = RNG.standard_normal((2, 1, 2, 6, 8)).astype(np.float32)
    half = np.float32(0.5)
    got = HeadsAttention(query, None, key, value, None, np.array([1, 4, 2, 8]), None, np.array([4, 16]), None,
                         head_scale=half, key_scale=half, key_perm=(0, 1, 3, 2), value_perm=(0, 1, 2, 3))
    want = _reference(query, key, value, None, 0.25, None, 2, (0, 1, 3, 2), (0, 1, 2, 3)).reshape(4, 16)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("layout", ["contiguous", "strided"])  # one pass (numba), numpy's add and copy
@pytest.mark.parametrize("with_bias", [False, True])
def test_split_heads_is_a_contiguous_transpose_of_the_reshape(with_bias, layout, dtype):
    x = RNG.standard_normal((2, 5, 12 if layout == "contiguous" else 24)).astype(dtype)
    x = x if layout == "contiguous" else x[:, :, ::2]
    bias = RNG.standard_normal(12).astype(dtype) if with_bias else None
    got = SplitHeads(x, bias, None, x, dims=(0, 0, 3, -1), axes=(0, 1, -1, -1))
    want = (x + (0 if bias is None else bias)).reshape(2, 5, 3, 4).transpose(SPLIT)
    assert got.flags.c_contiguous
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(SplitHeads(x[:, :1], None, np.array([2, 1, 3, 4]), None), want[:, :, :1] if bias
                                  is None else x[:, :1].reshape(2, 1, 3, 4).transpose(SPLIT))


def test_softmax_rows_match_numpy_and_fill_rows_whose_softmax_is_nan():
    scores = (RNG.standard_normal((9, 200)) * 30).astype(np.float32)
    scores[1, ::3] = -np.inf
    scores[2, :] = -np.inf
    scores[3, 5] = np.nan
    scores[4, 7] = np.inf
    scores[5, :] = -200  # exp underflows everywhere but at the peak: the shift keeps it exact
    scores[6, 9] = np.array(0xFFC00000, np.uint32).view(np.float32)  # a NaN with the sign bit set
    scores[7:] = -np.abs(scores[7:]) - 50  # every score negative: the peak is the one nearest 0
    scores[8, :100], scores[8, 100:150] = -0.0, 0.0  # signed zeros, the largest scores
    want = _softmax(scores.astype(np.float64))
    got = scores.copy()
    softmax_rows_float32(got, -1.0)
    fine = [0, 1, 5, 7, 8]
    np.testing.assert_allclose(got[fine], want[fine], rtol=2e-6, atol=1e-12)
    np.testing.assert_array_equal(got[[2, 3, 4, 6]], -1.0)


@pytest.mark.parametrize("length", [1, 2, 3, 9, 16, 17, 33, 1499, 1500, 1501])
def test_softmax_rows_sum_every_score_once(length):
    """The pairwise tree of the row's sum (odd halves fold their last term in) over any length: each
    row sums to 1 within float32 rounding and matches the float64 softmax."""
    scores = (RNG.standard_normal((3, length)) * 4).astype(np.float32)
    want = _softmax(scores.astype(np.float64))
    softmax_rows_float32(scores, -1.0)
    np.testing.assert_allclose(scores, want, rtol=3e-6, atol=1e-12)
    np.testing.assert_allclose(scores.astype(np.float64).sum(axis=1), 1.0, rtol=2e-6)


@pytest.mark.parametrize("dtype, shape, vector", [(np.float32, (2, 3, 16), True), (np.float64, (5, 16), True),
                                                  (np.float32, (2, 3, 16), False), (np.float16, (4, 16), True)])
def test_add_layer_norm_is_the_sum_and_the_layer_normalization_of_it(dtype, shape, vector):
    a, b = RNG.standard_normal((2, *shape)).astype(dtype)
    scale, bias = RNG.standard_normal((2, 16)).astype(dtype)
    if not vector:  # a scale over the last axis but not a vector: LayerNormalization's own handling
        scale, bias = scale.reshape(1, 16), bias.reshape(1, 1, 16)
    total, normalized = AddLayerNorm(a, b, scale, bias, epsilon=1e-5)
    np.testing.assert_array_equal(total, a + b)
    np.testing.assert_array_equal(normalized, LayerNormalization(a + b, scale, bias, epsilon=1e-5)[0])
    assert normalized.dtype == dtype


@pytest.mark.parametrize("granted", [(), (0,), (1,)])
def test_add_layer_norm_writes_its_sum_into_a_granted_input_only(granted):
    a, b = RNG.standard_normal((2, 3, 5, 16)).astype(np.float32)
    a_before, b_before = a.copy(), b.copy()
    scale, bias = RNG.standard_normal((2, 16)).astype(np.float32)
    total, normalized = AddLayerNorm(a, b, scale, bias, epsilon=1e-5, overwrite=granted)
    np.testing.assert_array_equal(total, a_before + b_before)
    np.testing.assert_array_equal(normalized, LayerNormalization(a_before + b_before, scale, bias, epsilon=1e-5)[0])
    assert (total is a) == (granted == (0,)) and (total is b) == (granted == (1,))
    for array, before, index in ((a, a_before, 0), (b, b_before, 1)):
        if index not in granted:
            np.testing.assert_array_equal(array, before)


@pytest.mark.parametrize("offset_shape", [(16,), (1, 16)])
def test_add_layer_norm_adds_an_offset_to_the_second_input_first(offset_shape):
    """AddLayerNorm(a, b + offset) as MatMulAddLayerNorm calls it with its product's bias: the sums
    a + (b + offset) of the unfused Add nodes, a vector offset in the numba pass, others by numpy;
    and a b broadcasting against a (a positional embedding) by numpy's add."""
    a, b = (RNG.standard_normal((2, 7, 16)) * 4).astype(np.float32)
    offset = RNG.standard_normal(offset_shape).astype(np.float32)
    scale, bias = RNG.standard_normal((2, 16)).astype(np.float32)
    want = a + (b + offset)
    total, normalized = fused_layer_norm_blocks.add_layer_norm(a, b.copy(), offset, scale, bias, -1, 1e-5, 1, overwrite=(1,))
    np.testing.assert_array_equal(total, want)
    np.testing.assert_array_equal(normalized, LayerNormalization(want, scale, bias, epsilon=1e-5)[0])
    total, normalized = AddLayerNorm(a, b[0], scale, bias, epsilon=1e-5)
    np.testing.assert_array_equal(total, a + b[0])
    np.testing.assert_array_equal(normalized, LayerNormalization(a + b[0], scale, bias, epsilon=1e-5)[0])


def _gelu(x, bias):
    v = x.astype(np.float64) + (0 if bias is None else bias)
    return v * (np.vectorize(math.erf)(v / math.sqrt(2)) + 1) * 0.5


def _gelu_numbers(dtype) -> dict:
    """ErfGelu's attributes: the graph's constants as numpy scalars of their dtype."""
    return {name: dtype(v) for name, v in (("divisor", math.sqrt(2)), ("one", 1), ("half", 0.5))}


@pytest.mark.parametrize("shape, with_bias", [((1, 1, 24), True), ((3, 70, 24), False), ((24,), False)])
def test_erf_gelu_matches_the_formula(shape, with_bias):
    x = (RNG.standard_normal(shape) * 3).astype(np.float32)
    bias = RNG.standard_normal(24).astype(np.float32) if with_bias else None
    got = ErfGelu(x, bias, **_gelu_numbers(np.float32))
    assert got.shape == shape and got.dtype == np.float32
    np.testing.assert_allclose(got, _gelu(x, bias), rtol=1e-5, atol=1e-6)


def test_erf_gelu_of_float64_and_of_a_broadcasting_bias_takes_the_unfused_operations():
    x = RNG.standard_normal((2, 3, 4))
    np.testing.assert_allclose(ErfGelu(x, None, **_gelu_numbers(np.float64)), _gelu(x, None), rtol=1e-12)
    column = RNG.standard_normal((3, 1)).astype(np.float32)
    got = ErfGelu(x.astype(np.float32), column, **_gelu_numbers(np.float32))
    np.testing.assert_allclose(got, _gelu(x.astype(np.float32), column), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("with_bias", [False, True])
def test_erf_gelu_of_nan_infinities_huge_denormal_and_signed_zero_is_the_unfused_nodes(with_bias):
    """As Add, Div, Erf, Add, Mul, Mul give in float32 with libm's erf: NaN for NaN and for -inf
    (-inf * 0), +inf for +inf and for a huge x (x * 2 overflows), -0.0 for a huge negative x and
    for -0.0 (+0.0 once a zero bias is added)."""
    from test_elementwise import SPECIAL, exact_erf

    x = np.tile(SPECIAL, (3, 4))  # rows of 64: the vectorised loop
    bias = np.zeros(x.shape[-1], np.float32) if with_bias else None
    divisor, one, half = _gelu_numbers(np.float32).values()
    got = ErfGelu(x, bias, divisor=divisor, one=one, half=half)
    v = x + bias if with_bias else x
    with np.errstate(invalid="ignore", over="ignore"):
        want = (v * (exact_erf(v / divisor) + one)) * half
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    finite = ~np.isnan(want)
    np.testing.assert_array_equal(np.signbit(got[finite]), np.signbit(want[finite]))
    np.testing.assert_allclose(got[finite], want[finite], rtol=1e-6, atol=1e-6)  # erf's ulps, near -1


def test_the_standard_float32_gelu_is_erf_gelus_kernel():
    """Gelu (opset 20, approximate "none") of float32 rows takes ErfGelu's rows kernel: the same
    bits, special values included, and within erf's ulps of the formula (test_elementwise)."""
    from test_elementwise import SPECIAL

    from runnx.ops.activation import Gelu

    x = np.concatenate([np.tile(SPECIAL, (3, 4)), np.random.default_rng(3).standard_normal((5, 64)).astype(np.float32)])
    np.testing.assert_array_equal(Gelu(x.reshape(2, 4, 64)),
                                  ErfGelu(x, None, **_gelu_numbers(np.float32)).reshape(2, 4, 64))
