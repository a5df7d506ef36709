"""Fused kernels (runnx/ops/fused*.py, runnx/ops/_kernels_fused.py) against numpy written the
unfused way: RMSNorm, SiluMul and RotateHalf bitwise, attention within float rounding, and a
fused model's logits against the unfused model's."""
import numpy as np
import pytest

import runnx
import runnx.ops.fused as fused_ops
import runnx.ops.fused_norms as norm_ops
import runnx.ops.fused_rotary as rotary_ops
from runnx.errors import RunnxError
from runnx.ops.fused import LastPosition, RepeatedKVAttention, RepeatedKVShape, attend
from runnx.ops.fused_norms import AddRMSNorm, RMSNorm, SiluMul
from runnx.ops.fused_rotary import RopeAppend, RotateHalf
from runnx.ops._kernels_fused import ATTENTION_SPAN
from runnx.ops.shape import Slice

RNG = np.random.default_rng(0)


def _ints(*values):
    return np.array(values, dtype=np.int64)


def test_rms_norm_matches_the_formula_and_casts():
    x = RNG.standard_normal((2, 5, 32)).astype(np.float32)
    w = RNG.standard_normal(32).astype(np.float16)
    got = RMSNorm(x, w, epsilon=np.float32(1e-6), one=np.float32(1), axis=-1, to=10)  # to float16: the numpy path
    want = (w * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.float32(1e-6))).astype(np.float16))
    assert got.dtype == np.float16
    np.testing.assert_allclose(got, want, rtol=1e-3)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
# numpy's pairwise sum: blocks of 128, eight running sums (vector lanes here) then the rest one by one
@pytest.mark.parametrize("width", [5, 8, 15, 100, 128, 129, 263, 576, 1000, 4097])
def test_rms_norm_is_bitwise_the_unfused_operations(dtype, width):
    # magnitudes across six decades: every lane's running sum rounds, so an order changed shows
    x = (RNG.standard_normal((3, 2, width)) * 10.0 ** RNG.integers(-3, 3, (3, 2, width))).astype(dtype)
    w = RNG.standard_normal(width).astype(dtype)
    epsilon, one = np.array(1e-6, dtype), np.array(1, dtype)
    mean = np.add.reduce(np.square(x), axis=-1, keepdims=True) / dtype(width)
    want = w * (x * (one / np.sqrt(mean + epsilon)))
    for to in (0, 1 if dtype == np.float32 else 11):  # no Cast, a Cast to its own type
        got = RMSNorm(x, w, epsilon=epsilon, one=one, axis=-1, to=to)
        assert got.dtype == dtype
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(RMSNorm(x[:, :1], w, epsilon=epsilon, one=one, axis=2), want[:, :1])


@pytest.mark.parametrize("cast", [0, 1, 11])
def test_add_rms_norm_is_bitwise_the_unfused_add_cast_and_norm(cast, monkeypatch):
    # a Cast to the sum's own dtype (float32 Llama exports: cast=1) takes the one-call kernel too;
    # a Cast to float64 goes the unfused way
    kernel, calls = norm_ops.add_rms_norm_into, []
    monkeypatch.setattr(norm_ops, "add_rms_norm_into", lambda *args: calls.append(1) or kernel(*args))
    a, b = (RNG.standard_normal((1, 3, 40)).astype(np.float32) for _ in range(2))
    total = np.add(a, b).astype(np.float64 if cast == 11 else np.float32)
    epsilon, one = np.array(1e-5, total.dtype), np.array(1, total.dtype)
    weight = RNG.standard_normal(40).astype(total.dtype)
    residual, normed = AddRMSNorm(a, b, weight, epsilon=epsilon, one=one, cast=cast)
    np.testing.assert_array_equal(residual, total)
    np.testing.assert_array_equal(normed, RMSNorm(total, weight, epsilon=epsilon, one=one))
    assert len(calls) == (cast != 11)


def test_rms_norm_of_zeros_without_epsilon_is_nan_not_an_error():
    with np.errstate(divide="ignore", invalid="ignore"):
        got = RMSNorm(np.zeros((1, 8), np.float32), np.ones(8, np.float32), epsilon=np.float32(0), one=np.float32(1),
                      axis=-1)
    assert np.isnan(got).all()


