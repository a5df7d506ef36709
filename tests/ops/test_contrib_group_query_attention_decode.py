"""GroupQueryAttention's decode path (one new row per sequence: `rotary_append`, then the decode
attention job over each sequence's own rows) against onnxruntime on random graphs, against the
numpy path, and with and without the decode pool's workers."""
from __future__ import annotations

import numpy as np
import pytest

from runnx.errors import RunnxError
from runnx.ops import _native, contrib_group_query_attention
from runnx.ops.contrib_group_query_attention import GroupQueryAttention
from tests.ops._contrib_node import alone_and_with_workers, run_both

RNG = np.random.default_rng(45)


def _normal(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def _rotary_caches(positions: int, rotary_dim: int):
    angles = np.outer(np.arange(positions), 1.0 / 10000 ** (np.arange(0, rotary_dim, 2) / rotary_dim))
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def _step(lengths, capacity, heads, kv_heads, size, packed=False, rotary_positions=0):
    """One decode step's inputs: sequence b has lengths[b] cached rows in a buffer of `capacity`
    rows (capacity 0: exactly max(lengths), past and present apart), garbage past them."""
    batch = len(lengths)
    rows = capacity or max(lengths)
    past_key = np.full((batch, kv_heads, rows, size), np.nan, np.float32) if capacity else _normal(
        batch, kv_heads, rows, size)
    past_value = past_key.copy()
    for b, n in enumerate(lengths):
        past_key[b, :, :n] = _normal(kv_heads, n, size)
        past_value[b, :, :n] = _normal(kv_heads, n, size)
    q, k, v = _normal(batch, 1, heads * size), _normal(batch, 1, kv_heads * size), _normal(batch, 1, kv_heads * size)
    new = [np.concatenate([q, k, v], axis=2), None, None] if packed else [q, k, v]
    inputs = new + [past_key, past_value, np.array(lengths, np.int32), np.array(max(lengths) + 1, np.int32)]
    if rotary_positions:
        inputs += list(_rotary_caches(rotary_positions, size))
    return inputs


@pytest.fixture
def spy(monkeypatch):
    """Counts the decode path's calls: the one-call job (shared buffer, equal lengths), else the
    rows kernel and the decode attention apart."""
    calls = {"job": 0, "rows": 0, "attention": 0}

    def counting(name, key):
        original = getattr(contrib_group_query_attention, name)

        def counted(*arguments):
            calls[key] += 1
            return original(*arguments)
        monkeypatch.setattr(contrib_group_query_attention, name, counted)

    counting("decode_step", "job")
    counting("rotary_append", "rows")
    counting("_decode_attention", "attention")
    return calls


def _decode_path_ran(calls, steps=1) -> bool:
    """Whether each of `steps` steps took the decode path (the job, or rows kernel then attention)."""
    return calls["job"] + calls["rows"] == steps and calls["job"] + calls["attention"] == steps


def _compare(inputs, lengths, **attributes):
    got, expected = run_both("GroupQueryAttention", inputs, outputs=3, **attributes)
    np.testing.assert_allclose(got[0], expected[0], rtol=1e-5, atol=1e-5)
    for g, e in zip(got[1:], expected[1:]):
        assert g.shape == e.shape
        for b, n in enumerate(lengths):
            np.testing.assert_allclose(g[b, :, :n + 1], e[b, :, :n + 1], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("interleaved", [None, 0, 1])
@pytest.mark.parametrize("lengths,capacity", [([7], 0), ([7], 16), ([5, 5], 12), ([3, 9], 12)])
@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (4, 4)])
def test_decode_step_equals_onnxruntime(spy, interleaved, lengths, capacity, heads, kv_heads):
    """Shared buffer (NaN past each length) or past and present apart, grouped heads or not, equal
    or unequal lengths, rotary inside (halves or interleaved) or none, packed QKV with rotary."""
    rotary = {} if interleaved is None else {"do_rotary": 1, "rotary_interleaved": interleaved}
    inputs = _step(lengths, capacity, heads, kv_heads, 16, packed=interleaved == 1,
                   rotary_positions=32 if rotary else 0)
    _compare(inputs, lengths, num_heads=heads, kv_num_heads=kv_heads, **rotary)
    assert _decode_path_ran(spy)
    assert spy["job"] == int(capacity > 0 and len(set(lengths)) == 1)  # one native call where it can


