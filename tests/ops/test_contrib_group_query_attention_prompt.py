"""GroupQueryAttention's causal prompt in one native call (`prompt_step`: the rows kernel, the
queries' scale, the keys' panels and the prompt-attention job) against the path it replaces, bit for
bit, against onnxruntime, with and without the decode pool's workers, and the prompts it leaves to
that path."""
from __future__ import annotations

import numpy as np
import pytest

from runnx.errors import RunnxError
from runnx.ops import contrib_group_query_attention
from runnx.ops._attention_blocks import POOLED
from runnx.ops.contrib_group_query_attention import GroupQueryAttention
from tests.ops._contrib_node import alone_and_with_workers, run_both

RNG = np.random.default_rng(46)

pytestmark = pytest.mark.skipif(not POOLED, reason="this CPU has neither AVX-512 nor AVX2 with FMA: the "
                                                   "prompt-attention job, which `prompt_step` posts, needs them")


def _normal(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def _rotary_caches(positions: int, rotary_dim: int):
    angles = np.outer(np.arange(positions), 1.0 / 10000 ** (np.arange(0, rotary_dim, 2) / rotary_dim))
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def _prompt(batch, past, steps, heads, kv_heads, size, capacity, packed=False, rotary_positions=0, fill=np.nan):
    """A prompt's inputs: `steps` new rows after `past` cached ones of each sequence in a shared
    buffer of `capacity` rows, `fill` past the cached rows."""
    past_key = np.full((batch, kv_heads, capacity, size), fill, np.float32)
    past_value = past_key.copy()
    past_key[:, :, :past] = _normal(batch, kv_heads, past, size)
    past_value[:, :, :past] = _normal(batch, kv_heads, past, size)
    q, k, v = _normal(batch, steps, heads * size), _normal(batch, steps, kv_heads * size), _normal(
        batch, steps, kv_heads * size)
    new = [np.concatenate([q, k, v], axis=2), None, None] if packed else [q, k, v]
    inputs = new + [past_key, past_value, np.full(batch, past + steps - 1, np.int32), np.array(capacity, np.int32)]
    if rotary_positions:
        inputs += list(_rotary_caches(rotary_positions, size))
    return inputs


def _run(inputs, granted=True, **attributes):
    """GroupQueryAttention on copies of the inputs, the shared buffer granted in place (as a decoder's
    plan grants a buffer it owns) unless told."""
    copies = [None if x is None else x.copy() for x in inputs]
    return GroupQueryAttention(*copies, output_count=3, overwrite=(3, 4) if granted else (), **attributes)


@pytest.fixture
def taken(monkeypatch):
    """The calls of `prompt_step`."""
    calls = []
    original = contrib_group_query_attention.prompt_step

    def counted(*arguments):
        calls.append(arguments[5].shape)  # (the rows' positions, after the board, workers, q, k, v)
        return original(*arguments)
    monkeypatch.setattr(contrib_group_query_attention, "prompt_step", counted)
    return calls


CASES = {  # batch, past, steps, heads, kv_heads, size, packed, rotary, attributes
    "rotary, packed": (1, 0, 32, 9, 3, 64, True, True, {}),
    "interleaved": (1, 0, 17, 4, 2, 16, False, True, {"rotary_interleaved": 1}),
    "no rotary": (1, 0, 5, 4, 4, 16, False, False, {}),
    "continuing a cache": (1, 6, 20, 6, 2, 16, True, True, {}),
    "two sequences": (2, 3, 9, 4, 1, 8, False, True, {}),
    "several blocks": (1, 0, 150, 6, 2, 32, True, True, {"scale": 0.3}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_prompt_in_one_call_equals_the_path_it_replaces(monkeypatch, taken, case):
    """The output and the whole buffers (NaN past the rows written included) are bitwise those of
    `_rotate_and_append` then `_attend_rows`, given the same inputs."""
    batch, past, steps, heads, kv_heads, size, packed, rotary, extra = CASES[case]
    inputs = _prompt(batch, past, steps, heads, kv_heads, size, past + steps + 7, packed, 256 if rotary else 0)
    attributes = dict(num_heads=heads, kv_num_heads=kv_heads, do_rotary=int(rotary), **extra)
    one_call = _run(inputs, **attributes)
    assert taken == [(batch, steps)]
    monkeypatch.setattr(contrib_group_query_attention, "_PROMPT_IN_ONE_CALL", False)
    replaced = _run(inputs, **attributes)
    assert len(taken) == 1
    for o, r in zip(one_call, replaced, strict=True):
        np.testing.assert_array_equal(o, r)


def test_prompt_in_one_call_does_not_depend_on_the_thread_count(taken):
    inputs = _prompt(1, 0, 200, 6, 2, 16, 210, packed=True, rotary_positions=256)
    attributes = dict(num_heads=6, kv_num_heads=2, do_rotary=1)
    alone, shared = alone_and_with_workers(lambda: _run(inputs, **attributes))
    assert len(taken) == 2
    for a, s in zip(alone, shared, strict=True):
        np.testing.assert_array_equal(a, s)


@pytest.mark.parametrize("past", [0, 5])
def test_prompt_in_one_call_equals_onnxruntime(taken, past):
    """onnxruntime's output and present rows (its buffer zero past the cached rows)."""
    inputs = _prompt(1, past, 24, 6, 2, 16, 40, packed=True, rotary_positions=64, fill=0.0)
    attributes = dict(num_heads=6, kv_num_heads=2, do_rotary=1)
    got = _run(inputs, **attributes)
    assert len(taken) == 1
    _, expected = run_both("GroupQueryAttention", inputs, outputs=3, **attributes)
    np.testing.assert_allclose(got[0], expected[0], rtol=1e-5, atol=1e-5)
    for g, e in zip(got[1:], expected[1:], strict=True):
        np.testing.assert_allclose(g[:, :, :past + 24], e[:, :, :past + 24], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("case", ["not granted", "three rows", "rows to share", "window", "attention bias",
                                  "softcap", "unequal lengths"])
def test_prompts_left_to_the_general_path(taken, case):
    """A buffer not granted in place (copied first), a prompt short enough for the masked kernel,
    one long enough that its rows pass is split among runnx's threads, a local window, a bias, a
    softcap, sequences of unequal lengths: the general path, as before."""
    steps = {"three rows": 3, "rows to share": 1100}.get(case, 12)
    inputs = _prompt(2 if case == "unequal lengths" else 1, 4, steps, 4, 2, 16, steps + 12, rotary_positions=2048)
    attributes = dict(num_heads=4, kv_num_heads=2, do_rotary=1)
    if case == "window":
        attributes["local_window_size"] = 5
    elif case == "softcap":
        attributes["softcap"] = 2.0
    elif case == "attention bias":
        inputs += [None, _normal(1, 1, steps, steps + 12)]
    elif case == "unequal lengths":
        inputs[5] = np.array([4 + steps - 1, 2 + steps - 1], np.int32)
        inputs[4][1, :, 2:] = np.nan
    output, present_key, _ = _run(inputs, granted=case != "not granted", **attributes)
    assert taken == []
    assert output.shape == (inputs[0].shape[0], steps, 4 * 16)
    assert present_key.shape == (inputs[0].shape[0], 2, steps + 12, 16)


def test_prompt_in_one_call_refuses_positions_outside_the_rotary_caches(taken):
    """Positions past the cos/sin caches' rows raise the general path's error, nothing written."""
    inputs = _prompt(1, 4, 12, 4, 2, 16, 24, rotary_positions=10)
    key, value = inputs[3].copy(), inputs[4].copy()
    with pytest.raises(RunnxError, match=r"rotary position ids must be in \[0, 10\)"):
        GroupQueryAttention(*inputs, output_count=3, overwrite=(3, 4), num_heads=4, kv_num_heads=2, do_rotary=1)
    assert len(taken) == 1
    np.testing.assert_array_equal(inputs[3], key)
    np.testing.assert_array_equal(inputs[4], value)
