"""Capacity buffers come in 4 KiB pages as their rows are written (`capacity.allocate_prefix`,
`model_file.in_small_pages`): numpy advises arrays of 4 MiB and more for huge pages, which a virtual
machine's host may back at its own pace on first touch (a KV cache's first prompt waited 0.7 s)."""
from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np
import pytest

from runnx.capture import capacity
from runnx.generate import kv_cache
from runnx.interp import model_file
from tests._pages import huge_pages_of


@pytest.mark.parametrize("zeroed", [False, True])
def test_a_large_capacity_buffer_is_advised_small_pages_before_any_row_is_written(monkeypatch, zeroed):
    advised = []
    advise = model_file._advise
    monkeypatch.setattr(model_file, "_advise", lambda array, advice: advised.append((advice, array.ctypes.data,
                                                                                       array.size)) or advise(array, advice))
    view = capacity.allocate_prefix((1, 8, 3, 128), 2, 4096, np.float32, zeroed)  # 16 MiB
    buffer = view.base
    assert view.shape == (1, 8, 3, 128) and buffer.shape == (1, 8, 4096, 128)
    (advice, start, size), = advised
    assert advice == mmap.MADV_NOHUGEPAGE
    assert start % mmap.PAGESIZE == 0 and buffer.ctypes.data <= start < buffer.ctypes.data + mmap.PAGESIZE
    assert start + size <= buffer.ctypes.data + buffer.nbytes < start + size + 2 * mmap.PAGESIZE
    if zeroed:
        assert not buffer.any()

    advised.clear()  # a small one: left as it is
    capacity.allocate_prefix((1, 2, 3, 4), 2, 10, np.float32)
    assert advised == []


def test_rows_written_into_a_kv_buffer_take_no_huge_pages():
    """Where the kernel gives huge pages on request, a capacity buffer's first rows, one in each head's
    2 MiB plane, still fault in 4 KiB pages: the buffer's mapping holds no huge page."""
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not mode.exists() or "[never]" in mode.read_text():
        pytest.skip("no transparent huge pages on this system")
    cache = kv_cache.KVCache.empty({"past": (1, 8, 0, 128)}, {"past": np.float32}, 4096, zeroed=True)
    buffer = cache._buffers["past"]
    buffer[0, :, 0, :] = 1.0  # a prompt's first row in each head's plane
    middle = buffer.ctypes.data + buffer.nbytes // 2
    assert huge_pages_of(middle) == 0
    assert (buffer[0, :, 0] == 1.0).all() and not buffer[0, :, 1:].any()