def _unfused_silu(gate, up):
    with np.errstate(over="ignore"):
        return gate * (1 / (1 + np.exp(-gate))) * up


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_silu_mul_is_bitwise_the_unfused_operations(dtype):
    gate = (RNG.standard_normal((1, 3, 1536)) * 8).astype(dtype)
    gate[0, 0, :4] = [1000, -1000, 0, -0.0]  # exp(-gate) overflows to inf: 0
    up = RNG.standard_normal((1, 3, 1536)).astype(dtype)
    got = SiluMul(gate, up)
    assert got.dtype == dtype
    np.testing.assert_array_equal(got, _unfused_silu(gate, up))


@pytest.mark.parametrize("block", [1 << 40, 1 << 15, 1000], ids=["one pass", "default blocks", "small blocks"])
def test_a_long_prompts_silu_mul_in_blocks_is_bitwise_the_unfused_operations(block, monkeypatch):
    """SiluMul runs a long prompt's rows SILU_BLOCK elements at a time (a row or more each): the
    same bits whatever the blocks, and the unfused nodes' (rows neither a multiple of a block nor
    of the threads' share)."""
    from runnx.ops import fused_norms
    monkeypatch.setattr(fused_norms, "SILU_BLOCK", block)
    gate = (RNG.standard_normal((1, 203, 1536)) * 8).astype(np.float32)
    gate[0, 100, :2] = [1000, -1000]
    up = RNG.standard_normal((1, 203, 1536)).astype(np.float32)
    np.testing.assert_array_equal(SiluMul(gate, up), _unfused_silu(gate, up))


def test_silu_mul_broadcasts_through_numpy():
    gate = RNG.standard_normal((3, 8)).astype(np.float32)
    up = RNG.standard_normal((8,)).astype(np.float32)
    np.testing.assert_allclose(SiluMul(gate, up), gate / (1 + np.exp(-gate)) * up, rtol=1e-6)
    np.testing.assert_allclose(SiluMul(gate[:1], up.reshape(2, 1, 4).repeat(2, 2)).shape, (2, 1, 8))
    np.testing.assert_array_equal(SiluMul(gate.T, gate.T), _unfused_silu(gate.T, gate.T))  # not contiguous


@pytest.mark.parametrize("shape", [(2, 5, 3), (1, 1, 4), (3, 0, 2), (4, 6)])
def test_last_position_is_the_slice_of_the_last_position(shape):
    x = RNG.standard_normal(shape).astype(np.float32)
    want = Slice(x, _ints(-1), _ints(2**62), _ints(-2))
    got = LastPosition(x)
    assert got.shape == want.shape
    np.testing.assert_array_equal(got, want)
    assert np.shares_memory(got, x) or x.size == 0  # a view, as Slice's


def test_last_position_of_a_vector_is_an_error():
    with pytest.raises(RunnxError, match=r"LastPosition needs a rank of at least 2.*\[7\]"):
        LastPosition(np.zeros(7, np.float32))


@pytest.mark.parametrize("start, end, axis", [
    (4, 4, -1),  # the kernel
    (-4, -4, 3),  # the kernel
    (3, 3, -1),  # uneven halves: the kernel
    (4, -4, -1),  # one bound from the end: the kernel
    (4, 4, 2),  # another axis: numpy
])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_rotate_half_is_bitwise_slice_neg_concat(start, end, axis, dtype):
    x = RNG.standard_normal((1, 2, 8, 3)).astype(dtype).transpose(0, 1, 3, 2)  # strided, as after a Transpose
    cos = RNG.standard_normal((2, 1, 8, 3)).astype(dtype).transpose(0, 1, 3, 2)
    sin = RNG.standard_normal((1, 3, 8)).astype(dtype)
    rotated = np.concatenate([-Slice(x, _ints(start), _ints(2**62), _ints(axis)),
                              Slice(x, _ints(0), _ints(end), _ints(axis))], axis=axis)
    got = RotateHalf(x, cos, sin, _ints(start), _ints(end), axis=axis)
    np.testing.assert_array_equal(got, x * cos + rotated * sin)


