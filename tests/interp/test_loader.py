"""Loading: external data confined to the model folder (float weights read into memory, the rest
memory-mapped), safetensors weights, and one error listing every unsupported op."""
import json
import mmap
import os
import struct
import sys

import numpy as np
import pytest
import safetensors.numpy
from onnx import TensorProto, helper, numpy_helper

import runnx
from runnx.ops import registry

WEIGHT = np.arange(12, dtype=np.float32).reshape(3, 4)


def _proto(weight=WEIGHT, nodes=None):
    init = numpy_helper.from_array(weight, "w")
    graph = helper.make_graph(
        nodes or [helper.make_node("Add", ["x", "w"], ["y"], name="add")], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 4])], [init])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _external(tmp_path, location, offset=None, length=None, payload=WEIGHT.tobytes()):
    """Save a model whose initializer 'w' points at `location` (written by the test itself)."""
    model = _proto()
    tensor = model.graph.initializer[0]
    tensor.ClearField("raw_data")
    tensor.data_location = TensorProto.EXTERNAL
    entries = {"location": location}
    if offset is not None:
        entries["offset"] = str(offset)
    if length is not None:
        entries["length"] = str(length)
    for key, value in entries.items():
        tensor.external_data.add(key=key, value=value)
    folder = tmp_path / "model"
    folder.mkdir(exist_ok=True)
    if payload is not None and location and not os.path.isabs(location) and ".." not in location:
        (folder / location).write_bytes(payload)
    path = folder / "model.onnx"
    path.write_bytes(model.SerializeToString())
    return path


def _reaches_mmap(array) -> bool:
    seen = array
    while seen is not None:
        if isinstance(seen, mmap.mmap):
            return True
        seen = getattr(seen, "base", None) if not isinstance(seen, memoryview) else seen.obj
    return False


def test_valid_external_data_is_memory_mapped_not_copied(tmp_path):
    path = _external(tmp_path, "weights.bin", offset=16, length=WEIGHT.nbytes,
                     payload=b"\0" * 16 + WEIGHT.tobytes())
    model = runnx.load(path)
    constant = model.graph.constants[model.graph.ids["w"]]
    np.testing.assert_array_equal(constant, WEIGHT)
    assert _reaches_mmap(constant) and not constant.flags.writeable
    x = np.ones((3, 4), np.float32)
    np.testing.assert_array_equal(model.run({"x": x})["y"], WEIGHT + 1)


def _model_over_data_file(tmp_path, nodes, inputs, outputs, arrays: dict, head=0, tail=0, opsets=(("", 18),)):
    """model.onnx of `nodes` whose initializers are `arrays` (name -> array), stored one after
    another in weights.bin after `head` zero bytes and before `tail` more."""
    tensors, offset = [], head
    for name, array in arrays.items():
        tensor = TensorProto(name=name, data_type=helper.np_dtype_to_tensor_dtype(array.dtype), dims=array.shape,
                             data_location=TensorProto.EXTERNAL)
        for key, value in {"location": "weights.bin", "offset": str(offset), "length": str(array.nbytes)}.items():
            tensor.external_data.add(key=key, value=value)
        tensors.append(tensor)
        offset += array.nbytes
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "weights.bin").write_bytes(b"\0" * head + b"".join(a.tobytes() for a in arrays.values()) + b"\0" * tail)
    graph = helper.make_graph(nodes, "g", inputs, outputs, tensors)
    path = folder / "model.onnx"
    path.write_bytes(helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets])
                     .SerializeToString())
    return path


def _large_external(tmp_path):
    """x (1, 1024) @ w, its initializer (4 MiB of float32) at an offset in a 5 MiB data file."""
    weight = np.random.default_rng(3).standard_normal((1024, 1024)).astype(np.float32)
    path = _model_over_data_file(tmp_path, [helper.make_node("MatMul", ["x", "w"], ["y"])],
                                 [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1024])],
                                 [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1024])], {"w": weight},
                                 head=4096, tail=1 << 20)
    return path, weight


def _open_on(path) -> bool:
    """Whether a file descriptor of this process is open on `path` (an mmap of a file keeps one)."""
    fds = "/proc/self/fd"
    return any(os.path.realpath(os.path.join(fds, fd)) == os.path.realpath(path) for fd in os.listdir(fds))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="reads /proc/self/fd (Linux)")
