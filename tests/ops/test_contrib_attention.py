"""onnxruntime's contrib attention against onnxruntime: RotaryEmbedding (halves, interleaved,
offsets, partial rotary), GroupQueryAttention (prompt and decode, separate and shared KV buffers,
per-sequence lengths, rotary inside, local windows, softcap, packed QKV, float16) and the in-place
growth of its KV cache. Every case runs four times: with the prompt thresholds as shipped; with
every prompt's attention in blocks (`attention_in_blocks`, `causal_attention_in_blocks`, as
shipped for long unmasked prompts and causal ones of more than a few rows), as the decode pool's
prompt-attention job where runnx's own products run and as numpy's BLAS products; and with every
causal prompt through the mask and the attention kernel instead."""
from __future__ import annotations

import numpy as np
import pytest

import runnx
from runnx.errors import RunnxError
from runnx.capture.capacity import with_capacity
from tests.ops._contrib_node import assert_close, contrib_model, run_both

RNG = np.random.default_rng(44)


@pytest.fixture(autouse=True, params=["as shipped", "in blocks", "in numpy blocks", "masked"])
def _attention_path(request, monkeypatch):
    from runnx.ops import _attention_blocks, contrib_attention, contrib_group_query_attention
    if request.param == "masked":  # every causal prompt through the mask and the attention kernel
        monkeypatch.setattr(contrib_group_query_attention, "_CAUSAL_BLOCKED_ROWS", 1 << 30)
    elif request.param != "as shipped":
        monkeypatch.setattr(contrib_attention, "_BLOCKED_ROWS", 0)
        monkeypatch.setattr(contrib_group_query_attention, "_CAUSAL_BLOCKED_ROWS", 0)
        if request.param == "in numpy blocks":
            monkeypatch.setattr(_attention_blocks, "POOLED", False)


def _normal(*shape, dtype=np.float32):
    return RNG.standard_normal(shape).astype(dtype)


def _rotary_caches(positions: int, rotary_dim: int, dtype=np.float32):
    angles = np.outer(np.arange(positions), 1.0 / 10000 ** (np.arange(0, rotary_dim, 2) / rotary_dim))
    return np.cos(angles).astype(dtype), np.sin(angles).astype(dtype)


@pytest.mark.parametrize("interleaved", [0, 1])
@pytest.mark.parametrize("layout", ["3d", "4d"])
@pytest.mark.parametrize("offset", [True, False])
def test_rotary_embedding(interleaved, layout, offset):
    batch, length, heads, size = 2, 5, 3, 16
    x = _normal(batch, length, heads * size) if layout == "3d" else _normal(batch, heads, length, size)
    positions = np.array([7], np.int64) if offset else RNG.integers(0, 32, (batch, length)).astype(np.int64)
    cos, sin = _rotary_caches(40, size)
    got, expected = run_both("RotaryEmbedding", [x, positions, cos, sin], interleaved=interleaved,
                             **({"num_heads": heads} if layout == "3d" else {}))
    assert_close(got, expected)


def test_rotary_embedding_partial_dimension():
    x, positions = _normal(1, 4, 2 * 16), np.arange(4, dtype=np.int64).reshape(1, 4)
    cos, sin = _rotary_caches(8, 8)
    got, expected = run_both("RotaryEmbedding", [x, positions, cos, sin], num_heads=2, rotary_embedding_dim=8)
    assert_close(got, expected)


def _gqa_inputs(batch, steps, past, capacity, heads, kv_heads, size, dtype=np.float32, lengths=None):
    """Inputs of one GroupQueryAttention step: `past` cached tokens (per sequence: `lengths`, else
    all `past`) in a buffer of `capacity` rows."""
    lengths = np.full(batch, past) if lengths is None else np.asarray(lengths)
    past_key = np.zeros((batch, kv_heads, capacity, size), dtype)
    past_value = np.zeros((batch, kv_heads, capacity, size), dtype)
    for b, n in enumerate(lengths):
        past_key[b, :, :n] = _normal(kv_heads, n, size, dtype=dtype)
        past_value[b, :, :n] = _normal(kv_heads, n, size, dtype=dtype)
    seqlens = (lengths + steps - 1).astype(np.int32)
    total = np.array(int(seqlens.max()) + 1, np.int32)
    return [_normal(batch, steps, heads * size, dtype=dtype), _normal(batch, steps, kv_heads * size, dtype=dtype),
            _normal(batch, steps, kv_heads * size, dtype=dtype), past_key if past or capacity else None,
            past_value if past or capacity else None, seqlens, total]


