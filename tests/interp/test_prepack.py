"""Kernels' state made ahead from constant inputs (`Model.prepack_in_background`, `register(prepack=)`):
what a first few-row run would make (a 4-bit weight's tiles, joined or alone; an 8-bit weight's VNNI
tiles) is made on a thread of its own, kept as the run keeps it, made once when a run asks for it
meanwhile, and the outputs are bitwise those of a model that made it in its run; what a prepack
cannot make is left to the run, which refuses it."""
import sys
import threading
import time

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import runnx
from runnx.errors import RunnxError
from runnx.generate.decoder import DecoderStep, load_decoder
from runnx.ops import _kernels_vnni as vnni, contrib_quantized, linalg_integer, nibble_tiles
from runnx.ops._kernels_nibble_layout import MADE, REFUSED, TILE_COUNT, repack
from tests.interp.test_loader import _resident_kib

F = TensorProto.FLOAT
MS = "com.microsoft"
RNG = np.random.default_rng(5)
K, BLOCK = 96, 32


def _nbits(N, blocks=(K + BLOCK - 1) // BLOCK):
    return (RNG.integers(0, 256, (N, blocks, BLOCK // 2), dtype=np.uint8),
            (RNG.random((N, blocks)) * 0.1 + 0.01).astype(np.float32),
            RNG.integers(0, 256, (N, (blocks + 1) // 2), dtype=np.uint8))


def _model(b_shape_wrong=False, integer=False):
    """x -> three 4-bit products of x (one SharedInputMatMulNBits after fusion), and a 4-bit
    product of the first one's output (a MatMulNBits alone); integer: also y0 quantized
    (DynamicQuantizeLinear) times a constant int8 matrix (MatMulInteger)."""
    nodes, constants, outputs = [], {}, []
    for i, (source, N) in enumerate((("x", 48), ("x", 32), ("x", 32), ("y0", 40))):
        depth = 48 if source == "y0" else K
        b, scales, zeros = _nbits(N, (depth + BLOCK - 1) // BLOCK)
        if b_shape_wrong and i == 3:
            b = b[:, :1]
        constants.update({f"b{i}": b, f"s{i}": scales, f"z{i}": zeros})
        nodes.append(helper.make_node("MatMulNBits", [source, f"b{i}", f"s{i}", f"z{i}"], [f"y{i}"], domain=MS,
                                      K=depth, N=N, bits=4, block_size=BLOCK))
        outputs.append(f"y{i}")
    if integer:
        constants["w8"] = RNG.integers(-128, 128, (48, 24), dtype=np.int8)
        nodes += [helper.make_node("DynamicQuantizeLinear", ["y0"], ["q", "q_scale", "q_zero"]),
                  helper.make_node("MatMulInteger", ["q", "w8", "q_zero"], ["i8"])]
        outputs.append("i8")
    graph = helper.make_graph(nodes, "products", [helper.make_tensor_value_info("x", F, None)],
                              [helper.make_tensor_value_info(n, TensorProto.UNDEFINED, None) for n in outputs],
                              [numpy_helper.from_array(v, k) for k, v in constants.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(MS, 1)],
                             ir_version=10).SerializeToString()


@pytest.fixture
def made(monkeypatch):
    """Every computation of 4-bit tiles (joined or alone) and VNNI tiles, by thread and weight: a run's
    own (the `Remembered`'s function), a run's share of a prepack's (`join`), or a prepack's kept."""
    calls = []
    for remembered in (nibble_tiles.remembered_tiles, nibble_tiles.joined_four_bit_tiles,
                       linalg_integer._vnni_weights):
        def counted(values, *arrays, original=remembered.fn, kind=remembered):
            calls.append((threading.current_thread().name, kind, id(arrays[0])))
            return original(values, *arrays)
        monkeypatch.setattr(remembered, "fn", counted)
    keep, join = nibble_tiles._PendingTiles.keep, nibble_tiles._PendingTiles.join

    def kept(pending):
        if keep(pending):
            calls.append((threading.current_thread().name, pending.remembered, id(pending.arrays[0])))
            return True
        return False

    def joined(pending):
        result = join(pending)
        if result is not None:
            calls.append((threading.current_thread().name, pending.remembered, id(pending.arrays[0])))
        return result
    monkeypatch.setattr(nibble_tiles._PendingTiles, "keep", kept)
    monkeypatch.setattr(nibble_tiles._PendingTiles, "join", joined)
    return calls


@pytest.fixture
def listings(monkeypatch):
    """The native calls making listed tiles: (thread, first, count, maker, states) of each that makes
    any (a prepack's first call, with no items, only loads the kernel)."""
    calls = []
    native = nibble_tiles.repack_listed

    def listed(sources, table, arena, states, first, count, maker):
        if count:
            calls.append((threading.current_thread().name, first, count, maker, states))
        return native(sources, table, arena, states, first, count, maker)
    monkeypatch.setattr(nibble_tiles, "repack_listed", listed)
    return calls


def _from_file(tmp_path, model_bytes: bytes):
    """The model loaded from a file, as models are: its weights side by side in the load's arena
    (from bytes, each is an array of its own, a prepack listing each apart)."""
    path = tmp_path / "model.onnx"
    path.write_bytes(model_bytes)
    return runnx.load(str(path))


def _kinds(model) -> list[str]:
    return sorted(node.op_type for node in model.graph.nodes)


def test_prepack_makes_what_a_first_run_would_and_the_run_makes_nothing(made, listings, tmp_path):
    """... and its 4-bit tiles in one native call for all the weights (`repack_listed`: no GIL
    needed until all are made), where a run makes each weight's alone."""
    model_bytes = _model(integer=vnni.AVAILABLE)
    x = RNG.standard_normal((1, 3, K)).astype(np.float32)
    reference = runnx.load(model_bytes).run({"x": x})  # its run makes its own tiles
    made.clear()
    model = _from_file(tmp_path, model_bytes)
    assert {"SharedInputMatMulNBits", "MatMulNBits"} <= set(_kinds(model))
    thread = model.prepack_in_background()
    thread.join()
    assert thread.name == "runnx-prepack"
    expected = 2 + vnni.AVAILABLE  # the joined tiles of x's products, y0's product's, the int8 weight's
    assert len(made) == expected and {name for name, _, _ in made} == {"runnx-prepack"}
    # four parts (three joined, one alone) in one call, each made by the prepack
    (name, first, count, maker, states), = listings
    assert (name, first, count, maker) == ("runnx-prepack", 0, 4, nibble_tiles.PREPACK)
    assert list(states) == [nibble_tiles.PREPACK + MADE] * 4
    made.clear()
    outputs = model.run({"x": x})
    assert made == []  # the run found all of it made
    for name, value in reference.items():
        assert np.array_equal(outputs[name], value), name


def test_the_tiles_lie_in_a_map_of_their_own_faulted_in_while_the_prepack_plans(listings, monkeypatch, tmp_path):
    """The tiles' arena is not numpy's (which advises a buffer of 4 MiB and more for huge pages, which
    a virtual machine's host may back at its own pace: a first prompt waited for them) but a fresh
    map faulted in by the weights' policy (`model_file.fault_in`) on the prepacking thread, before
    any tile is written and before `prepack_in_background` returns (the policy's Python between its
    calls would wait for the GIL a tokenizer's load holds)."""
    import mmap

    from runnx.interp import model_file
    from runnx.ops import _tile_listing

    faulted = []
    original = model_file.fault_in

    def recorded(arena):
        faulted.append((threading.current_thread().name, arena, len(listings)))
        return original(arena)
    monkeypatch.setattr(_tile_listing, "fault_in", recorded)
    model_bytes = _model()
    model = _from_file(tmp_path, model_bytes)
    thread = model.prepack_in_background()
    (name, arena, listed_before), = faulted  # (already)
    thread.join()
    assert name == "runnx-prepack" and listed_before == 0
    assert isinstance(arena.base.obj, mmap.mmap)
    (_, _, _, _, states), = listings
    assert list(states) == [nibble_tiles.PREPACK + MADE] * 4
    x = RNG.standard_normal((1, 1, K)).astype(np.float32)
    reference = runnx.load(model_bytes).run({"x": x})
    for key, value in model.run({"x": x}).items():
        assert np.array_equal(value, reference[key]), key


def test_a_node_with_several_weights_has_each_prepacked(made, listings, tmp_path):
    """A 4-bit gated MLP after its output projection (GatedMLPNBits: its gate and up weights joined,
    its down weight alone; the projection's MatMulNBits): all made by the prepack in its one call,
    none by the run, the outputs the same bits."""
    from test_fusion_nbits_products import _gated_mlp_model

    model_bytes = _gated_mlp_model("skip", "packed", projected=96).SerializeToString()
    feeds = {"a": RNG.standard_normal((1, 1, 64)).astype(np.float32),
             "x": RNG.standard_normal((1, 1, 96)).astype(np.float32)}
    reference = runnx.load(model_bytes).run(feeds)
    made.clear()
    model = _from_file(tmp_path, model_bytes)
    assert _kinds(model) == ["GatedMLPNBits", "MatMulNBits"]
    model.prepack_in_background().join()
    assert sorted(kind is nibble_tiles.joined_four_bit_tiles for _, kind, _ in made) == [False, False, True]
    assert {name for name, _, _ in made} == {"runnx-prepack"}
    (_, _, count, _, states), = listings
    assert count == 4 and list(states) == [nibble_tiles.PREPACK + MADE] * 4
    made.clear()
    outputs = model.run(feeds)
    assert made == []
    for name, value in reference.items():
        assert np.array_equal(outputs[name], value), name


def test_a_run_beside_the_prepack_shares_its_items_and_makes_none_twice(made, listings, monkeypatch, tmp_path):
    """The run reaches the weights before the prepack's native call begins (held back here): it
    makes their items itself through the prepack's listing (`join`), which then finds them made
    and makes none again; each weight is kept once, the outputs the same bits."""
    model_bytes = _model()
    x = RNG.standard_normal((1, 1, K)).astype(np.float32)
    reference = runnx.load(model_bytes).run({"x": x})
    made.clear()
    model = _from_file(tmp_path, model_bytes)
    listed = nibble_tiles.repack_listed

    def held_back(*args):
        if threading.current_thread().name == "runnx-prepack" and args[5]:
            time.sleep(0.2)
        return listed(*args)

    monkeypatch.setattr(nibble_tiles, "repack_listed", held_back)
    thread = model.prepack_in_background()
    outputs = model.run({"x": x})
    thread.join()
    assert len({weight for _, _, weight in made}) == len(made) == 2
    assert all(name == "MainThread" for name, _, _ in made)  # the run's joins, no prepack keeps
    runs = [call for call in listings if call[0] == "MainThread"]
    assert [count for _, _, count, _, _ in runs] == [3, 1]  # the joined weight's three parts, then y0's
    states = listings[-1][4]
    assert list(states) == [nibble_tiles.RUN + MADE] * 4  # none made by the prepack
    for name, value in reference.items():
        assert np.array_equal(outputs[name], value), name


def test_the_prepack_makes_its_tiles_while_another_thread_holds_the_gil(listings, tmp_path):
    """`prepack_in_background` returns once the prepack is planned; its native call then needs no
    GIL: a caller holding the GIL next (here a C loop; in the generation API a tokenizer loading)
    finds every item made when it lets go."""
    model = _from_file(tmp_path, _model())
    thread = model.prepack_in_background()
    sum(range(20_000_000))  # C code holding the GIL throughout (no bytecode between)
    states = listings[0][4].copy()
    thread.join()
    assert list(states) == [nibble_tiles.PREPACK + MADE] * 4


def test_a_run_waits_for_the_items_another_thread_is_making():
    """`join` makes what nobody has claimed and waits for what another thread is making; a repack
    that raises leaves the run to make the weight alone (None)."""
    b, scales, zeros = _nbits(48)
    for array in (b, scales, zeros):
        array.flags.writeable = False
    attrs = {"K": K, "N": 48, "bits": 4, "block_size": BLOCK}
    pending = nibble_tiles.prepack_tiles((None, b, scales, zeros), attrs)
    nibble_tiles._PendingTiles.batch([pending])
    states = pending.listing[3]
    states[0] = nibble_tiles.PREPACK  # claimed by the prepacking thread, not made yet
    result = []
    waiting = threading.Thread(target=lambda: result.append(pending.join()))
    waiting.start()
    waiting.join(0.1)
    assert waiting.is_alive()
    repack(*pending.items[0])  # the other thread's work, then its mark
    states[0] = nibble_tiles.PREPACK + MADE
    waiting.join(10)
    expected = nibble_tiles._nibble_tiles((), b, scales, zeros)
    assert all(np.array_equal(made, want) for made, want in zip(result[0], expected))
    nibble_tiles.remembered_tiles.withdraw((), (b, scales, zeros))

    refused = nibble_tiles.prepack_tiles((None, *_nbits(48)), attrs)
    nibble_tiles._PendingTiles.batch([refused])
    refused.listing[1][0, TILE_COUNT] = 1  # tiles for 16 of the 48 columns: repack raises
    assert refused.join() is None
    assert refused.listing[3][0] == nibble_tiles.RUN + REFUSED
    refused.remembered.withdraw(refused.values, refused.arrays)


def test_what_a_prepack_cannot_make_is_left_to_the_run_which_refuses_it(made):
    model = runnx.load(_model(b_shape_wrong=True))
    model.prepack_in_background().join()  # nothing raised on its thread
    assert [kind for _, kind, _ in made] == [nibble_tiles.joined_four_bit_tiles]
    with pytest.raises(RunnxError, match="B must be uint8 of shape"):
        model.run({"x": RNG.standard_normal((1, 1, K)).astype(np.float32)})


def test_a_model_with_nothing_to_prepack_starts_no_thread():
    value = [helper.make_tensor_value_info("x", F, None)], [helper.make_tensor_value_info("y", F, None)]
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", *value)
    model = runnx.load(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10))
    assert model.prepack_in_background() is None


def test_a_decoder_step_prepacks_each_of_its_models_once(monkeypatch, fixtures_dir):
    started = []
    monkeypatch.setattr(runnx.interp.model.Model, "prepack_in_background", lambda self: started.append(self))
    folder = fixtures_dir / "tiny-llama-merged"
    first, later = (load_decoder(str(folder / name)) for name in ("decoder_model.onnx", "decoder_with_past_model.onnx"))
    DecoderStep(first, later)
    assert started == [first, later]
    started.clear()
    merged = load_decoder(str(folder / "decoder_model_merged.onnx"))
    DecoderStep(merged)
    assert started == [merged]


def test_a_decoder_step_waits_for_its_prepacking_when_asked(monkeypatch, fixtures_dir):
    """`wait_prepared` returns once every prepack thread of the decoder's models has ended: False
    while one still runs past the timeout, True after."""
    release = threading.Event()

    def prepacking(self):
        thread = threading.Thread(target=release.wait, name="runnx-prepack")
        thread.start()
        return thread

    monkeypatch.setattr(runnx.interp.model.Model, "prepack_in_background", prepacking)
    decoder = DecoderStep(load_decoder(str(fixtures_dir / "tiny-llama-merged" / "decoder_model_merged.onnx")))
    try:
        assert not decoder.wait_prepared(timeout=0.05)
    finally:
        release.set()
    assert decoder.wait_prepared(timeout=10)
    monkeypatch.setattr(runnx.interp.model.Model, "prepack_in_background", lambda self: None)
    assert DecoderStep(load_decoder(str(fixtures_dir / "tiny-llama-merged" / "decoder_model_merged.onnx"))
                       ).wait_prepared(timeout=0)  # nothing to prepack


def test_a_real_int4_decoder_finds_every_weight_prepacked(smollm2_genai_int4_dir, made, monkeypatch):
    """onnxruntime-genai's int4 SmolLM2 through the generation API: the prepack thread makes the
    tiles of every 4-bit product (q/k/v; o; gate/up joined and down in a GatedMLPNBits; the LM
    head), so its first prompt makes none, and its greedy token is the one the prompt gives without
    a prepack."""
    decoder = DecoderStep.from_folder(smollm2_genai_int4_dir, capacity=64)
    assert decoder.wait_prepared()
    kinds = [node.op_type for node in decoder.past_model.graph.nodes]
    assert kinds.count("GatedMLPNBits") == 30
    assert len(made) == kinds.count("MatMulNBits") + 2 * kinds.count("GatedMLPNBits") > 30 * 4
    made.clear()
    prompt = np.arange(1000, 1032, dtype=np.int64)[None]
    token = int(decoder.step(prompt)[0, -1].argmax())
    assert made == []
    monkeypatch.setattr(runnx.interp.model.Model, "prepack_in_background", lambda self: None)
    fresh = DecoderStep.from_folder(smollm2_genai_int4_dir, capacity=64)  # its first prompt makes its own
    assert int(fresh.step(prompt)[0, -1].argmax()) == token
    assert len(made) > 30 * 4


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/smaps: Linux")
@pytest.mark.parametrize("prepacked", [True, False])
def test_a_folders_4_bit_weights_leave_memory_once_their_tiles_are_made(prepacked, listings, monkeypatch, tmp_path):
    """A 4-bit model whose weights lie in a data file (memory-mapped, as onnxruntime-genai's folders
    have them): as the prepack makes each weight's tiles, in its one native call, the weight's own
    pages go back to the file (`repack_listed`'s HAND_BACK; checked here without the hand-back that
    follows keeping them), or, tiles made by a first run, once they are kept (`_release_weights`);
    neither a prompt (its panels come from the tiles) nor a decode row reads them again; the
    outputs are the bits of the same model whose weights stay in memory (loaded from bytes: the
    load's arena, whose pages never go back)."""
    import onnx

    depth, rows = 512, contrib_quantized.TILED_ROWS + 36
    nodes, constants = [], {}
    for i, N in enumerate((512, 256, 384)):  # two products of x (joined tiles) and one of y0
        source = "x" if i < 2 else "y0"
        constants.update(zip((f"b{i}", f"s{i}", f"z{i}"), _nbits(N, depth // BLOCK)))
        nodes.append(helper.make_node("MatMulNBits", [source, f"b{i}", f"s{i}", f"z{i}"], [f"y{i}"], domain=MS,
                                      K=depth, N=N, bits=4, block_size=BLOCK))
    graph = helper.make_graph(nodes, "products", [helper.make_tensor_value_info("x", F, None)],
                              [helper.make_tensor_value_info(f"y{i}", F, None) for i in (1, 2)],
                              [numpy_helper.from_array(v, k) for k, v in constants.items()])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(MS, 1)],
                              ir_version=10)
    in_memory = runnx.load(proto.SerializeToString())
    in_memory.prepack_in_background().join()
    listings.clear()
    onnx.save(proto, str(tmp_path / "model.onnx"), save_as_external_data=True, location="model.onnx.data",
              size_threshold=0)
    model = runnx.load(str(tmp_path / "model.onnx"))
    assert "SharedInputMatMulNBits" in _kinds(model)
    if prepacked:
        for remembered in (nibble_tiles.remembered_tiles, nibble_tiles.joined_four_bit_tiles):
            monkeypatch.setattr(remembered, "kept", None)
        model.prepack_in_background().join()
        assert [count for _, _, count, _, _ in listings] == [3]  # (the file's weights in one call)
    else:
        model.run({"x": RNG.standard_normal((1, 1, depth)).astype(np.float32)})
    weight = model.graph.constants[model.graph.ids["b0"]]
    data = (tmp_path / "model.onnx.data").stat().st_size
    resident = _resident_kib(weight.__array_interface__["data"][0])
    assert resident * 1024 < data // 8  # (scales and the page at each tensor's ends may stay)
    for length in (rows, 1):
        x = RNG.standard_normal((1, length, depth)).astype(np.float32)
        expected = in_memory.run({"x": x})
        for name, value in model.run({"x": x}).items():
            np.testing.assert_array_equal(value, expected[name])
    assert _resident_kib(weight.__array_interface__["data"][0]) <= resident + 8