@pytest.mark.parametrize("cos_width, sin_width", [(8, 8), (1, 8), (8, 1), (1, 1)])
def test_rotate_half_reads_cos_and_sin_rows_of_one_element_or_whole(cos_width, sin_width):
    """The kernel's whole-row loops and its broadcasting ones (a row of one cos or sin element): each
    element is the unfused arithmetic's."""
    x = RNG.standard_normal((1, 3, 5, 8)).astype(np.float32)
    cos = RNG.standard_normal((1, 1, cos_width, 5)).astype(np.float32).transpose(0, 1, 3, 2)  # position-major
    sin = RNG.standard_normal((1, 3, 5, sin_width)).astype(np.float32)
    got = RotateHalf(x, cos, sin, _ints(4), _ints(4), axis=-1)
    np.testing.assert_array_equal(got, x * cos + np.concatenate([-x[..., 4:], x[..., :4]], axis=-1) * sin)


def test_rotate_half_broadcasting_beyond_x_takes_numpy():
    x = RNG.standard_normal((1, 1, 3, 8)).astype(np.float32)
    cos, sin = RNG.standard_normal((2, 4, 3, 8)).astype(np.float32), np.ones((1, 1, 1, 8), np.float32)
    got = RotateHalf(x, cos, sin, _ints(4), _ints(4), axis=-1)
    assert got.shape == (2, 4, 3, 8)
    np.testing.assert_array_equal(got, x * cos + np.concatenate([-x[..., 4:], x[..., :4]], axis=-1) * sin)


def test_rotate_half_with_bounds_of_several_elements_is_an_error():
    x = RNG.standard_normal((2, 8)).astype(np.float32)
    with pytest.raises(RunnxError, match=r"RotateHalf's slice bounds must have one element, got shape \[2\]"):
        RotateHalf(x, x, x, np.array([4, 4]), _ints(4), axis=-1)
    with pytest.raises(RunnxError, match=r"RotateHalf's axis 2 is out of range for shape \[2, 8\]"):
        RotateHalf(x, x, x, _ints(4), _ints(4), axis=2)


def _read_only(array):
    array.flags.writeable = False  # as constants and shape memos' results are
    return array


def _rope_inputs(dtype, past_length: int, capacity: int):
    """RopeAppend's inputs for one decode step of 4 query heads over 2 KV heads of width 8, the
    caches prefix views of buffers with `capacity` rows, as runnx.with_capacity makes them."""
    query = RNG.standard_normal((1, 1, 4, 8)).astype(dtype).transpose(0, 2, 1, 3)  # split heads: a view
    key = RNG.standard_normal((1, 2, 1, 8)).astype(dtype)
    value = RNG.standard_normal((1, 2, 1, 8)).astype(dtype)
    caches = [runnx.with_capacity(RNG.standard_normal((1, 2, past_length, 8)).astype(dtype), 2, capacity).array
              for _ in range(2)]
    cos, sin = (RNG.standard_normal((1, 1, 1, 8)).astype(dtype) for _ in range(2))
    halves = (_read_only(_ints(4)), _read_only(_ints(4)))
    return (query, key, value, *caches, cos, sin, *halves, cos, sin, *halves)


def _rope_reference(inputs):
    query, key, value, past_key, past_value, cos, sin = (np.array(a) for a in inputs[:7])
    rotate = lambda x: x * cos + np.concatenate([-x[..., 4:], x[..., :4]], axis=-1) * sin  # noqa: E731
    return rotate(query), np.concatenate([past_key, rotate(key)], 2), np.concatenate([past_value, value], 2)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_rope_append_grows_granted_caches_in_their_buffers_bitwise(dtype, monkeypatch):
    inputs = _rope_inputs(dtype, past_length=5, capacity=8)
    calls = []
    kernel = rotary_ops.rope_append_into

    def counted(*args):
        result = kernel(*args)
        calls.append(result[0])
        return result

    monkeypatch.setattr(rotary_ops, "rope_append_into", counted)
    want = _rope_reference(inputs)
    buffers = (inputs[3].base, inputs[4].base)
    for step in range(2):  # the second call finds its answers for the halves' bounds remembered
        got = RopeAppend(*inputs, key_cache_axis=2, value_cache_axis=-2, overwrite=(3, 4))
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)
        assert got[1].base is buffers[0] and got[2].base is buffers[1]  # appended in place
    assert got[1].shape[2] == 6 and got[0].flags.c_contiguous
    assert calls == [True, True]  # in one numba call each time


