"""Folder layouts (runnx/generate/layouts.py): genai_config.json parsing on small synthetic configs
(decoder-only and Whisper's),
and the transformers.js layout's variants on the committed tiny Llama (hard-linked into onnx/)."""
from __future__ import annotations

import copy
import json
import os

import pytest

from runnx.generate.generator import Generator
from runnx.generate.layouts import LayoutError, parse_genai_config, read_folder

GENAI = {
    "model": {
        "bos_token_id": 1, "context_length": 64, "eos_token_id": [2, 7], "pad_token_id": 0, "type": "llama",
        "decoder": {
            "filename": "decoder.onnx", "head_size": 16, "hidden_size": 64, "num_attention_heads": 4,
            "num_hidden_layers": 2, "num_key_value_heads": 2,
            "inputs": {"input_ids": "ids", "attention_mask": "mask", "past_key_names": "cache.%d.k",
                       "past_value_names": "cache.%d.v"},
            "outputs": {"logits": "scores", "present_key_names": "new_cache.%d.k",
                        "present_value_names": "new_cache.%d.v"},
        },
    },
    "search": {"past_present_share_buffer": True, "do_sample": False, "top_k": 50, "max_length": 64},
}


def test_genai_config_names_roles_kv_layout_and_stop_ids():
    config = parse_genai_config(GENAI)
    assert (config.filename, config.num_layers, config.kv_heads, config.head_size) == ("decoder.onnx", 2, 2, 16)
    assert config.share_buffer and config.context_length == 64
    assert config.generation_config == {"eos_token_id": [2, 7], "pad_token_id": 0, "bos_token_id": 1,
                                        "do_sample": False, "top_k": 50}
    inputs = ["ids", "mask", "cache.0.k", "cache.0.v", "cache.1.k", "cache.1.v"]
    outputs = ["scores", "new_cache.0.k", "new_cache.0.v", "new_cache.1.k", "new_cache.1.v"]
    io = config.decoder_io(inputs, outputs)
    assert (io.input_ids, io.attention_mask, io.position_ids, io.logits) == ("ids", "mask", None, "scores")
    assert [(k.layer, k.kind, k.past, k.present) for k in io.kv] == [
        (0, "key", "cache.0.k", "new_cache.0.k"), (0, "value", "cache.0.v", "new_cache.0.v"),
        (1, "key", "cache.1.k", "new_cache.1.k"), (1, "value", "cache.1.v", "new_cache.1.v")]
    assert io.other_inputs == ()


def test_genai_config_defaults_are_onnxruntime_genais_names():
    data = copy.deepcopy(GENAI)
    del data["model"]["decoder"]["inputs"], data["model"]["decoder"]["outputs"], data["search"]
    data["model"]["eos_token_id"] = 2
    config = parse_genai_config(data)
    assert (config.past_key, config.present_value, config.logits) == ("past_key_values.%d.key", "present.%d.value",
                                                                      "logits")
    assert config.eos_token_ids == (2,) and not config.share_buffer


def _broken(path: tuple, value):
    data = copy.deepcopy(GENAI)
    parent = data
    for key in path[:-1]:
        parent = parent[key]
    if value is _DELETE:
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    return data


_DELETE = object()


@pytest.mark.parametrize("path, value, message", [
    (("model", "decoder"), _DELETE, "model.decoder must be an object, got nothing"),
    (("model", "decoder", "num_key_value_heads"), "2", "model.decoder.num_key_value_heads must be a non-negative "
                                                       "integer, got \"2\""),
    (("model", "decoder", "head_size"), _DELETE, "model.decoder.head_size must be a non-negative integer"),
    (("model", "decoder", "filename"), "", "model.decoder.filename must name the ONNX file"),
    (("model", "decoder", "inputs", "past_key_names"), "cache.k", "past_key_names must be a name with one %d"),
    (("model", "eos_token_id"), None, "model.eos_token_id must be a token id or a list of them, got nothing"),
    (("search", "past_present_share_buffer"), "yes", "past_present_share_buffer must be true or false"),
    (("model", "encoder"), {"filename": "encoder.onnx"}, "runnx reads decoder-only genai folders and Whisper's"),
])
def test_a_bad_genai_config_is_a_runnx_error_naming_the_field(path, value, message):
    with pytest.raises(LayoutError, match="genai_config.json") as error:
        parse_genai_config(_broken(path, value))
    assert message in str(error.value)


WHISPER_GENAI = {
    "model": {
        "bos_token_id": 50257, "context_length": 448, "eos_token_id": 50256, "pad_token_id": 50256,
        "type": "whisper", "vocab_size": 51864,
        "decoder": {
            "filename": "decoder.onnx", "head_size": 64, "hidden_size": 384, "num_attention_heads": 6,
            "num_hidden_layers": 2, "num_key_value_heads": 6,
            "inputs": {"input_ids": "input_ids", "past_key_names": "past_key_self_%d",
                       "past_value_names": "past_value_self_%d", "cross_past_key_names": "past_key_cross_%d",
                       "cross_past_value_names": "past_value_cross_%d"},
            "outputs": {"logits": "logits", "present_key_names": "present_key_self_%d",
                        "present_value_names": "present_value_self_%d"},
        },
        "encoder": {
            "filename": "encoder.onnx", "head_size": 64, "num_hidden_layers": 2,
            "inputs": {"audio_features": "audio_features"},
            "outputs": {"encoder_hidden_states": "hidden_states", "cross_present_key_names": "present_key_cross_%d",
                        "cross_present_value_names": "present_value_cross_%d"},
        },
    },
    "search": {"past_present_share_buffer": False},
}


