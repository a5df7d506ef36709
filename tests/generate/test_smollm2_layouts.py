"""Real SmolLM2-135M in the two downloaded layouts (built by `make models`; marked real_model
through their fixtures):

- onnxruntime-genai's builder folders (fp32; int4 with fp32 products; fp32 of its weights as Qwen2 and
  Phi-3): greedy ids equal
  onnxruntime-genai's own, recorded at build time in genai_reference.json on chat prompts, with the
  KV buffer shared between past and present as genai_config.json says and growing in place;
- the transformers.js layout: each variant chosen by `variant=` greedy-decodes as onnxruntime
  does on the same file (fp16 included: float16 weights, KV cache and logits; q4f16: MatMulNBits
  with float16 scales; bnb4: MatMulBnb4's NF4 codes)."""
from __future__ import annotations

import json

import numpy as np
import pytest

import runnx
from runnx.generate.chat import Chat
from runnx.generate.generator import Generator
from runnx.generate.layouts import read_folder

from generate_reference import ort_greedy


def _reference(folder) -> dict:
    return json.loads((folder / "genai_reference.json").read_text())


@pytest.fixture(scope="module", params=["smollm2_genai_fp32", "smollm2_genai_int4", "qwen2_genai_fp32",
                                        "phi3_genai_fp32", "qwen2_genai_int4", "phi3_genai_int4"])
def genai_folder(request):
    """onnxruntime-genai's builds of SmolLM2 and of its weights as Qwen2 and Phi-3, fp32 and int4
    (whose layers the same fused blocks take: their greedy ids equal too)."""
    return request.getfixturevalue(f"{request.param}_dir")


@pytest.mark.parametrize("share_buffer", [True, False], ids=["shared-buffer", "growing-buffer"])
def test_genai_folder_greedy_equals_onnxruntime_genai(genai_folder, share_buffer):
    profile = runnx.Profile()
    generator = Generator.from_folder(genai_folder, profile=profile, share_buffer=share_buffer)
    assert generator.decoder.share_buffer is share_buffer  # genai_config.json says true
    reference = _reference(genai_folder)
    assert len(reference["runs"]) >= 3
    for run in reference["runs"]:
        chat = Chat(generator)  # the chat template of the builder's chat_template.jinja
        assert chat.render([{"role": "user", "content": run["message"]}]) == run["text"]
        chat.ask(run["message"], max_new_tokens=reference["max_new_tokens"])
        assert generator.token_ids[0, :len(run["prompt_ids"])].tolist() == run["prompt_ids"]
        assert generator.generated[0] == run["new_ids"], run["message"]
        assert generator.decoder.cache.appended_in_place and generator.decoder.cache.regrowths == 0
    counter = "GroupQueryAttention.writes_in_place" if share_buffer else "GroupQueryAttention.appends_in_place"
    steps = sum(len(run["new_ids"]) for run in reference["runs"])
    assert profile.counters[counter] == 2 * 30 * steps  # key and value in 30 layers, each run (the last token never runs)
    assert reference["eos_token_ids"] == [2] and generator.stop_token_ids == {2}
    kinds = [node.op_type for node in generator.decoder.past_model.graph.nodes]
    if "int4" in genai_folder.name:  # each layer: its 4-bit q/k/v, attention, output projection and MLP
        assert (kinds.count("MatMulNBits"), kinds.count("GroupQueryAttention"), kinds.count("GatedMLPNBits")) == (
            61, 30, 30)


def test_genai_folder_is_read_from_its_config(smollm2_genai_fp32_dir):
    generator = Generator.from_folder(smollm2_genai_fp32_dir)
    assert generator.decoder.context_length == 8192 and generator.decoder.share_buffer
    assert generator.generation_config["eos_token_id"] == [2] and generator.generation_config["pad_token_id"] == 2
    with pytest.raises(runnx.RunnxError, match="rows cannot be padded"):
        generator.generate_batch(["Hi", "The capital of France is"], max_new_tokens=2)