@pytest.mark.parametrize("window", [1, 4, 20])
@pytest.mark.parametrize("lengths", [[9], [6, 11]])
def test_decode_step_local_window_equals_onnxruntime(spy, window, lengths):
    inputs = _step(lengths, 16, 4, 2, 16, rotary_positions=32)
    _compare(inputs, lengths, num_heads=4, kv_num_heads=2, local_window_size=window, do_rotary=1)
    assert _decode_path_ran(spy)


def test_decode_step_softcap_and_scale_equal_onnxruntime(spy):
    """softcap takes the numpy attention after the same rows kernel."""
    inputs = _step([4, 8], 12, 4, 2, 16, rotary_positions=16)
    inputs[0] *= 4
    _compare(inputs, [4, 8], num_heads=4, kv_num_heads=2, softcap=2.0, scale=0.3, do_rotary=1)
    assert spy == {"job": 0, "rows": 1, "attention": 0}
    _compare(inputs, [4, 8], num_heads=4, kv_num_heads=2, scale=0.3, do_rotary=1)
    assert spy == {"job": 0, "rows": 2, "attention": 1}


def _run(inputs, **attributes):
    copies = [None if x is None else x.copy() for x in inputs]
    return GroupQueryAttention(*copies, output_count=3, **attributes)


@pytest.mark.parametrize("interleaved", [0, 1])
@pytest.mark.parametrize("lengths", [[5, 9], [7, 7]])
def test_decode_step_equals_the_numpy_path(monkeypatch, interleaved, lengths):
    """The rows kernel turns and writes what the numpy path does, bitwise; attention within rounding."""
    inputs = _step(lengths, 12, 6, 2, 16, rotary_positions=32)
    attributes = dict(num_heads=6, kv_num_heads=2, do_rotary=1, rotary_interleaved=interleaved)
    fast = _run(inputs, **attributes)
    monkeypatch.setattr(_native, "enabled", False)
    slow = _run(inputs, **attributes)
    np.testing.assert_allclose(fast[0], slow[0], rtol=1e-6, atol=1e-6)
    for f, s in zip(fast[1:], slow[1:]):
        for b, n in enumerate(lengths):
            np.testing.assert_array_equal(f[b, :, :n + 1], s[b, :, :n + 1])


@pytest.mark.parametrize("lengths", [[1500, 1500], [700, 1300]])
def test_decode_step_does_not_depend_on_the_thread_count(lengths):
    """Bitwise the same with the decode pool's workers as without (spans of a long cache shared out)."""
    inputs = _step(lengths, 1600, 6, 2, 32, rotary_positions=1600)
    attributes = dict(num_heads=6, kv_num_heads=2, do_rotary=1)
    alone, shared = alone_and_with_workers(lambda: _run(inputs, **attributes))
    for a, s in zip(alone, shared):
        np.testing.assert_array_equal(a, s)


def test_decode_step_refuses_positions_outside_the_rotary_caches():
    inputs = _step([20], 24, 4, 2, 16, rotary_positions=16)
    with pytest.raises(RunnxError, match=r"rotary position ids must be in \[0, 16\)"):
        _run(inputs, num_heads=4, kv_num_heads=2, do_rotary=1)


@pytest.mark.parametrize("capacity", [0, 8])
def test_a_one_token_prompt_equals_onnxruntime(spy, capacity):
    """A first prompt of one token: no past at all, or an empty shared buffer."""
    q, k, v = _normal(2, 1, 4 * 16), _normal(2, 1, 2 * 16), _normal(2, 1, 2 * 16)
    past = [np.zeros((2, 2, capacity, 16), np.float32)] * 2 if capacity else [None, None]
    cos, sin = _rotary_caches(16, 16)
    inputs = [q, k, v, *past, np.zeros(2, np.int32), np.array(1, np.int32), cos, sin]
    _compare(inputs, [0, 0], num_heads=4, kv_num_heads=2, do_rotary=1)
    assert _decode_path_ran(spy)