def _compare_gqa(inputs, lengths, tolerance=1e-5, **attributes):
    """Output and each sequence's valid present rows equal onnxruntime's."""
    got, expected = run_both("GroupQueryAttention", inputs, outputs=3, **attributes)
    assert_close(got[:1], expected[:1], rtol=tolerance, atol=tolerance)
    for g, e in zip(got[1:], expected[1:]):
        assert g.shape == e.shape
        for b, n in enumerate(lengths):
            np.testing.assert_allclose(g[b, :, :n], e[b, :, :n], rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 4), (6, 1)])
@pytest.mark.parametrize("past,steps,capacity", [(0, 5, 0), (6, 1, 6), (6, 3, 6), (6, 1, 16), (5, 2, 12)])
def test_group_query_attention(heads, kv_heads, past, steps, capacity):
    batch = 1 if past and steps > 1 else 2  # onnxruntime takes a prompt continuing a cache one sequence at a time
    inputs = _gqa_inputs(batch, steps, past, capacity, heads, kv_heads, 8)
    _compare_gqa(inputs, [past + steps] * batch, num_heads=heads, kv_num_heads=kv_heads)


def test_group_query_attention_per_sequence_lengths_in_a_shared_buffer():
    inputs = _gqa_inputs(3, 1, 0, 10, 4, 2, 8, lengths=[3, 7, 5])
    _compare_gqa(inputs, [4, 8, 6], num_heads=4, kv_num_heads=2)


@pytest.mark.parametrize("interleaved", [0, 1])
@pytest.mark.parametrize("past,steps,capacity", [(0, 4, 0), (4, 1, 4), (4, 1, 12)])
def test_group_query_attention_rotary(interleaved, past, steps, capacity):
    inputs = _gqa_inputs(2, steps, past, capacity, 4, 2, 16)
    cos, sin = _rotary_caches(32, 16)
    _compare_gqa(inputs + [cos, sin], [past + steps] * 2, num_heads=4, kv_num_heads=2, do_rotary=1,
                 rotary_interleaved=interleaved)


@pytest.mark.parametrize("window", [1, 3, 6])
@pytest.mark.parametrize("past,steps", [(0, 9), (8, 1), (6, 3)])
def test_group_query_attention_local_window(window, past, steps):
    inputs = _gqa_inputs(1, steps, past, past, 4, 2, 8)
    _compare_gqa(inputs, [past + steps], num_heads=4, kv_num_heads=2, local_window_size=window)


def test_group_query_attention_softcap_scale_and_smooth_softmax():
    inputs = _gqa_inputs(1, 3, 4, 4, 4, 2, 8)
    inputs[0] *= 4
    _compare_gqa(inputs, [7], num_heads=4, kv_num_heads=2, softcap=2.0, scale=0.3)
    _compare_gqa(inputs, [7], num_heads=4, kv_num_heads=2, smooth_softmax=1)


def test_group_query_attention_packed_qkv_and_float16():
    inputs = _gqa_inputs(2, 1, 3, 3, 4, 2, 8, dtype=np.float16)
    packed = [np.concatenate(inputs[:3], axis=2), None, None] + inputs[3:]
    _compare_gqa(packed, [4, 4], tolerance=3e-3, num_heads=4, kv_num_heads=2)


def test_group_query_attention_grows_an_owned_cache_in_place():
    inputs = _gqa_inputs(1, 1, 6, 6, 4, 2, 8)
    model, feeds = contrib_model("GroupQueryAttention", inputs, ["y", "present_key", "present_value"], num_heads=4,
                                 kv_num_heads=2)
    expected = runnx.load(model).run(feeds)
    owned = dict(feeds, in3=with_capacity(feeds["in3"], 2, 32), in4=with_capacity(feeds["in4"], 2, 32))
    buffers = (owned["in3"].array.base, owned["in4"].array.base)
    got = runnx.load(model).run(owned)
    assert got["present_key"].base is buffers[0] and got["present_value"].base is buffers[1]
    for name in expected:
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-6)
    assert feeds["in3"].shape == (1, 2, 6, 8)  # the caller's arrays are untouched


