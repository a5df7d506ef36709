"""Whisper in the transformers.js layout (`onnx/encoder_model[_variant].onnx` +
`onnx/decoder_model_merged[_variant].onnx`, layouts.py): the variant chooses both files, a missing
variant is a clear error, and the real tiny.en in that layout transcribes john.wav exactly in fp32
and int8, the int8 token ids equal to onnxruntime's on the same files. Whisper in onnxruntime-genai's
layout: its token ids equal onnxruntime-genai's own on each clip."""
from __future__ import annotations

import argparse
import json
import os

import numpy as np
import pytest

from runnx.generate import mel
from runnx.generate.audio import load_audio
from runnx.generate.layouts import LayoutError, read_folder, whisper_encoder
from runnx.generate.whisper import Whisper
from runnx.generate.whisper_cli import register

JOHN = "Hello, my name is John and I live in London."
METADATA = ("config.json", "generation_config.json", "preprocessor_config.json", "tokenizer.json")


@pytest.fixture
def tiny_tjs(tmp_path, fixtures_dir):
    """tiny-whisper in the transformers.js layout: fp32 and a `_q4` pair (the same files, linked)."""
    source = fixtures_dir / "tiny-whisper"
    (tmp_path / "onnx").mkdir()
    for name in METADATA:
        if (source / name).is_file():
            os.link(source / name, tmp_path / name)
    for base in ("encoder_model", "decoder_model_merged"):
        for suffix in ("", "_q4"):
            os.link(source / f"{base}.onnx", tmp_path / "onnx" / f"{base}{suffix}.onnx")
    return tmp_path


def test_the_variant_chooses_the_encoder_and_the_decoder(tiny_tjs, fixtures_dir):
    onnx = tiny_tjs / "onnx"
    layout = read_folder(tiny_tjs, "q4")
    assert (layout.kind, layout.files.first, whisper_encoder(layout)) == (
        "transformers.js", onnx / "decoder_model_merged_q4.onnx", onnx / "encoder_model_q4.onnx")
    assert whisper_encoder(read_folder(tiny_tjs)) == onnx / "encoder_model.onnx"  # fp32 by default
    optimum = read_folder(fixtures_dir / "tiny-whisper")
    assert (optimum.kind, whisper_encoder(optimum)) == ("optimum", fixtures_dir / "tiny-whisper" / "encoder_model.onnx")


def test_a_transformers_js_variant_decodes_as_the_optimum_folder(tiny_tjs, fixtures_dir):
    features = np.random.default_rng(0).standard_normal((1, 80, 3000)).astype(np.float32)
    optimum = Whisper(fixtures_dir / "tiny-whisper")
    expected = optimum.decode(optimum.encode(features), max_new_tokens=20).tokens
    model = Whisper(tiny_tjs, variant="q4")
    assert model.variant == "q4" and len(expected) > 0
    assert model.decode(model.encode(features), max_new_tokens=20).tokens == expected


def test_a_missing_variant_lists_the_variants_present(tiny_tjs, fixtures_dir):
    with pytest.raises(LayoutError) as error:
        Whisper(tiny_tjs, variant="int8")
    assert str(error.value) == f"{tiny_tjs / 'onnx'} has no int8 variant; the variants present: fp32, q4"
    (tiny_tjs / "onnx" / "encoder_model_q4.onnx").unlink()  # a decoder variant without its encoder
    with pytest.raises(LayoutError) as error:
        Whisper(tiny_tjs, variant="q4")
    assert str(error.value) == f"{tiny_tjs / 'onnx'} has no encoder q4 variant; the encoder variants present: fp32"
    with pytest.raises(LayoutError, match="tiny-whisper has none"):  # an Optimum folder has no variants
        Whisper(fixtures_dir / "tiny-whisper", variant="q4")


def test_the_cli_passes_the_variant(tiny_tjs, capsys):
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["whisper", str(tiny_tjs), "missing.wav", "--variant", "fp16"])
    assert args.compile_key(args) == ["whisper", os.path.abspath(tiny_tjs), "fp16"]
    assert args.compile_argv(args)[-2:] == ["--variant", "fp16"]
    with pytest.raises(LayoutError, match="has no fp16 variant; the variants present: fp32, q4"):
        args.func(args)


# -- the real tiny.en in the transformers.js layout -------------------------------------------------
@pytest.fixture(scope="module")
def tjs_int8(whisper_tjs_dir):
    return Whisper(whisper_tjs_dir, variant="int8")


def test_fp32_transcribes_john_as_the_optimum_folder(whisper_tjs_dir, whisper_dir, audio_dir):
    tjs = Whisper(whisper_tjs_dir)
    assert tjs.variant == "fp32"
    transcript = tjs.transcribe(audio_dir / "john.wav")
    expected = Whisper(whisper_dir).transcribe(audio_dir / "john.wav")
    assert transcript.text == expected.text == JOHN
    assert transcript.segments[0].tokens == expected.segments[0].tokens


