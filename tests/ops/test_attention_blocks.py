"""Prefill attention in blocks of query positions (`runnx/ops/_attention_blocks.py`): the same
values as the whole score matrix, keys a row cannot see left out only where they add exactly 0; on
the decode pool's prompt-attention job (runnx's own products, AVX-512) and on numpy's products,
each test on both."""
from __future__ import annotations

import numpy as np
import pytest

from runnx.ops import _attention_blocks, _kernels_gemm
from runnx.ops._attention_blocks import attend_blocks, visible_ends
from runnx.runtime import prompt_jobs

RNG = np.random.default_rng(7)
LOWEST = np.finfo(np.float32).min
needs_avx512 = pytest.mark.skipif(not _attention_blocks.POOLED,
                                  reason="this CPU has neither AVX-512 nor AVX2 with FMA: numpy's products compute every block")


@pytest.fixture(autouse=True, params=[pytest.param("job", marks=needs_avx512), "numpy"])
def path(request, monkeypatch):
    """Each test on the pool's job (where runnx's own products run) and on numpy's products."""
    if request.param == "numpy":
        monkeypatch.setattr(_attention_blocks, "POOLED", False)
    return request.param


def _reference(scaled, key, value, bias, fill):
    """The whole score matrix in float64, NaN probabilities to the fill (Where(IsNaN) after Softmax)."""
    per = scaled.shape[1] // key.shape[1]
    keys, values = np.repeat(key, per, axis=1).astype(np.float64), np.repeat(value, per, axis=1).astype(np.float64)
    scores = scaled.astype(np.float64) @ np.swapaxes(keys, -1, -2)
    if bias is not None:
        scores = scores + bias
    with np.errstate(invalid="ignore"):
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        weights /= weights.sum(-1, keepdims=True)
    return np.where(np.isnan(weights), fill, weights) @ values


def _causal(length: int, past: int, masked=LOWEST):
    keys = np.arange(past + length)
    return np.where(keys[None, :] <= past + np.arange(length)[:, None], 0, masked).astype(np.float32)


def _inputs(batch, heads, groups, length, size):
    scaled = (RNG.standard_normal((batch, heads, length, 16)) * 0.3).astype(np.float32)
    key = RNG.standard_normal((batch, groups, size, 16)).astype(np.float32)
    value = RNG.standard_normal((batch, groups, size, 8)).astype(np.float32)
    return scaled, key, value


@pytest.mark.parametrize("masked", [LOWEST, -np.inf])
@pytest.mark.parametrize("length,past", [(150, 0), (70, 30), (1, 5)])
def test_causal_prompts_match_the_whole_matrix(masked, length, past):
    scaled, key, value = _inputs(1, 6, 2, length, past + length)
    bias = _causal(length, past, masked)[None, None]
    got = attend_blocks(scaled, key, value, bias, 0.0)
    np.testing.assert_allclose(got, _reference(scaled, key, value, bias, 0.0), rtol=2e-5, atol=2e-6)


def test_a_causal_block_reads_only_the_keys_its_rows_see(monkeypatch):
    """Each row of a causal prompt sees the keys up to its own; a block of 64 rows reads the first
    64 keys only: keys past them may hold anything (NaN here) without touching its rows."""
    ends = np.empty((1, 1, 150), np.int64)
    visible_ends(_causal(150, 0)[None, None], ends)
    np.testing.assert_array_equal(ends[0, 0], np.arange(1, 151))
    monkeypatch.setattr(_attention_blocks, "BLOCK", 64)
    monkeypatch.setattr(_attention_blocks, "block_positions", lambda per: 64)
    scaled, key, value = _inputs(1, 2, 1, 150, 150)
    key[:, :, 64:] = np.nan
    value[:, :, 64:] = np.nan
    got = attend_blocks(scaled, key, value, _causal(150, 0)[None, None], np.nan)
    assert np.isfinite(got[:, :, :64]).all()
    assert np.isnan(got[:, :, 64:]).all()  # the later rows read those keys


@pytest.mark.parametrize("shape", [(2, 1, 40, 90), (2, 6, 40, 90), (1, 1, 1, 90), (2, 1, 1, 90), (1, 1, 40, 1)])
def test_biases_broadcast_as_the_scores_take_them(shape):
    scaled, key, value = _inputs(2, 6, 3, 40, 90)
    bias = np.where(RNG.random(shape) < 0.3, LOWEST, RNG.standard_normal(shape)).astype(np.float32)
    got = attend_blocks(scaled, key, value, bias, 0.0)
    np.testing.assert_allclose(got, _reference(scaled, key, value, bias, 0.0), rtol=2e-5, atol=2e-6)


