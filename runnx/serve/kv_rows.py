"""Rows joining and leaving a batched KV cache between decode steps.

A batch's KV tensors are [rows, heads, length, head_dim] with one attention mask [rows, length];
rows shorter than the batch are left-padded (zeros in the cache, 0 in the mask), as
`Generator.generate_batch` pads prompts. Position ids come from the mask (decoder.py), so padding a
row, or dropping columns that are padding in every row, leaves what the model computes for that row
unchanged."""
from __future__ import annotations

import numpy as np

from runnx.generate.kv_cache import SEQUENCE_AXIS


def stack_rows(parts: list[tuple[dict[str, np.ndarray], np.ndarray]]) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """One batch from several (KV arrays, attention mask) parts, each left-padded to the longest."""
    length = max(mask.shape[1] for _, mask in parts)
    rows = sum(mask.shape[0] for _, mask in parts)
    names = list(parts[0][0])
    arrays = {}
    for name in names:
        sample = parts[0][0][name]
        shape = list(sample.shape)
        shape[0], shape[SEQUENCE_AXIS] = rows, length
        arrays[name] = np.zeros(shape, sample.dtype)
    mask = np.zeros((rows, length), np.int64)
    row = 0
    for part_arrays, part_mask in parts:
        count, width = part_mask.shape
        mask[row:row + count, length - width:] = part_mask
        for name in names:
            arrays[name][row:row + count, :, length - width:] = part_arrays[name]
        row += count
    return arrays, mask


def keep_rows(arrays: dict[str, np.ndarray], mask: np.ndarray, rows: list[int]) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """The batch without the rows not listed, and without leading columns that are padding in every
    row left (so a long request that finished no longer widens the rest)."""
    mask = mask[rows]
    used = np.flatnonzero(mask.any(axis=0))
    start = int(used[0]) if used.size else mask.shape[1]
    index = (rows, slice(None), slice(start, None))
    return {name: array[index] for name, array in arrays.items()}, mask[:, start:]