def test_a_large_external_data_file_is_read_into_memory_the_file_left_free(tmp_path):
    """Float initializers of a huge page or more in a data file are read into a weight arena (huge
    pages where the kernel has them: a decode step streams every weight, a file's map stays in
    4 KiB pages): the file is not held open, the arrays are read-only and keep their values when
    the file's bytes change."""
    path, weight = _large_external(tmp_path)
    model = runnx.load(path)
    constant = model.graph.constants[model.graph.ids["w"]]
    np.testing.assert_array_equal(constant, weight)
    assert not constant.flags.writeable and not _open_on(path.parent / "weights.bin")
    with open(path.parent / "weights.bin", "r+b") as handle:
        handle.seek(4096)
        handle.write(np.ones(weight.size, np.float32).tobytes())
    x = np.random.default_rng(4).standard_normal((1, 1024)).astype(np.float32)
    np.testing.assert_allclose(model.run({"x": x})["y"], x @ weight, rtol=1e-4, atol=1e-3)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="reads /proc/self/fd (Linux)")
def test_a_large_external_data_file_memory_cannot_hold_twice_stays_mapped(tmp_path, monkeypatch):
    from runnx.interp import external_data

    path, weight = _large_external(tmp_path)
    monkeypatch.setattr(external_data, "_available_memory", lambda: 6 << 20)  # under twice its 4 MiB
    model = runnx.load(path)
    constant = model.graph.constants[model.graph.ids["w"]]
    np.testing.assert_array_equal(constant, weight)
    assert _reaches_mmap(constant) and not constant.flags.writeable and _open_on(path.parent / "weights.bin")


def test_only_float_initializers_of_a_data_file_are_read_ahead(tmp_path):
    """A data file holding a float weight and packed bytes (4-bit weights, repacked anyway): the
    float one is read into memory, the bytes stay mapped (a change to the file shows in them)."""
    weight = np.random.default_rng(5).standard_normal((1024, 1024)).astype(np.float32)
    packed = np.arange(4096, dtype=np.uint8)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"]), helper.make_node("Identity", ["u"], ["z"])]
    path = _model_over_data_file(tmp_path, nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1024])],
                                 [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1024]),
                                  helper.make_tensor_value_info("z", TensorProto.UINT8, [4096])],
                                 {"w": weight, "u": packed})
    folder = path.parent
    model = runnx.load(path, fold_constants=False)
    with open(folder / "weights.bin", "r+b") as handle:
        handle.write(np.zeros(weight.size, np.float32).tobytes() + (packed + 1).tobytes())
    constants = model.graph.constants
    np.testing.assert_array_equal(constants[model.graph.ids["w"]], weight)
    np.testing.assert_array_equal(constants[model.graph.ids["u"]], packed + 1)


def test_a_table_only_gathered_stays_mapped_a_streamed_weight_is_read_ahead(tmp_path):
    """Float initializers in one data file: an embedding table only a Gather reads (a few rows a
    step) stays mapped, not resident whole; a weight a MatMul streams is read into memory."""
    table = np.random.default_rng(6).standard_normal((1024, 1024)).astype(np.float32)
    weight = np.random.default_rng(7).standard_normal((1024, 1024)).astype(np.float32)
    nodes = [helper.make_node("Gather", ["table", "ids"], ["rows"]), helper.make_node("MatMul", ["rows", "w"], ["y"])]
    path = _model_over_data_file(tmp_path, nodes, [helper.make_tensor_value_info("ids", TensorProto.INT64, [1, 2])],
                                 [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 1024])],
                                 {"table": table, "w": weight})
    folder = path.parent
    model = runnx.load(path)
    with open(folder / "weights.bin", "r+b") as handle:
        handle.write(np.ones(2 * table.size, np.float32).tobytes())
    y = model.run({"ids": np.array([[3, 5]], np.int64)})["y"]
    np.testing.assert_allclose(y, np.ones((1, 2, 1024), np.float32) @ weight, rtol=1e-4, atol=1e-3)