PROMPTS = ("The capital of France is", "def fibonacci(n):")


def _load_unoptimized(path):
    return runnx.load(path, check_symbolic_dims=False, optimization_level="disabled")


@pytest.mark.parametrize("variant, file, load", [
    ("fp32", "model.onnx", None), ("q4", "model_q4.onnx", None), ("int8", "model_quantized.onnx", None),
    ("int8", "model_quantized.onnx", _load_unoptimized), ("fp16", "model_fp16.onnx", None),
    ("q4f16", "model_q4f16.onnx", None), ("bnb4", "model_bnb4.onnx", None)],
    ids=["fp32", "q4", "int8", "int8-disabled", "fp16", "q4f16", "bnb4"])
def test_transformers_js_variant_greedy_equals_onnxruntime(smollm2_tjs_dir, variant, file, load):
    """int8 (quantize_dynamic's DynamicQuantizeLinear -> MatMulInteger): its graph fuses only
    kernels bitwise their nodes (a fused attention rounding apart moved quantized values and the
    first token, 4723 for onnxruntime's 7042). Its decode steps' logits are up to 2.4 from
    onnxruntime's (each rounds its float attention its own way before the quantizers), and the 16th
    token of "def fibonacci(n):" is where that shows: onnxruntime 365 by 0.44 over 304, runnx 304 by
    0.60 over 365 (the 15 before equal; "The capital of France is": 24 of 24)."""
    generator = Generator.from_folder(smollm2_tjs_dir, variant=variant, load=load)
    model = smollm2_tjs_dir / "onnx" / file
    assert read_folder(smollm2_tjs_dir, variant).files.first == model
    tokens = 15 if variant == "int8" else 16
    for prompt in PROMPTS:
        expected = ort_greedy(model, model, generator.tokenizer.encode(prompt), tokens)
        generator.generate(prompt, max_new_tokens=tokens, stop_token_ids=())
        assert generator.generated[0] == expected, prompt


def test_transformers_js_missing_variant_lists_those_present(smollm2_tjs_dir):
    with pytest.raises(runnx.RunnxError) as error:
        Generator.from_folder(smollm2_tjs_dir, variant="uint8")
    assert str(error.value).endswith("has no uint8 variant; the variants present: fp32, bnb4, fp16, q4, q4f16, "
                                     "quantized")


def test_transformers_js_fp16_logits_and_cache_stay_float16(smollm2_tjs_dir):
    """convert_float_to_float16's file: float16 past key/values in, logits and presents out, its
    arithmetic in float32 (interp/float16.py) as onnxruntime's CPU provider computes it; the float16
    KV cache grows in place."""
    from generate_reference import session
    generator = Generator.from_folder(smollm2_tjs_dir, variant="fp16")
    generator.generate(PROMPTS[0], max_new_tokens=8, stop_token_ids=())
    cache = generator.decoder.cache
    assert cache.appended_in_place and cache.regrowths == 0
    assert {a.dtype for a in cache.arrays.values()} == {np.dtype(np.float16)}
    model = smollm2_tjs_dir / "onnx" / "model_fp16.onnx"
    ids = np.array([generator.tokenizer.encode(PROMPTS[0])], np.int64)
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids), "position_ids": np.arange(ids.shape[1])[None]}
    reference = session(model)
    feeds.update({i.name: np.zeros((1, i.shape[1], 0, i.shape[3]), np.float16)
                  for i in reference.get_inputs() if i.name.startswith("past_key_values.")})
    expected = reference.run(["logits"], feeds)[0]
    got = runnx.load(model, check_symbolic_dims=False).run(feeds, ["logits"])["logits"]
    assert got.dtype == np.float16 and got.shape == expected.shape
    np.testing.assert_allclose(got.astype(np.float32), expected.astype(np.float32), atol=0.1, rtol=0.01)  # 6 of 245,760 prompt logits 0.06 apart
