"""Outputs for the last position only (Options.last_position): an LM head by a constant matrix, in
the graph or in the branches of a merged decoder's If, reads the last position; the logits equal
the last row of the whole computation's; other outputs stay as they are."""
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import runnx
from runnx.generate.decoder import DecoderStep, load_decoder


@pytest.mark.parametrize("folder, model, rewritten", [("tiny-llama", "model.onnx", 1),
                                                  ("tiny-llama-merged", "decoder_model_merged.onnx", 2),
                                                  ("tiny-whisper", "decoder_model_merged.onnx", 2),
                                                  ("tiny-gpt2", "model.onnx", 1)])
def test_decoders_compute_the_last_positions_logits(fixtures_dir, folder, model, rewritten):
    path = fixtures_dir / folder / model
    last, every = load_decoder(path), runnx.load(path, check_symbolic_dims=False)
    assert last.last_position == rewritten and every.last_position == 0
    steps = [DecoderStep(m, capacity=16, config=_config(fixtures_dir / folder)) for m in (last, every)]
    if folder == "tiny-whisper":
        hidden = np.random.default_rng(0).standard_normal((1, 30, _hidden_size(every))).astype(np.float32)
        for step in steps:
            step.reset(fixed_feeds={"encoder_hidden_states": hidden})
    for ids in ([[3, 7, 11, 2, 5]], [[9]], [[4, 6]]):  # prefill (the first branch), then steps with a past
        got, want = (step.step(np.array(ids)) for step in steps)
        assert got.shape == want.shape[:1] + (1,) + want.shape[2:] and want.shape[1] == len(ids[0])
        np.testing.assert_allclose(got, want[:, -1:], rtol=1e-5, atol=1e-6)


def test_outputs_computed_otherwise_are_left_alone():
    nodes = [helper.make_node("Add", ["x", "y"], ["logits"]), helper.make_node("MatMul", ["x", "y"], ["other"]),
             helper.make_node("MatMul", ["x", "w"], ["read"]), helper.make_node("Softmax", ["read"], ["softmax"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 3, 3])
                                           for n in ("x", "y")],
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 3, 3])
                               for n in ("logits", "other", "read", "softmax")],
                              [numpy_helper.from_array(np.eye(3, dtype=np.float32), "w")])
    model = runnx.load(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]),
                       last_position=("logits", "other", "read", "absent"))
    # an Add; a MatMul by an input, not a constant; one read by another node; no such output
    assert model.last_position == 0
    x = np.ones((2, 3, 3), np.float32)
    assert model.run({"x": x, "y": x})["logits"].shape == (2, 3, 3)


def _config(folder):
    import json
    return json.loads((folder / "config.json").read_text())


def _hidden_size(model):
    shape = next(i.shape for i in model.inputs if i.name == "encoder_hidden_states")
    return shape[2]


def test_only_the_option_names_outputs_the_environment_is_ignored_with_a_warning(fixtures_dir, monkeypatch):
    from runnx.interp import options
    monkeypatch.setattr(options, "_warned", set())
    monkeypatch.setenv("RUNNX_LAST_POSITION", "logits")
    with pytest.warns(UserWarning, match=r"runnx ignores RUNNX_LAST_POSITION: runnx.load\(\.\.\., last_position="):
        assert runnx.load(fixtures_dir / "tiny-llama" / "model.onnx").last_position == 0
    assert runnx.load(fixtures_dir / "tiny-llama" / "model.onnx", last_position=("logits",)).last_position == 1


@pytest.mark.parametrize("op, inputs, attributes", [
    ("MatMulNBits", ("b", "scales", "zeros"), dict(K=64, N=40, bits=4, block_size=32)),
    ("MatMulBnb4", ("b", "absmax"), dict(K=64, N=40, block_size=32, quant_type=1))])
def test_a_block_quantized_head_computes_the_last_position(op, inputs, attributes):
    """onnxruntime-genai's int4 exports (MatMulNBits) and transformers.js's bnb4 ones end in a
    block-quantized LM head: it reads the last position too, with the same logits."""
    rng = np.random.default_rng(4)
    constants = {"b": rng.integers(0, 256, (40, 2, 16), dtype=np.uint8) if op == "MatMulNBits"
                 else rng.integers(0, 256, 40 * 64 // 2, dtype=np.uint8),
                 "scales": (rng.random(80) * 0.1).astype(np.float32),
                 "zeros": rng.integers(0, 256, 40, dtype=np.uint8),
                 "absmax": (rng.random(40 * 64 // 32) + 0.5).astype(np.float32)}
    node = helper.make_node(op, ["h", *inputs], ["logits"], domain="com.microsoft", **attributes)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("h", TensorProto.FLOAT, [1, "s", 64])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, "s", 40])],
                              [numpy_helper.from_array(constants[name], name) for name in inputs])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)])
    last, every = runnx.load(model, last_position=("logits",)), runnx.load(model)
    assert last.last_position == 1
    h = rng.standard_normal((1, 7, 64)).astype(np.float32)
    got, want = last.run({"h": h})["logits"], every.run({"h": h})["logits"]
    assert got.shape == (1, 1, 40)
    np.testing.assert_allclose(got, want[:, -1:], rtol=1e-5, atol=1e-6)
