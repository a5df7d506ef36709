"""Model files are parsed without the top-level initializers' raw_data, whose bytes are read
apart, each into its own aligned slice of one map (then moved to huge pages); the arrays, the
errors and everything else are what parsing the whole file gives."""
import mmap

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import runnx
from runnx.interp import loader
from runnx.interp.model_file import read_model_file
from tests._pages import huge_pages_of

RNG = np.random.default_rng(0)
# names of several lengths put the raw bytes at every offset modulo 8; some tensors are stored in
# typed fields (float_data, string_data), one is packed int4 raw bytes, one sits in a Constant
TENSORS = {
    "w": RNG.standard_normal((3, 5)).astype(np.float32),
    "ww": RNG.standard_normal(7).astype(np.float32),
    "www": RNG.integers(-9, 9, (2, 3)).astype(np.int64),
    "wwww": RNG.standard_normal(6).astype(np.float16),
    "wwwww": np.array([True, False, True]),
    "wwwwww": RNG.standard_normal((4, 4)).astype(np.float64),
    "wwwwwww": RNG.standard_normal(9).astype(np.float32),
}


def _model_file(tmp_path, duplicate=False):
    initializers = [numpy_helper.from_array(value, name) for name, value in TENSORS.items()]
    initializers.append(helper.make_tensor("typed", TensorProto.FLOAT, [3], [1.5, -2.0, 3.25]))
    initializers.append(helper.make_tensor("strings", TensorProto.STRING, [2], [b"a", b"bc"]))
    initializers.append(helper.make_tensor("packed", TensorProto.INT4, [5], bytes([0x78, 0x30, 0x0F]), raw=True))
    if duplicate:
        initializers.append(numpy_helper.from_array(TENSORS["w"], "w"))
    names = [t.name for t in initializers]
    nodes = [helper.make_node("Identity", [name], [f"out_{name}"]) for name in names]
    nodes.append(helper.make_node("Constant", [], ["out_constant"],
                                  value=numpy_helper.from_array(TENSORS["ww"], "c")))
    outputs = [helper.make_tensor_value_info(f"out_{name}", t.data_type, None) for name, t in
               zip(names + ["constant"], initializers + [initializers[1]])]
    graph = helper.make_graph(nodes, "g", [], outputs, initializers)
    path = tmp_path / "model.onnx"
    path.write_bytes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]).SerializeToString())
    return path


def test_initializers_come_from_the_map_with_the_values_the_whole_parse_gives(tmp_path):
    path = _model_file(tmp_path)
    stripped, raw = read_model_file(str(path))
    assert set(raw) == set(TENSORS) | {"packed"}  # the typed and string tensors have no raw_data
    assert len(stripped) < path.stat().st_size - sum(len(data) for data in raw.values()) + 64
    assert all(bytes(raw[name]) == value.tobytes() for name, value in TENSORS.items())
    # one allocation (huge pages from 4 MiB on), each tensor's bytes 64-byte aligned in it
    assert len({id(np.asarray(buffer).base) for buffer in raw.values()}) == 1
    assert all(np.asarray(buffer).ctypes.data % 64 == 0 for buffer in raw.values())

    from_file, from_bytes = runnx.load(path), runnx.load(path.read_bytes())  # bytes: the whole parse
    got, want = from_file.run({}), from_bytes.run({})
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].dtype == want[name].dtype and got[name].shape == want[name].shape, name
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    for name, value in TENSORS.items():
        np.testing.assert_array_equal(got[f"out_{name}"], value)
    np.testing.assert_array_equal(got["out_packed"], [-8, 7, 0, 3, -1])
    constants = loader.load_model(path).graph.constants.values()
    assert all(array.flags.aligned and not array.flags.writeable for array in constants)