@pytest.mark.parametrize("lengths", [[6, 6], [3, 9]])
def test_group_query_attention_never_reads_a_shared_buffer_past_each_length(lengths):
    """A shared buffer's rows past each sequence's length are not the model's (onnxruntime never
    reads them): NaN there changes nothing, in a batch of equal or unequal lengths."""
    inputs = _gqa_inputs(2, 1, 0, 16, 4, 2, 8, lengths=lengths)
    clean = [x.copy() if isinstance(x, np.ndarray) else x for x in inputs]
    for b, n in enumerate(lengths):
        inputs[3][b, :, n:] = np.nan
        inputs[4][b, :, n:] = np.nan
    model, feeds = contrib_model("GroupQueryAttention", inputs, ["y", "present_key", "present_value"], num_heads=4,
                                 kv_num_heads=2)
    _, clean_feeds = contrib_model("GroupQueryAttention", clean, ["y", "present_key", "present_value"], num_heads=4,
                                   kv_num_heads=2)
    session = runnx.load(model)
    got, expected = session.run(feeds), session.run(clean_feeds)
    assert np.isfinite(got["y"]).all()
    np.testing.assert_array_equal(got["y"], expected["y"])
    _compare_gqa(clean, [n + 1 for n in lengths], num_heads=4, kv_num_heads=2)


def test_group_query_attention_writes_a_shared_owned_buffer_in_place():
    inputs = _gqa_inputs(2, 1, 0, 12, 4, 2, 8, lengths=[5, 9])
    model, feeds = contrib_model("GroupQueryAttention", inputs, ["y", "present_key", "present_value"], num_heads=4,
                                 kv_num_heads=2)
    before = feeds["in3"].copy()
    borrowed = runnx.load(model).run(feeds)
    np.testing.assert_array_equal(feeds["in3"], before)  # lent, not handed over: copied, never written
    owned = dict(feeds, in3=runnx.Owned(feeds["in3"].copy()), in4=runnx.Owned(feeds["in4"].copy()))
    buffers = (owned["in3"].array, owned["in4"].array)
    got = runnx.load(model).run(owned)
    assert got["present_key"] is buffers[0] or got["present_key"].base is buffers[0]
    assert np.shares_memory(got["present_value"], buffers[1])
    for name in borrowed:
        np.testing.assert_allclose(got[name], borrowed[name], rtol=1e-6)


