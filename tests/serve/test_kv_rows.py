"""Rows joining and leaving a batched KV cache: left padding on the way in, compaction on the way out."""
from __future__ import annotations

import numpy as np

from runnx.serve.kv_rows import keep_rows, stack_rows


def part(rows: int, length: int, seed: int):
    rng = np.random.default_rng(seed)
    arrays = {"k": rng.standard_normal((rows, 2, length, 3)).astype(np.float32),
              "v": rng.standard_normal((rows, 2, length, 3)).astype(np.float32)}
    return arrays, np.ones((rows, length), np.int64)


def test_stack_left_pads_to_the_longest_and_keep_undoes_it():
    short, long = part(1, 3, 0), part(2, 5, 1)
    originals = {name: short[0][name].copy() for name in short[0]}
    arrays, mask = stack_rows([short, long])
    assert mask.tolist() == [[0, 0, 1, 1, 1], [1] * 5, [1] * 5]
    assert np.array_equal(arrays["k"][0, :, 2:], short[0]["k"][0]) and not arrays["k"][0, :, :2].any()
    assert np.array_equal(arrays["v"][1:], long[0]["v"])
    # the short row alone again: the two padding columns are cut off
    kept, kept_mask = keep_rows(arrays, mask, [0])
    assert kept_mask.tolist() == [[1, 1, 1]]
    assert all(np.array_equal(kept[name], originals[name]) for name in originals)
    assert all(np.array_equal(short[0][name], originals[name]) for name in originals)  # inputs untouched


def test_keep_rows_keeps_columns_some_row_still_uses():
    arrays, mask = stack_rows([part(1, 2, 0), part(1, 4, 1), part(1, 6, 2)])
    kept, kept_mask = keep_rows(arrays, mask, [0, 1])
    assert kept_mask.tolist() == [[0, 0, 1, 1], [1, 1, 1, 1]]
    assert np.array_equal(kept["k"], arrays["k"][:2, :, 2:])