@pytest.mark.parametrize("case", ["rotary", "interleaved", "plain", "window", "scale", "full buffer"])
def test_one_packed_row_takes_a_shorter_road_to_the_same_bits(monkeypatch, case):
    """A decode step's common case (one sequence, one row of packed q, k, v, a shared buffer) goes
    through `_one_packed_row`, with the general path's checks made on its few numbers: the same
    outputs, bit for bit, as the general path given the same inputs."""
    lengths, capacity = ([15], 16) if case == "full buffer" else ([7], 16)
    inputs = _step(lengths, capacity, 6, 2, 16, packed=True, rotary_positions=0 if case == "plain" else 32)
    attributes = dict(num_heads=6, kv_num_heads=2, do_rotary=int(case != "plain"),
                      rotary_interleaved=int(case == "interleaved"), local_window_size=4 if case == "window" else -1,
                      scale=0.3 if case == "scale" else 0.0)
    taken = []
    original = contrib_group_query_attention._one_packed_row
    monkeypatch.setattr(contrib_group_query_attention, "_one_packed_row", lambda *a: taken.append(original(*a)) or taken[-1])
    short = _run(inputs, **attributes)
    assert len(taken) == 1 and taken[0] is not None
    monkeypatch.setattr(contrib_group_query_attention, "_one_packed_row", lambda *a: None)
    general = _run(inputs, **attributes)
    for s, g in zip(short, general):
        np.testing.assert_array_equal(s, g)


def test_one_packed_row_leaves_other_steps_to_the_general_path(monkeypatch):
    """A first prompt's row, rows past the buffer, two sequences, rotary without its caches: the
    general path decides (growing the cache, raising) as it always did."""
    taken = []
    original = contrib_group_query_attention._one_packed_row
    monkeypatch.setattr(contrib_group_query_attention, "_one_packed_row", lambda *a: taken.append(original(*a)) or taken[-1])
    attributes = dict(num_heads=4, kv_num_heads=2, do_rotary=1)
    first = _step([0], 8, 4, 2, 16, packed=True, rotary_positions=16)
    first[6] = np.array(1, np.int32)
    _run(first, **attributes)
    assert taken == [None]
    past_the_buffer = _step([8], 8, 4, 2, 16, packed=True, rotary_positions=16)
    assert _run(past_the_buffer, **attributes)[1].shape[2] == 9  # present is past and the new row
    assert taken == [None, None]
    two = _step([5, 5], 8, 4, 2, 16, packed=True, rotary_positions=16)
    _run(two, **attributes)
    assert len(taken) == 2  # (two sequences never reach it)
    no_caches = _step([5], 8, 4, 2, 16, packed=True)
    with pytest.raises(RunnxError, match="do_rotary=1 needs cos_cache"):
        _run(no_caches, **attributes)


@pytest.mark.parametrize("rotary_rows, start", [(200, 0), (400, 20)])
def test_a_prompts_refused_rows_leave_the_granted_caches_unwritten(rotary_rows, start):
    """A 300-row prompt (its rows shared among threads) whose positions pass the rotary caches, or
    whose rows pass the shared buffer, raises before any row is turned or written."""
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((1, 300, heads, 16)).astype(np.float32) for heads in (4, 2, 2))
    buffers = [np.full((1, 2, 310, 16), 7.0, np.float32) for _ in range(2)]
    cos, sin = (rng.standard_normal((rotary_rows, 8)).astype(np.float32) for _ in range(2))
    positions = np.arange(start, start + 300)[None]
    with pytest.raises(RunnxError, match="rotary position ids must be in|do not fit the present cache"):
        contrib_group_query_attention._rotate_and_append(q, k, v, *buffers, positions, np.array([start]), 310, cos, sin, False, (3, 4), None)
    assert all((b == 7.0).all() for b in buffers)