@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("mask", [None, "lengths", "2d"])
@pytest.mark.parametrize("unidirectional", [0, 1])
def test_multi_head_attention(with_bias, mask, unidirectional):
    batch, queries, keys, heads, size = 2, 4, 4 if unidirectional else 6, 3, 8
    width = heads * size
    masks = {None: None, "lengths": np.array([keys, keys - 2], np.int32),
             "2d": (RNG.random((batch, keys)) > 0.3).astype(np.int32)}
    inputs = [_normal(batch, queries, width), _normal(batch, keys, width), _normal(batch, keys, width),
              _normal(3 * width) if with_bias else None, masks[mask]]
    got, expected = run_both("MultiHeadAttention", inputs, num_heads=heads, unidirectional=unidirectional)
    assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_multi_head_attention_past_attention_bias_and_presents():
    batch, heads, size, past = 2, 2, 8, 5
    inputs = [_normal(batch, 1, heads * size), _normal(batch, 1, heads * size), _normal(batch, 1, heads * size), None,
              None, _normal(1, heads, 1, past + 1), _normal(batch, heads, past, size),
              _normal(batch, heads, past, size)]
    got, expected = run_both("MultiHeadAttention", inputs, outputs=3, num_heads=heads, scale=0.2)
    assert_close(got, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("unidirectional", [0, 1])
def test_multi_head_attention_grows_an_owned_past_in_place(unidirectional):
    """A decode step's presents are the owned past grown in its spare capacity (no copy of the
    cache), bitwise the values of the copying path; a lent past is never written."""
    batch, heads, size, past = 2, 2, 8, 5
    inputs = [_normal(batch, 1, heads * size), _normal(batch, 1, heads * size), _normal(batch, 1, heads * size), None,
              None, None, _normal(batch, heads, past, size), _normal(batch, heads, past, size)]
    model, feeds = contrib_model("MultiHeadAttention", inputs, ["y", "present_key", "present_value"], num_heads=heads,
                                 unidirectional=unidirectional)
    before = {name: feeds[name].copy() for name in ("in6", "in7")}
    expected = runnx.load(model).run(feeds)
    for name, array in before.items():
        np.testing.assert_array_equal(feeds[name], array)  # lent: copied, never written
    owned = dict(feeds, in6=with_capacity(feeds["in6"], 2, 16), in7=with_capacity(feeds["in7"], 2, 16))
    buffers = (owned["in6"].array.base, owned["in7"].array.base)
    got, profile = runnx.load(model).run(owned, profile=True)
    assert got["present_key"].base is buffers[0] and got["present_value"].base is buffers[1]
    assert profile.counters["MultiHeadAttention.appends_in_place"] == 2
    for name in expected:
        np.testing.assert_array_equal(got[name], expected[name])


def test_multi_head_attention_cross_attention_and_packed_key_value():
    batch, heads, size = 2, 2, 8
    query = _normal(batch, 3, heads * size)
    keys, values = _normal(batch, heads, 7, size), _normal(batch, heads, 7, size)
    got, expected = run_both("MultiHeadAttention", [query, keys, values], num_heads=heads)
    assert_close(got, expected, rtol=1e-4, atol=1e-5)
    packed = _normal(batch, 5, heads, 2, size)  # onnxruntime's CPU kernel has no packed KV: give it them apart
    model, feeds = contrib_model("MultiHeadAttention", [query, packed], ["y"], num_heads=heads)
    got = runnx.load(model).run(feeds)["y"]
    apart = [packed[:, :, :, i].reshape(batch, 5, heads * size) for i in range(2)]
    _, expected = run_both("MultiHeadAttention", [query, *apart], num_heads=heads)
    np.testing.assert_allclose(got, expected[0], rtol=1e-4, atol=1e-5)


def test_multi_head_attention_per_query_mask_is_refused():
    inputs = [_normal(1, 2, 8), _normal(1, 3, 8), _normal(1, 3, 8), None, np.ones((1, 2, 3), np.int32)]
    model, feeds = contrib_model("MultiHeadAttention", inputs, ["y"], num_heads=2)
    with pytest.raises(RunnxError, match=r"mask of shape \[1, 2, 3\] is not supported"):
        runnx.load(model).run(feeds)


@pytest.mark.parametrize("mask", [None, "lengths", "2d", "3d"])
@pytest.mark.parametrize("with_past", [False, True])
def test_contrib_attention(mask, with_past):
    batch, queries, heads, size, past = 2, 3, 2, 8, 4
    width = heads * size
    keys = queries + (past if with_past else 0)
    masks = {None: None, "lengths": np.array([keys, keys - 1], np.int32),
             "2d": (RNG.random((batch, keys)) > 0.3).astype(np.int32),
             "3d": (RNG.random((batch, queries, keys)) > 0.3).astype(np.int32)}
    masks["2d"][:, 0] = 1
    inputs = [_normal(batch, queries, 12), _normal(12, 3 * width), _normal(3 * width), masks[mask],
              _normal(2, batch, heads, past, size) if with_past else None]
    got, expected = run_both("Attention", inputs, outputs=2 if with_past else 1, initializers=(1, 2), num_heads=heads,
                             unidirectional=1 if with_past else 0)
    assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_contrib_attention_qkv_hidden_sizes():
    inputs = [_normal(1, 4, 10), _normal(10, 16 + 16 + 24), _normal(16 + 16 + 24)]
    got, expected = run_both("Attention", inputs, initializers=(1, 2), num_heads=2, qkv_hidden_sizes=[16, 16, 24])
    assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_group_query_attention_head_sinks_and_attention_bias():
    inputs = _gqa_inputs(2, 1, 5, 5, 4, 2, 8)
    sinks = _normal(4)
    bias = _normal(2, 1, 1, 6)
    _compare_gqa(inputs + [None, None, None, None, sinks], [6, 6], num_heads=4, kv_num_heads=2)
    _compare_gqa(inputs + [None, None, None, bias], [6, 6], num_heads=4, kv_num_heads=2)