def test_a_four_bit_weights_bytes_and_scales_stay_mapped_a_streamed_weight_is_read_ahead(tmp_path):
    """A MatMulNBits weight's bytes and float scales, which runnx repacks into tiles of its own (its
    products never read them as stored), stay mapped; a float weight a MatMul streams, in the same
    data file, is read into memory (a change to the file after the load shows in the first only)."""
    rng = np.random.default_rng(8)
    weight = rng.standard_normal((1024, 1024)).astype(np.float32)
    depth, width, block = 1024, 256, 32
    packed = rng.integers(0, 256, (width, depth // block, block // 2), dtype=np.uint8)
    scales = (rng.random(width * depth // block) / 8).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"]),
             helper.make_node("MatMulNBits", ["x", "packed", "scales"], ["z"], domain="com.microsoft", K=depth,
                              N=width, bits=4, block_size=block)]
    path = _model_over_data_file(tmp_path, nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1024])],
                                 [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1024]),
                                  helper.make_tensor_value_info("z", TensorProto.FLOAT, [1, width])],
                                 {"w": weight, "packed": packed, "scales": scales},
                                 opsets=(("", 18), ("com.microsoft", 1)))
    model = runnx.load(path)
    with open(path.parent / "weights.bin", "r+b") as handle:  # the mapped bytes change, the read ones not
        handle.write(np.zeros(weight.size, np.float32).tobytes() + packed.tobytes() + (2 * scales).tobytes())
    x = rng.standard_normal((1, 1024)).astype(np.float32)
    low, high = (packed & 15).astype(np.float32), (packed >> 4).astype(np.float32)
    nibbles = np.stack([low, high], axis=-1).reshape(width, depth // block, block)
    dequantized = ((nibbles - 8) * 2 * scales.reshape(width, depth // block, 1)).reshape(width, depth)
    result = model.run({"x": x})
    np.testing.assert_allclose(result["y"], x @ weight, rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(result["z"], x @ dequantized.T, rtol=1e-4, atol=1e-3)


def test_the_memory_available_is_read_from_the_kernel():
    from runnx.interp import external_data

    available = external_data._available_memory()
    assert available > 64 << 20 if os.path.exists("/proc/meminfo") else available == 0


@pytest.mark.parametrize("location, message", [
    ("../weights.bin", "escapes the model folder"),
    ("sub/../../weights.bin", "escapes the model folder"),
    ("/etc/passwd", "must be relative"),
    ("", "must be relative"),
])
def test_external_data_outside_the_model_folder_is_refused(tmp_path, location, message):
    (tmp_path / "weights.bin").write_bytes(WEIGHT.tobytes())
    with pytest.raises(runnx.ExternalDataError, match=message) as caught:
        runnx.load(_external(tmp_path, location))
    assert "tensor 'w'" in str(caught.value)


def test_external_data_through_a_symlink_is_refused(tmp_path):
    (tmp_path / "secret.bin").write_bytes(WEIGHT.tobytes())
    path = _external(tmp_path, "link.bin", payload=None)
    os.symlink(tmp_path / "secret.bin", path.parent / "link.bin")
    with pytest.raises(runnx.ExternalDataError, match="symlink"):
        runnx.load(path)


@pytest.mark.parametrize("offset, length", [(0, WEIGHT.nbytes + 4), (8, WEIGHT.nbytes), (10**12, 4), (-4, 4)])
def test_external_data_range_outside_the_file_is_refused(tmp_path, offset, length):
    with pytest.raises(runnx.ExternalDataError, match="outside 'weights.bin'"):
        runnx.load(_external(tmp_path, "weights.bin", offset=offset, length=length))


def test_external_data_of_the_wrong_size_is_refused(tmp_path):
    with pytest.raises(runnx.InvalidModelError, match="tensor 'w' has 40 bytes"):
        runnx.load(_external(tmp_path, "weights.bin", length=40))


def test_missing_external_file_and_bytes_models_with_external_data_are_refused(tmp_path):
    path = _external(tmp_path, "weights.bin", payload=None)
    with pytest.raises(runnx.ExternalDataError, match="not found"):
        runnx.load(path)
    with pytest.raises(runnx.InvalidModelError, match="not loaded from a file"):
        runnx.load(path.read_bytes())


def _two_external(tmp_path, second_location):
    """A model whose initializers 'w' and 'v' lie in weights.bin and `second_location`."""
    model = _proto(nodes=[helper.make_node("Add", ["x", "w"], ["a"], name="add"),
                          helper.make_node("Add", ["a", "v"], ["y"], name="add_v")])
    model.graph.initializer.append(numpy_helper.from_array(WEIGHT * 2, "v"))
    for index, (tensor, location) in enumerate(zip(model.graph.initializer, ("weights.bin", second_location))):
        tensor.ClearField("raw_data")
        tensor.data_location = TensorProto.EXTERNAL
        for key, value in (("location", location), ("offset", str(index * WEIGHT.nbytes)),
                           ("length", str(WEIGHT.nbytes))):
            tensor.external_data.add(key=key, value=value)
    folder = tmp_path / "model"
    folder.mkdir(parents=True)
    (folder / "weights.bin").write_bytes(WEIGHT.tobytes() + (WEIGHT * 2).tobytes())
    (tmp_path / "outside.bin").write_bytes(WEIGHT.tobytes() * 2)
    path = folder / "model.onnx"
    path.write_bytes(model.SerializeToString())
    return path


def test_tensors_of_one_external_file_check_its_path_once_and_each_other_file_its_own(tmp_path, monkeypatch):
    from runnx.interp import external_data
    checked = []
    original = external_data.confined_path
    monkeypatch.setattr(external_data, "confined_path", lambda *a: checked.append(a[1]) or original(*a))
    model = runnx.load(_two_external(tmp_path, "weights.bin"))
    assert checked == ["weights.bin"]
    np.testing.assert_array_equal(model.run({"x": np.ones((3, 4), np.float32)})["y"], WEIGHT * 3 + 1)
    with pytest.raises(runnx.ExternalDataError, match="tensor 'v'.*escapes the model folder"):
        runnx.load(_two_external(tmp_path / "second", "../outside.bin"))


def test_safetensors_weights_override_initializers_zero_copy(tmp_path):
    weights = tmp_path / "w.safetensors"
    safetensors.numpy.save_file({"w": np.full((3, 4), 7, np.float32)}, weights)
    model = runnx.load(_proto(), weights=weights)
    constant = model.graph.constants[model.graph.ids["w"]]
    assert _reaches_mmap(constant)
    np.testing.assert_array_equal(model.run({"x": np.ones((3, 4), np.float32)})["y"], np.full((3, 4), 8))


def test_weights_naming_tensors_the_model_does_not_have_are_refused(tmp_path):
    weights = tmp_path / "w.safetensors"
    safetensors.numpy.save_file({"w": WEIGHT, "other": WEIGHT}, weights)
    with pytest.raises(runnx.InvalidModelError, match="other"):
        runnx.load(_proto(), weights=weights)


def _safetensors_bytes(header, body=b""):
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + body


@pytest.mark.parametrize("content, message", [
    (b"abc", "too short"),
    (struct.pack("<Q", 10**9) + b"{}", "exceeds the file"),
    (struct.pack("<Q", 4) + b"\xff\xfe{]", "not valid JSON"),
    (_safetensors_bytes([1, 2]), "not a JSON object"),
    (_safetensors_bytes({"w": {"dtype": "F32", "shape": [3, 4], "data_offsets": [0, 48]}}, b"\0" * 40),
     "does not match its byte range"),
    (_safetensors_bytes({"w": {"dtype": "F32", "shape": [3, 4], "data_offsets": [0, 40]}}, b"\0" * 48),
     "does not match its byte range"),
    (_safetensors_bytes({"w": {"dtype": "F32", "shape": [-3, -4], "data_offsets": [0, 48]}}, b"\0" * 48),
     "does not match its byte range"),
    (_safetensors_bytes({"w": {"dtype": "F32", "shape": [3, 4], "data_offsets": [8, 4]}}, b"\0" * 48),
     "does not match its byte range"),
    (_safetensors_bytes({"w": {"dtype": "X99", "shape": [3, 4], "data_offsets": [0, 48]}}, b"\0" * 48),
     "malformed or unsupported"),
    (_safetensors_bytes({"w": {"shape": [3, 4]}}), "malformed or unsupported"),
    (_safetensors_bytes({"w": "F32"}), "malformed or unsupported"),
])
def test_malformed_safetensors_headers_are_refused(tmp_path, content, message):
    weights = tmp_path / "bad.safetensors"
    weights.write_bytes(content)
    with pytest.raises(runnx.ExternalDataError, match=message):
        runnx.load(_proto(), weights=weights)


def test_missing_weights_file_is_refused(tmp_path):
    with pytest.raises(runnx.ExternalDataError, match="cannot open"):
        runnx.load(_proto(), weights=tmp_path / "none.safetensors")


def test_one_error_lists_every_unsupported_op_with_its_nodes():
    nodes = [helper.make_node("NoSuchOp", ["x"], ["a"], name="first"),
             helper.make_node("NoSuchOp", ["a"], ["b"], name="second"),
             helper.make_node("OtherOp", ["b", "w"], ["c"], name="third", domain="com.example"),
             helper.make_node("Add", ["c", "w"], ["y"], name="add")]
    model = _proto(nodes=nodes)
    model.opset_import.append(helper.make_opsetid("com.example", 3))
    with pytest.raises(runnx.UnsupportedOpError) as caught:
        runnx.load(model)
    message = str(caught.value)
    assert "ai.onnx::NoSuchOp at opset 18: nodes 'first', 'second'" in message
    assert "com.example::OtherOp at opset 3: nodes 'third'" in message
    assert "Add" not in message


def test_unsupported_op_version_says_where_runnx_starts():
    first = registry.known_versions("", "Add")[0]
    model = _proto()
    model.opset_import[0].version = first - 1
    with pytest.raises(runnx.UnsupportedOpError,
                       match=rf"Add at opset {first - 1} \(runnx has it from opset {first}\): nodes 'add'"):
        runnx.load(model)


def test_model_files_and_bytes_that_are_not_onnx_are_refused(tmp_path):
    with pytest.raises(runnx.ModelLoadError, match="not found"):
        runnx.load(tmp_path / "missing.onnx")
    (tmp_path / "junk.onnx").write_bytes(b"\xff" * 64)
    with pytest.raises(runnx.ModelLoadError, match="junk.onnx"):
        runnx.load(tmp_path / "junk.onnx")
    with pytest.raises(runnx.ModelLoadError, match="not an ONNX model"):
        runnx.load(b"\x0a\xff\xff\xff\xff\x0f")


def test_an_empty_file_or_bytes_are_refused_as_having_no_graph(tmp_path):
    (tmp_path / "empty.onnx").write_bytes(b"")
    with pytest.raises(runnx.ModelLoadError, match=r"empty.onnx' \(0 bytes\) has no graph"):
        runnx.load(tmp_path / "empty.onnx")
    with pytest.raises(runnx.ModelLoadError, match=r"the bytes given \(0\) has no graph"):
        runnx.load(b"")
    with pytest.raises(runnx.ModelLoadError, match="has no graph"):
        runnx.InferenceSession(b"")


@pytest.mark.parametrize("domain, offset", [("", 1), ("", 71), ("ai.onnx.ml", 1)])
def test_a_domain_imported_past_the_newest_opset_runnx_knows_is_refused_unless_allowed(domain, offset, monkeypatch):
    newest = registry.newest_opset(domain)
    model = _proto()
    if domain:
        model.opset_import.append(helper.make_opsetid(domain, newest + offset))
    else:
        model.opset_import[0].version = newest + offset
    shown = domain or "ai.onnx"
    with pytest.raises(runnx.UnsupportedOpsetError,
                       match=rf"imports {shown} opset {newest + offset}, but runnx supports it up to opset {newest} "
                             r"\(allow_newer_opset=True or RUNNX_ALLOW_NEWER_OPSET=1"):
        runnx.load(model)
    x = np.ones((3, 4), np.float32)
    np.testing.assert_array_equal(runnx.load(model, allow_newer_opset=True).run({"x": x})["y"], x + WEIGHT)
    monkeypatch.setenv("RUNNX_ALLOW_NEWER_OPSET", "1")
    np.testing.assert_array_equal(runnx.load(model).run({"x": x})["y"], x + WEIGHT)


def test_the_newest_opsets_are_those_of_the_kernels_and_other_domains_are_left_to_the_op_check():
    assert registry.newest_opset("") == registry.newest_opset("ai.onnx") == max(
        since for domain, _, versions in registry.all_ops() if domain == "" for since in versions)
    assert registry.newest_opset("com.example") is None
    model = _proto()
    model.opset_import.append(helper.make_opsetid("com.example", 1000))  # imported, not used
    assert runnx.load(model).run({"x": np.zeros((3, 4), np.float32)})["y"].tolist() == WEIGHT.tolist()


@pytest.mark.parametrize("location", ["w\0.bin", "."])
def test_external_data_paths_that_are_not_plain_file_names_are_refused(tmp_path, location):
    with pytest.raises(runnx.ExternalDataError, match="tensor 'w'"):
        runnx.load(_external(tmp_path, location, payload=None))



def test_a_model_loads_after_one_op_module_was_imported_on_its_own(tmp_path):
    """The opset check asks for every op family: a process that imported one op module first (to
    call a kernel) had registered that module's kernels only, and its first model was refused as
    'opset 18, but runnx supports it up to opset 1'."""
    import subprocess
    import sys

    path = tmp_path / "model.onnx"
    path.write_bytes(_proto().SerializeToString())
    code = ("import runnx.ops.contrib_normalization, runnx, numpy as np; "
            f"print(runnx.load({str(path)!r}).run({{'x': np.zeros((3, 4), np.float32)}})['y'].sum())")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert float(done.stdout) == WEIGHT.sum()


@pytest.mark.parametrize("enabled", [True, False])
def test_a_load_pauses_the_garbage_collector_and_leaves_it_as_it_found_it(fixtures_dir, enabled, monkeypatch):
    """The cyclic collector is off while a model loads (its full collections went through every
    object again and again), and after a load, or a failed one, on or off as the caller had it."""
    import gc

    from runnx.interp import loader

    seen = []
    load_model = loader.load_model
    monkeypatch.setattr(loader, "load_model", lambda *a: (seen.append(gc.isenabled()), load_model(*a))[1])
    was = gc.isenabled()
    try:
        (gc.enable if enabled else gc.disable)()
        runnx.load(str(fixtures_dir / "tiny-llama" / "model.onnx"))
        assert gc.isenabled() == enabled
        with pytest.raises(runnx.RunnxError):
            runnx.load(b"not a model")
        assert gc.isenabled() == enabled
    finally:
        (gc.enable if was else gc.disable)()
    assert seen == [False, False]


def _resident_kib(address: int) -> int:
    """This process's resident KiB of the map holding `address` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and not fields[0].endswith(":"):
                start, stop = (int(x, 16) for x in fields[0].split("-"))
                inside = start <= address < stop
            elif inside and fields[0] == "Rss:":
                return int(fields[1])
    raise AssertionError("no map holds the address")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/smaps: Linux")
def test_a_mapped_tensors_pages_go_back_to_its_file_and_read_the_same_again(tmp_path):
    """`release_pages` hands back the pages wholly inside a tensor mapped from a file (its kernel's
    copy, a 4-bit weight's tiles, holds what it needs): they leave the process's memory, and reading
    the tensor again gives its bytes from the file. Memory holding the only copy (an anonymous map,
    numpy's own) is never handed back."""
    from runnx.interp import external_data

    payload = np.random.default_rng(5).integers(0, 256, 3 << 20, dtype=np.uint8)
    (tmp_path / "data.bin").write_bytes(payload.tobytes())
    data = external_data._map_file(str(tmp_path / "data.bin"))
    tensor = np.frombuffer(memoryview(data)[1000:1000 + (2 << 20)], np.uint8)
    assert int(tensor.sum()) == int(payload[1000:1000 + (2 << 20)].sum())  # (its pages read in)
    address = tensor.__array_interface__["data"][0]
    before = _resident_kib(address)
    released = external_data.release_pages(tensor)
    assert released == (2 << 20) - mmap.PAGESIZE  # the pages wholly inside it
    assert _resident_kib(address) <= before - released // 1024
    np.testing.assert_array_equal(tensor, payload[1000:1000 + (2 << 20)])
    anonymous = np.frombuffer(mmap.mmap(-1, 1 << 20), np.uint8)
    anonymous[:] = payload[:1 << 20]
    own = payload.copy()
    assert external_data.release_pages(anonymous) == 0 and external_data.release_pages(own) == 0
    np.testing.assert_array_equal(anonymous, payload[:1 << 20])
    np.testing.assert_array_equal(own, payload)
