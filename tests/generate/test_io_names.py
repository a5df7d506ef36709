"""Name discovery for the three Optimum export shapes and the Whisper encoder/decoder variants."""
from __future__ import annotations

import pytest

from runnx.generate.io_names import DecoderIO, DecoderIOError, find_decoder_files


def _kv(prefix, layers, groups=("",)):
    return [f"{prefix}.{layer}.{group + '.' if group else ''}{kind}"
            for layer in range(layers) for group in groups for kind in ("key", "value")]


def test_single_model_with_past():
    io = DecoderIO.from_names(["input_ids", "attention_mask", "position_ids", *_kv("past_key_values", 2)],
                              ["logits", *_kv("present", 2)])
    assert (io.attention_mask, io.position_ids, io.use_cache_branch) == ("attention_mask", "position_ids", None)
    assert io.num_layers == 2 and io.takes_past and io.other_inputs == ()
    assert [(k.past, k.present) for k in io.kv][:2] == [("past_key_values.0.key", "present.0.key"),
                                                         ("past_key_values.0.value", "present.0.value")]


def test_merged_decoder_and_decoder_without_past():
    merged = DecoderIO.from_names(["input_ids", "attention_mask", *_kv("past_key_values", 1), "use_cache_branch"],
                                  ["logits", *_kv("present", 1)])
    assert merged.use_cache_branch == "use_cache_branch"
    first = DecoderIO.from_names(["input_ids", "attention_mask"], ["logits", *_kv("present", 1)])
    assert not first.takes_past and all(k.present and k.past is None for k in first.kv)


def test_whisper_decoder_groups():
    io = DecoderIO.from_names(
        ["input_ids", "encoder_hidden_states", *_kv("past_key_values", 2, ("decoder", "encoder")), "use_cache_branch"],
        ["logits", *_kv("present", 2, ("decoder", "encoder"))])
    assert io.other_inputs == ("encoder_hidden_states",)
    assert io.attention_mask is None and io.position_ids is None
    cross = [k for k in io.kv if k.is_cross_attention]
    assert [k.past for k in cross] == _kv("past_key_values", 2, ("encoder",))
    assert [k.present for k in cross] == _kv("present", 2, ("encoder",))
    with_past = DecoderIO.from_names(["input_ids", *_kv("past_key_values", 2, ("decoder", "encoder"))],
                                     ["logits", *_kv("present", 2, ("decoder",))])
    assert [k.present for k in with_past.kv if k.is_cross_attention] == [None] * 4


def test_not_a_decoder():
    with pytest.raises(DecoderIOError, match="no 'logits' output"):
        DecoderIO.from_names(["input_ids"], ["last_hidden_state"])
    with pytest.raises(DecoderIOError, match="no 'input_ids'"):
        DecoderIO.from_names(["input_features"], ["logits"])


def test_find_decoder_files(tmp_path):
    with pytest.raises(DecoderIOError, match="holds no decoder export"):
        find_decoder_files(tmp_path)
    (tmp_path / "decoder_model.onnx").touch()
    (tmp_path / "decoder_with_past_model.onnx").touch()
    split = find_decoder_files(tmp_path)
    assert (split.shape, split.first.name, split.with_past.name) == ("split", "decoder_model.onnx",
                                                                     "decoder_with_past_model.onnx")
    (tmp_path / "decoder_model_merged.onnx").touch()
    assert find_decoder_files(tmp_path).shape == "merged"
    (tmp_path / "onnx").mkdir()
    (tmp_path / "onnx" / "model.onnx").touch()
    assert find_decoder_files(tmp_path).shape == "merged"  # the folder itself comes first