def test_broken_files_fail_as_the_whole_parse_does(tmp_path):
    path = _model_file(tmp_path)
    data = path.read_bytes()
    truncated = tmp_path / "truncated.onnx"
    truncated.write_bytes(data[:len(data) // 2])
    assert read_model_file(str(truncated)) is None
    with pytest.raises(runnx.ModelLoadError, match="truncated.onnx' is not an ONNX model"):
        runnx.load(truncated)
    empty = tmp_path / "empty.onnx"
    empty.write_bytes(b"")
    assert read_model_file(str(empty)) is None
    (tmp_path / "twice").mkdir()
    twice = _model_file(tmp_path / "twice", duplicate=True)
    assert read_model_file(str(twice)) is None  # a name twice: parsed whole, refused by the loader
    with pytest.raises(runnx.InvalidModelError, match="value 'w' is defined twice"):
        runnx.load(twice)


def test_initializers_a_weights_file_replaces_are_not_read(tmp_path):
    stripped, raw = read_model_file(str(_model_file(tmp_path)), skip={"w", "ww"})
    assert set(raw) == set(TENSORS) - {"w", "ww"} | {"packed"}
    assert all(bytes(raw[name]) == value.tobytes() for name, value in TENSORS.items() if name in raw)


def test_the_weights_settle_into_huge_pages_on_a_thread_of_their_own(monkeypatch):
    """Where the kernel has too few free huge pages to fault them in at once, the weights come in
    4 KiB pages and a thread of their own collapses them."""
    import threading
    from pathlib import Path

    from runnx.interp import model_file
    from runnx.interp.model_file import settle, weight_arena

    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not mode.exists() or "[never]" in mode.read_text():
        pytest.skip("no transparent huge pages on this system")
    monkeypatch.setattr(model_file, "_free_huge_pages", lambda: 0)
    (buffer,), mapped = weight_arena([16 << 20])
    buffer[:] = 7  # read in 4 KiB pages
    assert huge_pages_of(buffer.ctypes.data) == 0
    settle(mapped)
    for thread in threading.enumerate():
        if thread.name == "runnx-huge-pages":
            thread.join(30)
    assert huge_pages_of(buffer.ctypes.data) >= 8 << 10  # at least half of the 16 MiB
    assert (buffer == 7).all()


def test_weights_come_in_huge_pages_at_once_where_the_kernel_has_them_free():
    """Enough free 2 MiB blocks (twice the map) and THP on: the map is faulted in huge pages as it is
    populated, with nothing to settle, unless a chunk came slowly: then the rest of it, in 4 KiB
    pages, is left to settle. Else all of it comes in 4 KiB pages, to be settled."""
    from pathlib import Path

    from runnx.interp import model_file

    size, pages = 32 << 20, 16
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    free = model_file._free_huge_pages() if mode.exists() and "[never]" not in mode.read_text() else 0
    (buffer,), mapped = model_file.weight_arena([size])
    whole = size + 64  # the map's bytes (`weight_arena` aligns its slices to 64)
    if mapped is None:
        assert huge_pages_of(buffer.ctypes.data) >= (size >> 10) // 2  # KiB: at least half of it
    elif mapped.size < whole:  # a chunk came slowly (a busy or virtual machine): the map's end is left
        assert mapped.ctypes.data + mapped.size >= buffer.ctypes.data + size > mapped.ctypes.data > buffer.ctypes.data
    else:
        assert free < 4 * pages  # (the count may change between the two looks: a margin)
    if free >= 4 * pages:
        assert mapped is None or mapped.size < whole
    assert not buffer.any()
    buffer[:] = 3
    assert (buffer == 3).all()


def test_huge_pages_that_come_slowly_leave_the_rest_of_the_map_to_4kib_pages(monkeypatch):
    """A chunk faulted in slower than `_FAST` (a virtual machine's host backing free blocks the
    guest reported to it) ends the huge pages: the rest of the map comes in 4 KiB pages, advised
    for huge pages and left to settle (while the models are quiet); the bytes are zeros and
    writable all the same; the first chunk is one huge page, each next one twice the last. Chunks
    that come fast all take huge pages, nothing left to settle."""
    from pathlib import Path

    from runnx.interp import model_file

    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not mode.exists() or "[never]" in mode.read_text():
        pytest.skip("no transparent huge pages on this system")
    size, chunk = 64 << 20, 8 << 20
    monkeypatch.setattr(model_file, "_CHUNK", chunk)
    monkeypatch.setattr(model_file, "_free_huge_pages", lambda: 1 << 20)
    advised = []
    advise = model_file._advise
    monkeypatch.setattr(model_file, "_advise", lambda mapped, advice: advised.append((advice, mapped.size))
                        or advise(mapped, advice))
    monkeypatch.setattr(model_file, "_FAST", 1 << 60)  # every chunk slow: only the first is faulted in huge pages
    (buffer,), mapped = model_file.weight_arena([size])
    first = model_file.HUGE_PAGE  # the first chunk: one huge page
    rest = size + 64 - first
    assert (model_file._MADV_POPULATE_WRITE, first) in advised
    assert mapped is not None and mapped.size == rest  # the map's bytes after the first chunk: its end
    assert buffer.ctypes.data < mapped.ctypes.data < mapped.ctypes.data + rest >= buffer.ctypes.data + size
    assert advised[-3:] == [(mmap.MADV_NOHUGEPAGE, rest), (model_file._MADV_POPULATE_WRITE, rest),
                            (mmap.MADV_HUGEPAGE, rest)]
    assert huge_pages_of(buffer.ctypes.data) <= (2 * first) >> 10  # KiB: the first chunk's (and one more page)
    assert not buffer.any()
    buffer[:] = 5
    assert (buffer == 5).all()

    advised.clear()
    monkeypatch.setattr(model_file, "_FAST", 1)  # every chunk fast
    (buffer,), mapped = model_file.weight_arena([size])
    chunks, left, step = [], size + 64, model_file.HUGE_PAGE  # each chunk twice the last, up to `_CHUNK`
    while left > 0:
        chunks.append(min(step, left))
        left -= chunks[-1]
        step = min(2 * step, chunk)
    assert mapped is None and [(a, n) for a, n in advised if a == model_file._MADV_POPULATE_WRITE] == [
        (model_file._MADV_POPULATE_WRITE, n) for n in chunks]
    assert mmap.MADV_NOHUGEPAGE not in [a for a, _ in advised]


def test_settles_held_wait_for_the_fold_then_collapse_one_map_after_another(monkeypatch):
    """Inside `settles_held` a map's settling waits (a load folds a tied LM head's transposed copy
    first); `settle_held` or the block's end hands the maps over in order to one collapsing thread,
    never two at once."""
    import threading
    import time

    from runnx.interp import model_file

    collapsed, running = [], []

    def advise(mapped, advice):
        if advice == model_file._MADV_COLLAPSE:
            running.append(sum(t.name == "runnx-huge-pages" for t in threading.enumerate()))
            time.sleep(0.05)
            collapsed.append(mapped)
        return True

    monkeypatch.setattr(model_file, "_advise", advise)
    monkeypatch.setattr(model_file, "QUIET", 0.0)
    maps = [np.zeros(4096, np.uint8) for _ in range(4)]
    with model_file.settles_held():
        model_file.settle(maps[0])
        model_file.settle(maps[1])
        assert collapsed == [] and model_file._collapsing is None
        model_file.settle_held()
        model_file.settle(maps[2])  # held again, until the block ends
    model_file.settle(maps[3])
    for _ in range(200):
        if model_file._collapsing is None and len(collapsed) >= 4:
            break
        time.sleep(0.02)
    owners = [next(i for i, m in enumerate(maps) if m.ctypes.data <= piece.ctypes.data < m.ctypes.data + m.size)
              for piece in collapsed]  # (a map crossing a 2 MiB boundary collapses in two pieces)
    assert sorted(set(owners)) == [0, 1, 2, 3] and owners == sorted(owners)
    assert set(running) == {1}


def test_settling_collapses_a_huge_page_at_a_time_once_the_models_are_quiet(monkeypatch):
    """A settling map collapses a 2 MiB piece of the address space at a time (the ends, parts of one,
    pieces of their own), in order, each only once nothing has been busy (a run, load or prepack:
    `quiet.BUSY`) for `QUIET` seconds: nothing while a block stays busy, then all of it."""
    import time

    from runnx.interp import model_file
    from runnx.interp.quiet import BUSY

    collapsed = []

    def advise(mapped, advice):
        if advice == model_file._MADV_COLLAPSE:
            collapsed.append((mapped.ctypes.data, mapped.size, BUSY.quiet_for()))
        return True

    monkeypatch.setattr(model_file, "_advise", advise)
    monkeypatch.setattr(model_file, "QUIET", 0.2)
    page = model_file.HUGE_PAGE
    backing = np.zeros(6 * page // 4, np.float32)  # (the map's owner of any dtype: pieces are bytes)
    start = -backing.ctypes.data % page + page // 2  # half a huge page into one
    mapped = backing.view(np.uint8)[start:start + 3 * page]  # half, two whole, half
    with BUSY:
        model_file.settle(mapped)
        time.sleep(0.5)
        assert collapsed == []  # busy throughout
    for _ in range(300):
        if model_file._collapsing is None:
            break
        time.sleep(0.01)
    address = mapped.ctypes.data
    assert [(a - address, n) for a, n, _ in collapsed] == [(0, page // 2), (page // 2, page),
                                                         (3 * page // 2, page), (5 * page // 2, page // 2)]
    assert all(quiet >= 0.2 for _, _, quiet in collapsed)

    collapsed.clear()  # a map dropped while it waits is not kept alive, nor collapsed
    import gc
    import weakref
    dropped = np.zeros(2 * page, np.uint8)
    gone = weakref.ref(dropped)
    with BUSY:
        model_file.settle(dropped[page // 2:])
        del dropped
        gc.collect()
        assert gone() is None
    for _ in range(300):
        if model_file._collapsing is None:
            break
        time.sleep(0.01)
    assert collapsed == []
    assert model_file._collapsing is None  # the thread ended with its queue