def test_rope_append_without_room_or_grant_computes_what_concat_does():
    full = _rope_inputs(np.float32, past_length=4, capacity=4)  # no room: regrown with headroom
    got = RopeAppend(*full, key_cache_axis=2, value_cache_axis=2, overwrite=(3, 4))
    for g, w in zip(got, _rope_reference(full)):
        np.testing.assert_array_equal(g, w)
    assert got[1].base is not full[3].base and got[1].base.shape[2] == 10  # twice the rows
    kept = _rope_inputs(np.float32, past_length=4, capacity=8)  # not granted: the caches are not written
    rows = kept[3].base[:, :, 4:].copy()
    got = RopeAppend(*kept, key_cache_axis=2, value_cache_axis=2, overwrite=())
    np.testing.assert_array_equal(kept[3].base[:, :, 4:], rows)
    for g, w in zip(got, _rope_reference(kept)):
        np.testing.assert_array_equal(g, w)
    wide = list(_rope_inputs(np.float32, past_length=4, capacity=8))
    wide[2] = RNG.standard_normal((1, 2, 1, 6)).astype(np.float32)  # a value row of another width: as Concat
    with pytest.raises(ValueError, match="broadcast"):
        RopeAppend(*wide, key_cache_axis=2, value_cache_axis=2, overwrite=(3, 4))


def _grouped_reference(q, k, v, bias, scale, fill):
    """The unfused computation in float64: heads repeated, softmax, NaN -> fill."""
    repeat = q.shape[1] // k.shape[1]
    keys, values = np.repeat(k, repeat, axis=1).astype(np.float64), np.repeat(v, repeat, axis=1).astype(np.float64)
    scores = (q.astype(np.float64) * scale) @ np.swapaxes(keys, -1, -2)
    if bias is not None:
        scores = scores + bias
    with np.errstate(invalid="ignore"):
        exp = np.exp(scores - scores.max(-1, keepdims=True))
        p = exp / exp.sum(-1, keepdims=True)
    return np.where(np.isnan(p), fill, p) @ values


def _cache(batch, groups, length, depth, dtype, capacity=None):
    """Key and value as prefix views of capacity buffers (heads strided by the capacity)."""
    buffer = RNG.standard_normal((2, batch, groups, capacity or length + 7, depth)).astype(dtype)
    return buffer[0][:, :, :length], buffer[1][:, :, :length]


def _tolerance(dtype):
    return {"rtol": 1e-5, "atol": 1e-6} if dtype == np.float32 else {"rtol": 1e-12, "atol": 1e-12}


def _numbers(scale, fill=0, dtype=np.float32):
    """RepeatedKVAttention's scales and fill attributes: numpy scalars of the constants' dtype."""
    return {"query_scale": dtype(scale), "key_scale": dtype(scale), "nan_fill": dtype(fill)}


@pytest.mark.parametrize("query_heads, repeat", [
    (6, 3),  # the grouped path: each cache head read for its three query heads
    (1, 3),  # one query head against six repeated: the product broadcasts it, the materialised path
    (2, 1),  # no repeat: a head each
])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_repeated_kv_attention_matches_the_unfused_computation(query_heads, repeat, dtype):
    groups, length = 2, 5
    k, v = _cache(1, groups, length, 8, dtype, capacity=9)
    q = RNG.standard_normal((1, query_heads, 2, 8)).astype(dtype)
    bias = np.where(RNG.random((1, 1, 2, length)) < 0.3, -np.inf, 0).astype(dtype)
    bias[..., 0] = 0
    got = RepeatedKVAttention(q, k, v, bias, repeat=repeat, axis=-1, **_numbers(0.5, dtype=dtype))
    repeated = (1, groups * repeat, length, 8)
    keys = np.broadcast_to(k[:, :, None], (1, groups, repeat, length, 8)).reshape(repeated)
    values = np.broadcast_to(v[:, :, None], (1, groups, repeat, length, 8)).reshape(repeated)
    want = _grouped_reference(np.broadcast_to(q, (1, max(query_heads, groups * repeat), 2, 8)), keys, values, bias,
                              0.25, 0)
    assert got.dtype == dtype and got.shape == want.shape
    np.testing.assert_allclose(got, want, **_tolerance(dtype))