def test_rows_that_see_no_key_keep_every_key_as_the_whole_matrix_does():
    """A left-padded row masked with the lowest float is a uniform average over every key (not
    over the keys up to a cut); masked with -inf its probabilities are NaN, then the fill."""
    scaled, key, value = _inputs(1, 2, 1, 80, 80)
    for masked, fill in ((LOWEST, 0.0), (-np.inf, -3.0)):
        bias = _causal(80, 0, masked)
        bias[:5] = masked  # five padded rows
        bias = bias[None, None]
        got = attend_blocks(scaled, key, value, bias, fill)
        np.testing.assert_allclose(got, _reference(scaled, key, value, bias, fill), rtol=2e-5, atol=2e-6)


def test_unusual_bias_values_keep_every_key():
    """A bias between -1e30 and -1e20, or NaN, is no mask: its row keeps all keys."""
    bias = np.full((1, 1, 3, 10), LOWEST, np.float32)
    bias[0, 0, :, 0] = 0
    bias[0, 0, 1, 5] = -1e25
    bias[0, 0, 2, 7] = np.nan
    ends = np.empty((1, 1, 3), np.int64)
    visible_ends(bias, ends)
    assert ends.reshape(-1).tolist() == [1, 10, 10]


def test_cache_views_and_transposed_keys_give_the_contiguous_arrays_result(path):
    """A prefix of a cache's buffer (rows contiguous, heads apart) is read in place; keys given
    transposed back (an encoder's K^T swapped) are copied first: the job's values are the same bits
    (numpy's BLAS may sum a strided operand in another order)."""
    scaled, key, value = _inputs(1, 4, 2, 30, 40)
    buffer_key, buffer_value = np.zeros((1, 2, 64, 16), np.float32), np.zeros((1, 2, 64, 8), np.float32)
    buffer_key[:, :, :40], buffer_value[:, :, :40] = key, value
    swapped = np.ascontiguousarray(key.swapaxes(2, 3)).swapaxes(2, 3)
    bias = _causal(30, 10)[None, None]
    expected = attend_blocks(scaled, key, value, bias, 0.0)
    same = np.testing.assert_array_equal if path == "job" else np.testing.assert_allclose
    same(attend_blocks(scaled, buffer_key[:, :, :40], buffer_value[:, :, :40], bias, 0.0), expected)
    same(attend_blocks(scaled, swapped, value, bias, 0.0), expected)
    same(attend_blocks(np.asfortranarray(scaled), key, value, bias, 0.0), expected)
    np.testing.assert_allclose(expected, _reference(scaled, key, value, bias, 0.0), rtol=2e-5, atol=2e-6)