def test_a_genai_whisper_config_pairs_the_encoders_cross_kv_with_the_decoders_inputs():
    """onnxruntime-genai's Whisper: the encoder computes each layer's cross-attention KV, which the
    decoder takes as inputs of its own (fixed feeds, not KV it grows)."""
    config = parse_genai_config(WHISPER_GENAI)
    assert (config.encoder.filename, config.encoder.input_name, config.vocab_size) == ("encoder.onnx",
                                                                                       "audio_features", 51864)
    assert config.encoder.cross_names() == (
        ("present_key_cross_0", "past_key_cross_0"), ("present_value_cross_0", "past_value_cross_0"),
        ("present_key_cross_1", "past_key_cross_1"), ("present_value_cross_1", "past_value_cross_1"))
    cross = ["past_key_cross_0", "past_value_cross_0", "past_key_cross_1", "past_value_cross_1"]
    self_kv = ["past_key_self_0", "past_value_self_0", "past_key_self_1", "past_value_self_1"]
    outputs = ["logits", "present_key_self_0", "present_value_self_0", "present_key_self_1", "present_value_self_1"]
    io = config.decoder_io(["input_ids", *self_kv, *cross], outputs)
    assert [k.past for k in io.kv] == self_kv and not any(k.is_cross_attention for k in io.kv)
    assert io.other_inputs == tuple(cross) and io.attention_mask is None
    with pytest.raises(LayoutError, match="names the cross-attention input 'past_value_cross_1', which decoder.onnx"):
        config.decoder_io(["input_ids", *self_kv, *cross[:3]], outputs)
    data = copy.deepcopy(WHISPER_GENAI)
    del data["model"]["encoder"]
    with pytest.raises(LayoutError, match="model.encoder must be an object"):
        parse_genai_config(data)


def test_a_decoder_only_genai_folder_is_no_whisper_folder(tmp_path):
    from runnx.generate.layouts import whisper_encoder
    from runnx.generate.whisper import Whisper

    (tmp_path / "genai_config.json").write_text(json.dumps(GENAI))
    (tmp_path / "decoder.onnx").write_bytes(b"")
    with pytest.raises(LayoutError, match="describes a decoder-only model .no model.encoder.: not a Whisper folder"):
        whisper_encoder(read_folder(tmp_path))
    with pytest.raises(LayoutError, match="not a Whisper folder"):
        Whisper(tmp_path)


def test_genai_config_names_an_input_the_model_lacks():
    config = parse_genai_config(GENAI)
    with pytest.raises(LayoutError, match=r"names the input 'cache.1.v', which decoder.onnx lacks"):
        config.decoder_io(["ids", "mask", "cache.0.k", "cache.0.v", "cache.1.k"], ["scores"])


def test_genai_folder_with_invalid_json_or_missing_model(tmp_path):
    (tmp_path / "genai_config.json").write_text("{not json")
    with pytest.raises(LayoutError, match="is not valid JSON"):
        read_folder(tmp_path)
    (tmp_path / "genai_config.json").write_text(json.dumps(GENAI))
    with pytest.raises(LayoutError, match="names the model decoder.onnx, which is not in"):
        read_folder(tmp_path)


@pytest.fixture
def tjs_folder(tmp_path, fixtures_dir):
    """tiny-llama in the transformers.js layout: metadata at the top, model.onnx as onnx/ variants."""
    source = fixtures_dir / "tiny-llama"
    (tmp_path / "onnx").mkdir()
    for path in source.iterdir():
        if path.suffix == ".json":
            os.link(path, tmp_path / path.name)
    for name in ("model.onnx", "model_q4.onnx", "model_quantized.onnx"):
        os.link(source / "model.onnx", tmp_path / "onnx" / name)
    return tmp_path


def test_transformers_js_variants_choose_the_file(tjs_folder):
    assert read_folder(tjs_folder).files.first == tjs_folder / "onnx" / "model.onnx"
    assert read_folder(tjs_folder, "q4").files.first == tjs_folder / "onnx" / "model_q4.onnx"
    for variant in ("int8", "q8", "quantized"):  # no model_int8.onnx: int8 is model_quantized.onnx
        assert read_folder(tjs_folder, variant).files.first == tjs_folder / "onnx" / "model_quantized.onnx"
    layout = read_folder(tjs_folder, "q4")
    assert (layout.kind, layout.variant) == ("transformers.js", "q4")
    assert layout.generation_config == json.loads((tjs_folder / "generation_config.json").read_text())


def test_a_missing_variant_lists_the_variants_present(tjs_folder):
    with pytest.raises(LayoutError) as error:
        Generator.from_folder(tjs_folder, variant="fp16")
    assert str(error.value) == f"{tjs_folder / 'onnx'} has no fp16 variant; the variants present: fp32, q4, quantized"
    with pytest.raises(LayoutError, match="'q3' is not a variant runnx knows"):
        read_folder(tjs_folder, "q3")


def test_without_fp32_a_variant_must_be_chosen(tjs_folder):
    (tjs_folder / "onnx" / "model.onnx").unlink()
    with pytest.raises(LayoutError, match="several decoder variants and no fp32 model.onnx: choose one with "
                                          "variant= \\(--variant\\): q4, quantized"):
        read_folder(tjs_folder)


def test_a_variant_for_an_optimum_folder_is_an_error(fixtures_dir):
    assert read_folder(fixtures_dir / "tiny-llama").kind == "optimum"
    with pytest.raises(LayoutError, match="tiny-llama has none"):
        read_folder(fixtures_dir / "tiny-llama", "q4")


def test_a_transformers_js_variant_generates_as_the_optimum_folder(tjs_folder, fixtures_dir):
    expected = Generator.from_folder(fixtures_dir / "tiny-llama").generate("Once upon a time", max_new_tokens=8)
    assert Generator.from_folder(tjs_folder, variant="q4").generate("Once upon a time", max_new_tokens=8) == expected