def test_int8_transcribes_john_exactly(tjs_int8, audio_dir):
    assert tjs_int8.transcribe(audio_dir / "john.wav").text == JOHN


@pytest.mark.parametrize("clip", ["john.wav", "fox.wav", "weather.wav"])
def test_int8_token_ids_equal_onnxruntime(tjs_int8, whisper_tjs_dir, audio_dir, clip):
    from _ort_whisper import OrtGreedy
    onnx = whisper_tjs_dir / "onnx"
    reference = OrtGreedy(whisper_tjs_dir, encoder=onnx / "encoder_model_int8.onnx",
                          decoder=onnx / "decoder_model_merged_int8.onnx")
    features = mel.window_features(load_audio(audio_dir / clip))
    tokens = tjs_int8.tokens
    decoded = tjs_int8.decode(tjs_int8.encode(features)).tokens
    expected = reference(features, tokens.prompt(None, "transcribe", False), eos=tokens.end_of_text,
                         suppress=tokens.suppress, begin_suppress=tokens.suppress_at_begin)
    assert decoded == expected and len(expected) > 5


# -- onnxruntime-genai's Whisper folder (genai_config.json: encoder.onnx computes the cross-attention KV) --
@pytest.fixture(scope="module")
def genai_whisper(whisper_genai_dir):
    return Whisper(whisper_genai_dir)


def test_the_genai_folder_names_its_encoder(whisper_genai_dir, genai_whisper):
    """The folder as onnxruntime-genai's builder writes it, without Hugging Face's config.json: the
    vocabulary size (an English-only model's) comes from genai_config.json."""
    layout = read_folder(whisper_genai_dir)
    assert (layout.kind, layout.files.first, whisper_encoder(layout)) == (
        "onnxruntime-genai", whisper_genai_dir / "decoder.onnx", whisper_genai_dir / "encoder.onnx")
    assert not (whisper_genai_dir / "config.json").exists()
    assert (genai_whisper.tokens.vocab_size, genai_whisper.tokens.multilingual) == (51864, False)


@pytest.mark.parametrize("clip", ["john.wav", "fox.wav", "weather.wav"])
def test_genai_token_ids_equal_onnxruntime_genais(genai_whisper, whisper_genai_dir, whisper_dir, audio_dir, clip):
    """Greedy ids from the genai folder equal onnxruntime-genai's own transcription of the clip
    (genai_reference.json: its sequence, the prompt first, without <|endoftext|>) and the Optimum
    folder's of the same weights."""
    reference = json.loads((whisper_genai_dir / "genai_reference.json").read_text())["clips"][clip]
    transcript = genai_whisper.transcribe(audio_dir / clip)
    prompt = genai_whisper.tokens.prompt(None, "transcribe", False)
    assert reference["tokens"][:len(prompt)] == prompt
    assert [t for s in transcript.segments for t in s.tokens] == reference["tokens"][len(prompt):]
    assert transcript.text == reference["text"].strip()
    assert transcript.text == Whisper(whisper_dir).transcribe(audio_dir / clip).text
    if clip == "john.wav":
        assert transcript.text == JOHN


def test_genai_decoding_feeds_the_encoders_cross_kv_as_it_is(genai_whisper, audio_dir):
    """The encoder's cross-attention KV reaches every decoder step as the same read-only arrays
    (nothing copied a step), and the decoder's int32 input_ids are fed as int32."""
    features = mel.window_features(load_audio(audio_dir / "john.wav"))
    encoded = genai_whisper.encode(features)
    assert sorted(encoded) == sorted(name for _, name in genai_whisper._cross)
    assert all(not array.flags.writeable for array in encoded.values())
    decoded = genai_whisper.decode(encoded, max_new_tokens=5)
    assert len(decoded.tokens) == 5
    assert genai_whisper.decoder._ids_dtype == np.int32
    assert all(genai_whisper.decoder.fixed_feeds[name] is array for name, array in encoded.items())


def test_generating_text_from_a_whisper_folder_says_to_transcribe(tiny_tjs, fixtures_dir, tmp_path):
    """runnx generate / Generator.from_folder on a speech model, in any layout, names what to use."""
    from runnx.generate.generator import Generator
    from runnx.generate.layouts import is_whisper

    genai = tmp_path / "genai"
    genai.mkdir()
    (genai / "genai_config.json").write_text(json.dumps({"model": {
        "type": "whisper", "eos_token_id": 1, "encoder": {"filename": "encoder.onnx"},
        "decoder": {"filename": "decoder.onnx", "num_hidden_layers": 1, "num_key_value_heads": 1, "head_size": 2}}}))
    (genai / "decoder.onnx").write_bytes(b"")
    for folder in (fixtures_dir / "tiny-whisper", tiny_tjs, genai):
        assert is_whisper(read_folder(folder))
        with pytest.raises(LayoutError, match=r"holds Whisper, a speech-to-text model: transcribe audio with "
                                              r"`runnx whisper .* AUDIO`"):
            Generator.from_folder(folder)
    assert not is_whisper(read_folder(fixtures_dir / "tiny-llama"))