@pytest.mark.parametrize("mask_axis", [3, -1])
def test_repeated_kv_attention_makes_its_bias_from_a_mask_as_slice_and_where_do(mask_axis):
    k, v = _cache(1, 2, 5, 8, np.float32, capacity=9)
    q = RNG.standard_normal((1, 6, 1, 8)).astype(np.float32)
    mask = RNG.random((1, 1, 1, 7)) < 0.7  # longer than the keys: sliced to them
    mask[..., 0] = True
    then, otherwise = np.float32(0), np.float32(-np.inf)
    want = RepeatedKVAttention(q, k, v, np.where(Slice(mask, _ints(0), _ints(5), _ints(3), _ints(1)), then, otherwise),
                               repeat=3, **_numbers(0.5))
    got = RepeatedKVAttention(q, k, v, None, None, mask, _ints(5), repeat=3, mask_axis=mask_axis, masked_then=then,
                              masked_else=otherwise, **_numbers(0.5))
    np.testing.assert_array_equal(got, want)
    cut_to_keys = RepeatedKVAttention(q, k, v, None, None, mask, repeat=3, mask_axis=mask_axis, masked_then=then,
                                      masked_else=otherwise, **_numbers(0.5))  # no end: the keys' count
    np.testing.assert_array_equal(cut_to_keys, want)
    with pytest.raises(RunnxError, match="cannot be cut on axis 4"):
        RepeatedKVAttention(q, k, v, None, None, mask, _ints(5), repeat=3, mask_axis=4, masked_then=then,
                            masked_else=otherwise, **_numbers(0.5))


def test_repeated_kv_attention_fills_fully_masked_rows():
    k, v = _cache(1, 2, 6, 8, np.float32)
    q = RNG.standard_normal((1, 4, 3, 8)).astype(np.float32)
    bias = np.zeros((1, 1, 3, 6), np.float32)
    bias[..., 1, :] = -np.inf  # query row 1 sees nothing
    bias[..., 2, 3] = np.nan  # query row 2 has a NaN score: its softmax is NaN too
    for fill in (0, 2):
        got = RepeatedKVAttention(q, k, v, bias, repeat=2, axis=-1, query_scale=np.float32(1),
                                  key_scale=np.float32(0.25), nan_fill=np.float32(fill))
        want = _grouped_reference(q, k, v, bias, 0.25, fill)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got[:, :, 1:], fill * np.repeat(v.sum(axis=2, keepdims=True), 2, axis=1)
                                   .repeat(2, axis=2), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("batch, heads, groups, length, size", [
    (1, 9, 3, 1, 40),  # grouped-query decode
    (2, 4, 4, 1, 33),  # multi-head, batch 2
    (1, 6, 2, 5, 23),  # prefill rows with a causal mask
    (1, 2, 1, 3, 1),  # a single cache row
    (1, 4, 2, 40, 45),  # a short prompt's many rows over few keys: the kernel
    (1, 4, 2, 40, 70),  # a longer one: numpy's matrix products
])
def test_attend_matches_the_unfused_computation(dtype, batch, heads, groups, length, size):
    k, v = _cache(batch, groups, size, 16, dtype)
    q = RNG.standard_normal((batch, heads, length, 16)).astype(dtype)
    causal = np.triu(np.full((length, size), -np.inf, dtype), size - length + 1)
    per_head = RNG.standard_normal((heads, length, 1)).astype(dtype)  # one offset per row: broadcast over keys
    for bias in (None, causal, causal[None, None] + RNG.standard_normal((batch, heads, 1, size)).astype(dtype),
                 per_head):
        got = attend(q, k, v, bias, 0.25)
        assert got.dtype == dtype and got.shape == (batch, heads, length, 16) and got.flags.c_contiguous
        np.testing.assert_allclose(got, _grouped_reference(q, k, v, bias, 0.25, np.nan), **_tolerance(dtype))


def test_attend_reads_keys_and_values_in_any_layout():
    q = RNG.standard_normal((2, 6, 2, 16)).astype(np.float32)
    keys, values = (RNG.standard_normal((2, 30, 3, 16)).astype(np.float32) for _ in range(2))
    bias = np.where(RNG.random((2, 1, 2, 30)) < 0.2, -np.inf, 0).astype(np.float32)
    interleaved = keys.transpose(0, 2, 1, 3), values.transpose(0, 2, 1, 3)  # heads between rows
    layouts = [interleaved, (interleaved[0][:, :, ::-1], interleaved[1][:, :, ::-1]),  # rows reversed
               (np.ascontiguousarray(keys.transpose(0, 2, 3, 1)).swapaxes(2, 3), interleaved[1])]  # depth-major: copied
    for k, v in layouts:
        np.testing.assert_allclose(attend(q, k, v, bias, 0.25), _grouped_reference(q, k, v, bias, 0.25, np.nan),
                                   rtol=1e-5, atol=1e-6)