def test_a_single_key_whose_row_has_any_stride_is_read_as_it_is():
    """One key (an encoder's first frame, a one-token cache): the stride of its one row does not
    matter (numpy gives such an axis any stride, and keeps it when it copies)."""
    scaled, key, value = _inputs(1, 4, 2, 3, 1)
    odd = np.lib.stride_tricks.as_strided(key, strides=(key.strides[0], key.strides[1], 4, 4))
    assert np.ascontiguousarray(odd).strides[2] == 4
    got = attend_blocks(scaled, odd, value, None, 0.0)
    np.testing.assert_allclose(got, _reference(scaled, key, value, None, 0.0), rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(got, np.repeat(value, 2, axis=1).repeat(3, axis=2), rtol=1e-6)


@pytest.mark.parametrize("case", ["causal", "causal -0.0", "padded", "added", "nan"])
def test_a_bias_that_adds_nothing_before_each_rows_end_is_left_out_with_the_same_bits(case, path, monkeypatch):
    """The job masks each row's keys from its end on itself, so a bias that is 0 (or -0.0) before
    every row's end is not read; any other bias is. Either way the bits are the job's with the bias.
    (numpy's blocks take each row's mask from the bias: they always read it.)"""
    scaled, key, value = _inputs(1, 6, 2, 90, 100)
    bias = _causal(90, 10)
    if case == "causal -0.0":
        bias[bias == 0] = -0.0
    elif case == "padded":
        bias[:, :3] = LOWEST  # a left-padded prompt: masked keys before a row's end
    elif case == "added":
        bias[40, 2] = 0.5
    elif case == "nan":
        bias[40, 2] = np.nan
    bias = bias[None, None]
    given = []
    real = prompt_jobs.attention_blocks
    monkeypatch.setattr(prompt_jobs, "attention_blocks", lambda *a: (given.append(a[3]), real(*a))[1])
    got = attend_blocks(scaled, key, value, bias, 0.0)
    np.testing.assert_allclose(got, _reference(scaled, key, value, bias, 0.0), rtol=2e-5, atol=2e-6)
    if path == "numpy":
        assert given == []
        return
    assert (given[0] is None) == (case in ("causal", "causal -0.0"))
    ends = np.empty((1, 1, 90), np.int64)
    visible_ends(bias, ends)
    with_bias = np.empty_like(got)
    assert _attention_blocks.pooled_attention(scaled, key, value, bias, ends, 0.0, with_bias)
    assert given[-1] is bias
    np.testing.assert_array_equal(got, with_bias)


@pytest.mark.parametrize("layout", ["rows", "heads interleaved", "columns"])
@pytest.mark.parametrize("size", [37, 64])
def test_keys_reach_the_job_as_the_panels_of_their_columns_from_any_layout(layout, size):
    """The job reads each KV head's keys as the panels of their columns, made once a call: panel p
    holds keys p NR .. p NR + NR, element [d, j] key j's element d, zero past the last key, from keys
    given by their rows, with the heads interleaved (a projection's output) or transposed."""
    key = RNG.standard_normal((2, 3, size, 16)).astype(np.float32)
    given = {"rows": key, "heads interleaved": np.ascontiguousarray(key.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3),
             "columns": np.ascontiguousarray(key.swapaxes(2, 3)).swapaxes(2, 3)}[layout]
    panels = _attention_blocks._key_panels(given)
    width = _kernels_gemm.NR  # a panel's keys (32 with AVX-512, 16 with AVX2)
    count = -(-size // width)
    assert panels.shape == (2, 3, count * 16, width) and panels.flags.c_contiguous
    padded = np.zeros((2, 3, count * width, 16), np.float32)
    padded[:, :, :size] = key
    expected = padded.reshape(2, 3, count, width, 16).transpose(0, 1, 2, 4, 3).reshape(2, 3, count * 16, width)
    np.testing.assert_array_equal(panels, expected)


def test_a_runs_attentions_over_one_bias_find_its_visible_keys_once_until_it_is_written(monkeypatch):
    """With the run's ctx, the layers reading one bias find its rows' visible keys once (`RunContext.keep`),
    each result the bits of the call without ctx; once an in-place write into the bias is granted
    (the executor's `overwriting`), the next call finds them again, for the new values."""
    from runnx.capture.ownership import storage_keys
    from runnx.interp.context import RunContext
    from runnx.interp.options import Options

    found = []
    visible_ends_of = _attention_blocks._visible_ends_of
    monkeypatch.setattr(_attention_blocks, "_visible_ends_of", lambda bias: found.append(1) or visible_ends_of(bias))
    ctx = RunContext(Options())
    bias = _causal(90, 10)[None, None]
    for layer in range(3):
        scaled, key, value = _inputs(1, 6, 2, 90, 100)
        got = attend_blocks(scaled, key, value, bias, 0.0, ctx)
        np.testing.assert_array_equal(got, attend_blocks(scaled, key, value, bias, 0.0))
    assert len(found) == 1 + 3  # once with ctx, then once each call without

    bias[0, 0, 40:, 70:] = LOWEST  # rows 40 on now see fewer keys: written in place
    ctx.overwriting(tuple(storage_keys(bias)))
    found.clear()
    got = attend_blocks(scaled, key, value, bias, 0.0, ctx)
    np.testing.assert_array_equal(got, attend_blocks(scaled, key, value, bias, 0.0))
    np.testing.assert_allclose(got, _reference(scaled, key, value, bias, 0.0), rtol=2e-5, atol=2e-6)
    assert len(found) == 2


def test_a_prompts_layers_find_the_masks_visible_keys_once_a_run_with_the_same_logits(fixtures_dir, monkeypatch):
    """A 100-token prompt through a 2-layer Llama export: both layers' attention (fused, the mask's
    bias made once a run) find its visible keys once; keeping nothing gives the same logits, bitwise."""
    from runnx.generate.generator import Generator
    from runnx.interp.context import RunContext

    found = []
    visible_ends_of = _attention_blocks._visible_ends_of
    monkeypatch.setattr(_attention_blocks, "_visible_ends_of", lambda bias: found.append(1) or visible_ends_of(bias))
    generator = Generator.from_folder(fixtures_dir / "tiny-llama")

    def prompt_logits():
        generator.start(max_new_tokens=1, stop_token_ids=())
        generator.append_tokens(list(range(3, 103)))
        return np.array(generator.compute_logits())

    kept = prompt_logits()
    assert len(found) == 1
    found.clear()
    monkeypatch.setattr(RunContext, "keep", lambda self, key, arrays, compute: compute())
    np.testing.assert_array_equal(prompt_logits(), kept)
    assert len(found) == 2
