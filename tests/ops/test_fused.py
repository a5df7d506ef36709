"""Fused kernels against numpy written the unfused way (runnx/ops/fused.py)."""
import numpy as np
import pytest

from runnx.errors import RunnxError
from runnx.ops.fused import RepeatedKVAttention, RepeatedKVShape, RMSNorm, RotateHalf, SiluMul
from runnx.ops.shape import Slice

RNG = np.random.default_rng(0)


def _ints(*values):
    return np.array(values, dtype=np.int64)


def test_rms_norm_matches_the_formula_and_casts():
    x = RNG.standard_normal((2, 5, 32)).astype(np.float32)
    w = RNG.standard_normal(32).astype(np.float16)
    got = RMSNorm(x, np.float32(1e-6), np.float32(1), w, axis=-1, to=10)  # to float16
    want = (w * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.float32(1e-6))).astype(np.float16))
    assert got.dtype == np.float16
    np.testing.assert_allclose(got, want, rtol=1e-3)


def test_silu_mul_matches_and_broadcasts():
    gate = RNG.standard_normal((3, 8)).astype(np.float32)
    up = RNG.standard_normal((8,)).astype(np.float32)
    np.testing.assert_allclose(SiluMul(gate, up), gate / (1 + np.exp(-gate)) * up, rtol=1e-6)
    np.testing.assert_allclose(SiluMul(gate[:1], up.reshape(2, 1, 4).repeat(2, 2)).shape, (2, 1, 8))


@pytest.mark.parametrize("negated, kept", [
    ((_ints(4), _ints(2**62), _ints(-1), None), (_ints(0), _ints(4), _ints(-1), None)),
    ((_ints(-4), _ints(99), _ints(3), _ints(1)), (_ints(0), _ints(-4), _ints(3), _ints(1))),
    ((_ints(7), _ints(3), _ints(3), _ints(-1)), (_ints(0), _ints(4), _ints(3), _ints(1))),  # general Slice path
])
def test_rotate_half_matches_slice_neg_concat(negated, kept):
    x = RNG.standard_normal((1, 2, 3, 8)).astype(np.float32)
    cos, sin = RNG.standard_normal((2, 1, 3, 8)).astype(np.float32), RNG.standard_normal((1, 3, 8)).astype(np.float32)
    rotated = np.concatenate([-Slice(x, *negated), Slice(x, *kept)], axis=-1)
    np.testing.assert_array_equal(RotateHalf(x, cos, sin, *negated, *kept, axis=-1), x * cos + rotated * sin)


def _reference_attention(q, keys, values, bias, scale):
    scores = (q * scale) @ (np.swapaxes(keys, -1, -2) * scale) + bias
    exp = np.exp(scores - scores.max(-1, keepdims=True))
    p = exp / exp.sum(-1, keepdims=True)
    return np.where(np.isnan(p), 0, p) @ values


def _repeat_inputs(groups, repeat, length, expand=None, target=None):
    expand = _ints(1, groups, repeat, length, 8) if expand is None else expand
    target = _ints(1, groups * repeat, length, 8) if target is None else target
    return _ints(2), expand, target


@pytest.mark.parametrize("expand, target, repeated", [
    (None, None, (1, 6, 5, 8)),  # the grouped path
    (_ints(1, 1, 3, 1, 1), _ints(0, -1, 5, 8), (1, 6, 5, 8)),  # broadcast and 0/-1 targets: still a head repeat
    (_ints(1, 2, 3, 5, 8), _ints(1, 5, 6, 8), (1, 5, 6, 8)),  # not a head repeat: the materialised path
])
def test_repeated_kv_attention_matches_the_unfused_computation(expand, target, repeated):
    groups, repeat, length = 2, 3, 5
    buffer = RNG.standard_normal((2, 1, groups, 9, 8)).astype(np.float32)
    k, v = buffer[0][:, :, :length], buffer[1][:, :, :length]  # prefix views of a capacity buffer
    heads, kv_length = repeated[1], repeated[2]
    q = RNG.standard_normal((1, heads, 2, 8)).astype(np.float32)
    bias = np.where(RNG.random((1, 1, 2, kv_length)) < 0.3, -np.inf, 0).astype(np.float32)
    scale, zero = np.float32(0.5), np.float32(0)
    shape_inputs = _repeat_inputs(groups, repeat, length, expand, target)
    got = RepeatedKVAttention(q, k, v, bias, scale, scale, zero, *shape_inputs, *shape_inputs, axis=-1)
    keys = np.broadcast_to(k[:, :, None], (1, groups, repeat, length, 8)).reshape(repeated)
    values = np.broadcast_to(v[:, :, None], (1, groups, repeat, length, 8)).reshape(repeated)
    np.testing.assert_allclose(got, _reference_attention(q, keys, values, bias, scale), rtol=1e-5, atol=1e-6)


def test_repeated_kv_shape_is_a_read_only_stand_in():
    k = np.zeros((1, 3, 10, 8), np.float32)
    stand_in = RepeatedKVShape(k, *_repeat_inputs(3, 3, 10))
    assert stand_in.shape == (1, 9, 10, 8) and not stand_in.flags.writeable and stand_in.strides == (0,) * 4
    with pytest.raises(RunnxError):
        RepeatedKVShape(k, _ints(2), _ints(1, 3, 3, 10, 8), _ints(1, 7, 10, 8))


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


def _cache(shape, capacity, dtype):
    """Key and value as prefix views of capacity buffers (heads strided by the capacity)."""
    batch, groups, length, depth = shape
    buffer = RNG.standard_normal((2, batch, groups, capacity, depth)).astype(dtype)
    return buffer[0][:, :, :length], buffer[1][:, :, :length]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("batch, heads, groups, length, size", [
    (1, 9, 3, 1, 40),  # grouped-query decode
    (2, 4, 4, 1, 33),  # multi-head, batch 2
    (1, 6, 2, 5, 23),  # prefill rows with a causal mask
    (1, 2, 1, 3, 1),  # a single cache row
])
def test_attend_matches_the_unfused_computation(dtype, batch, heads, groups, length, size):
    from runnx.ops.fused import attend
    k, v = _cache((batch, groups, size, 16), size + 7, dtype)
    q = RNG.standard_normal((batch, heads, length, 16)).astype(dtype)
    causal = np.triu(np.full((length, size), -np.inf, dtype), size - length + 1)
    for bias in (None, causal, causal[None, None] + RNG.standard_normal((batch, heads, 1, size)).astype(dtype)):
        got = attend(q, k, v, bias, 0.25)
        assert got.dtype == dtype and got.shape == (batch, heads, length, 16) and got.flags.c_contiguous
        rtol = 1e-5 if dtype == np.float32 else 1e-12
        np.testing.assert_allclose(got, _grouped_reference(q, k, v, bias, 0.25, np.nan), rtol=rtol, atol=rtol)