# the numba kernel, for few rows and for many over few keys; numpy's products and the pool's row softmax
@pytest.mark.parametrize("length, size", [(2, 4), (60, 4), (60, 70)])
def test_attend_of_a_fully_masked_row_is_nan_unless_filled(length, size):
    k, v = _cache(1, 1, size, 8, np.float32)
    q = RNG.standard_normal((1, 2, length, 8)).astype(np.float32)
    bias = np.zeros((length, size), np.float32)
    bias[0, 2], bias[1] = -np.inf, -np.inf
    got = attend(q, k, v, bias, 1.0)
    assert np.isfinite(got[:, :, 0]).all() and np.isnan(got[:, :, 1]).all() and np.isfinite(got[:, :, 2:]).all()
    np.testing.assert_array_equal(attend(q, k, v, bias, 1.0, fill=0.0)[:, :, 1], 0)
    np.testing.assert_allclose(got[:, :, 2:], _grouped_reference(q, k, v, bias, 1.0, np.nan)[:, :, 2:], rtol=1e-5,
                               atol=1e-6)


@pytest.mark.parametrize("heads, length, size, kernel", [
    (9, 1, 2000, True),  # a decode step's few rows over a long cache
    (9, 32, 32, True),  # a 32-token prompt over itself: 96 rows a KV head, 32 keys
    (24, 48, 48, True),  # 384 rows a KV head over 48 keys
    (9, 32, 300, False),  # many rows over many keys: numpy's products
])
def test_attend_takes_the_kernel_for_few_rows_or_few_keys(monkeypatch, heads, length, size, kernel):
    numpy_calls = []
    original = fused_ops._attend_numpy
    monkeypatch.setattr(fused_ops, "_attend_numpy", lambda *a: numpy_calls.append(a) or original(*a))
    k, v = _cache(1, 3, size, 16, np.float32)
    q = RNG.standard_normal((1, heads, length, 16)).astype(np.float32)
    causal = np.triu(np.full((length, size), -np.inf, np.float32), size - length + 1)
    got = attend(q, k, v, causal, 0.25)
    assert bool(numpy_calls) != kernel
    np.testing.assert_allclose(got, _grouped_reference(q, k, v, causal, 0.25, np.nan), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_attend_over_a_cache_of_several_spans_combines_them_exactly(dtype):
    # three spans of ATTENTION_SPAN positions, combined as flash decoding does: rows whose
    # largest scores sit in different spans, a row with a whole span masked, a fully masked row
    # and a row with a NaN score in its last span only (both filled)
    size = 2 * ATTENTION_SPAN + 37
    k, v = _cache(1, 2, size, 16, dtype)
    q = RNG.standard_normal((1, 6, 1, 16)).astype(dtype)
    bias = np.zeros((1, 6, 1, size), dtype)
    bias[0, 0, 0, ATTENTION_SPAN:2 * ATTENTION_SPAN] = 30  # its softmax lives in the middle span
    bias[0, 1, 0, :ATTENTION_SPAN] = -np.inf  # the first span adds nothing
    bias[0, 2, 0] = -np.inf
    bias[0, 3, 0, -1] = np.nan
    sums = v[0].sum(axis=1, dtype=np.float64)  # per KV head; query heads 0-2 read head 0, 3-5 head 1
    for fill in (np.nan, 0.0, 2.0):
        got = attend(q, k, v, bias, 0.25, fill)
        ordinary = [0, 1, 4, 5]
        np.testing.assert_allclose(got[:, ordinary], _grouped_reference(q, k, v, bias, 0.25, fill)[:, ordinary],
                                   **_tolerance(dtype))
        # fill times a sum of 1061 value rows: float32 accumulates ~1e-5 of rounding
        np.testing.assert_allclose(got[0, 2:4, 0], fill * sums, rtol=1e-5, atol=1e-4 if dtype == np.float32 else 0)


def test_attend_computes_other_dtypes_with_numpy_and_rejects_bad_shapes():
    k, v = _cache(1, 2, 5, 8, np.float16)
    q = RNG.standard_normal((1, 4, 1, 8)).astype(np.float16)
    got = attend(q, k, v, None, 0.5)
    assert got.dtype == np.float16
    np.testing.assert_allclose(got, _grouped_reference(q, k, v, None, 0.5, np.nan), rtol=2e-3, atol=2e-3)
    with pytest.raises(RunnxError, match="multiple of kv_heads"):
        attend(q[:, :3], k, v, None, 0.5)
    q, k, v = q.astype(np.float32), k.astype(np.float32), v.astype(np.float32)
    for bias in (np.zeros((1, 1, 2, 5), np.float32), np.zeros(3, np.float32)):
        with pytest.raises(RunnxError, match="does not broadcast"):
            attend(q, k, v, bias, 1.0)


def test_repeated_kv_shape_is_a_read_only_stand_in():
    k = np.zeros((1, 3, 10, 8), np.float32)
    stand_in = RepeatedKVShape(k, repeat=3)
    assert stand_in.shape == (1, 9, 10, 8) and not stand_in.flags.writeable and stand_in.strides == (0,) * 4
    with pytest.raises(RunnxError, match="batch, heads, length, depth"):
        RepeatedKVShape(k[0], repeat=3)


def test_fused_tiny_llama_logits_match_the_unfused_model(fixtures_dir):
    """Prefill then decode steps over capacity-buffer caches (strided views): logits within float
    rounding of the unfused graph's, greedy tokens identical."""
    path = fixtures_dir / "tiny-llama" / "model.onnx"
    models = {fuse: runnx.load(path, fuse=fuse) for fuse in (True, False)}
    ops = [n.op_type for n in models[True].plan()]
    assert ops.count("RepeatedKVAttention") == ops.count("ResidualGatedMLP") == 2
    ids = np.array([[1, 17, 400, 9, 33, 250]])
    caches = {fuse: {f"past_key_values.{layer}.{kind}": runnx.with_capacity(np.zeros((1, 2, 0, 16), np.float32), 2, 32)
                     for layer in (0, 1) for kind in ("key", "value")} for fuse in models}
    past = 0
    for _ in range(5):
        logits = {}
        for fuse, model in models.items():
            feeds = {"input_ids": ids, "attention_mask": np.ones((1, past + ids.shape[1]), np.int64),
                     "position_ids": np.arange(past, past + ids.shape[1])[None], **caches[fuse]}
            out = model.run(feeds)
            logits[fuse] = out["logits"]
            caches[fuse] = {name.replace("present", "past_key_values"): runnx.Owned(value)
                            for name, value in out.items() if name.startswith("present")}
        np.testing.assert_allclose(logits[True], logits[False], rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(logits[True].argmax(-1), logits[False].argmax(-1))
        past += ids.shape[1]
        ids = logits[True][:, -1:].argmax(-1)


def test_the_layers_reading_one_mask_share_its_bias_within_a_run():
    """RepeatedKVAttention's mask bias is made once a run for the same mask array, end and attributes
    (every layer of a decode step reads the same), never across runs or masks."""
    from runnx.interp.context import RunContext
    from runnx.interp.options import Options

    mask = RNG.random((1, 1, 1, 9)) < 0.5
    then, otherwise = np.float32(0), np.float32(-np.inf)

    def bias(mask, end, ctx, then=then):
        return fused_ops._mask_bias(mask, end, 3, then, otherwise, ctx)

    run = RunContext(Options())
    first = bias(mask, 7, run)
    np.testing.assert_array_equal(first, np.where(mask[..., :7], np.float32(0), np.float32(-np.inf)))
    assert bias(mask, 7, run) is first  # the same inputs
    assert bias(mask, 8, run).shape == (1, 1, 1, 8)  # another end
    assert bias(mask, 7, run, np.float32(1))[mask[..., :7]].tolist() == [1.0] * mask[..., :7].sum()
    assert bias(mask.copy(), 7, run) is not first  # an equal mask, another array
    assert bias(mask, 7, RunContext(Options())) is not first  # another run
    assert bias(mask, 7, None) is not first  # no run: made every call
