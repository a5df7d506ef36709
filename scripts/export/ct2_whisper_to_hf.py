"""Turn a CTranslate2 Whisper conversion (faster-whisper layout: model.bin, config.json,
tokenizer.json) back into a Hugging Face WhisperForConditionalGeneration folder, float32.

    python ct2_whisper_to_hf.py CT2_DIR OUT_DIR

This inverts ctranslate2's Whisper converter (converters/transformers.py, WhisperLoader): its
fused self-attention QKV and cross-attention KV projections are split again, the zero key biases
it adds are dropped (Whisper's k_proj has none), and the output projection stays tied to the
token embedding. Runs in the export venv.
"""
from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import numpy as np
import torch
from transformers import (GenerationConfig, WhisperConfig, WhisperFeatureExtractor, WhisperForConditionalGeneration,
                          WhisperProcessor, WhisperTokenizerFast)

sys.path.insert(0, str(Path(__file__).parent))
from ct2_format import read_ct2  # noqa: E402

GELU_EXACT = 3  # ctranslate2's ActivationType.GELU
# Special token ids of the English-only ("*.en") Whisper vocabulary.
END_OF_TEXT, START_OF_TRANSCRIPT, START_OF_PREVIOUS, NO_TIMESTAMPS = 50256, 50257, 50360, 50362


class StateDict:
    """Collects Hugging Face parameters from CTranslate2 variables (stored float16, kept float32)."""

    def __init__(self, variables: dict, d_model: int):
        self.variables, self.d_model, self.tensors = variables, d_model, {}

    def get(self, name: str) -> torch.Tensor:
        return torch.from_numpy(np.array(self.variables[name], dtype=np.float32))

    def linear(self, hf_name: str, ct2_name: str) -> None:
        self.tensors[f"{hf_name}.weight"] = self.get(f"{ct2_name}/weight")
        self.tensors[f"{hf_name}.bias"] = self.get(f"{ct2_name}/bias")

    def layer_norm(self, hf_name: str, ct2_name: str) -> None:
        self.tensors[f"{hf_name}.weight"] = self.get(f"{ct2_name}/gamma")
        self.tensors[f"{hf_name}.bias"] = self.get(f"{ct2_name}/beta")

    def split_projections(self, hf_attention: str, ct2_name: str, parts: str) -> None:
        """One fused projection (rows stacked per part, e.g. 'qkv' or 'kv') -> separate *_proj layers."""
        weight, bias = self.get(f"{ct2_name}/weight"), self.get(f"{ct2_name}/bias")
        for index, part in enumerate(parts):
            rows = slice(index * self.d_model, (index + 1) * self.d_model)
            self.tensors[f"{hf_attention}.{part}_proj.weight"] = weight[rows].clone()
            if part == "k":
                if float(bias[rows].abs().max()) != 0.0:
                    raise ValueError(f"{ct2_name}: non-zero key bias; Whisper's k_proj has no bias")
            else:
                self.tensors[f"{hf_attention}.{part}_proj.bias"] = bias[rows].clone()


def layer_count(variables: dict, side: str) -> int:
    return len({match.group(1) for name in variables if (match := re.match(rf"{side}/layer_(\d+)/", name))})


def convert(ct2_dir: Path, out_dir: Path) -> None:
    model_bin = read_ct2(ct2_dir / "model.bin")
    ct2_config = json.loads((ct2_dir / "config.json").read_text())
    variables = model_bin.variables
    if (model_bin.spec, model_bin.revision) != ("WhisperSpec", 3):
        raise ValueError(f"expected WhisperSpec revision 3, got {model_bin.spec} revision {model_bin.revision}")
    if int(variables["decoder/activation"]) != GELU_EXACT:
        raise ValueError("expected exact GELU activations")
    d_model, mel_bins = variables["encoder/conv1/weight"].shape[:2]
    encoder_layers, decoder_layers = layer_count(variables, "encoder"), layer_count(variables, "decoder")
    ffn_dim = variables["encoder/layer_0/ffn/linear_0/weight"].shape[0]
    vocab_size = variables["decoder/embeddings/weight"].shape[0]
    print(f"d_model={d_model} mel_bins={mel_bins} layers={encoder_layers}/{decoder_layers} ffn={ffn_dim} "
          f"vocab={vocab_size}")

    state = StateDict(variables, d_model)
    for side, layers in (("encoder", encoder_layers), ("decoder", decoder_layers)):
        state.tensors[f"model.{side}.embed_positions.weight"] = state.get(f"{side}/position_encodings/encodings")
        state.layer_norm(f"model.{side}.layer_norm", f"{side}/layer_norm")
        for index in range(layers):
            hf, ct2 = f"model.{side}.layers.{index}", f"{side}/layer_{index}"
            state.split_projections(f"{hf}.self_attn", f"{ct2}/self_attention/linear_0", "qkv")
            state.linear(f"{hf}.self_attn.out_proj", f"{ct2}/self_attention/linear_1")
            state.layer_norm(f"{hf}.self_attn_layer_norm", f"{ct2}/self_attention/layer_norm")
            if side == "decoder":
                state.linear(f"{hf}.encoder_attn.q_proj", f"{ct2}/attention/linear_0")
                state.split_projections(f"{hf}.encoder_attn", f"{ct2}/attention/linear_1", "kv")
                state.linear(f"{hf}.encoder_attn.out_proj", f"{ct2}/attention/linear_2")
                state.layer_norm(f"{hf}.encoder_attn_layer_norm", f"{ct2}/attention/layer_norm")
            state.linear(f"{hf}.fc1", f"{ct2}/ffn/linear_0")
            state.linear(f"{hf}.fc2", f"{ct2}/ffn/linear_1")
            state.layer_norm(f"{hf}.final_layer_norm", f"{ct2}/ffn/layer_norm")
    for conv in ("conv1", "conv2"):
        state.linear(f"model.encoder.{conv}", f"encoder/{conv}")
    state.tensors["model.decoder.embed_tokens.weight"] = state.get("decoder/embeddings/weight")
    if model_bin.aliases.get("decoder/projection/weight") != "decoder/embeddings/weight":
        raise ValueError("expected the output projection to be tied to the token embedding")

    config = WhisperConfig(
        vocab_size=vocab_size, num_mel_bins=mel_bins, d_model=d_model, encoder_layers=encoder_layers,
        decoder_layers=decoder_layers, encoder_attention_heads=int(variables["encoder/num_heads"]),
        decoder_attention_heads=int(variables["decoder/num_heads"]), encoder_ffn_dim=ffn_dim, decoder_ffn_dim=ffn_dim,
        max_source_positions=variables["encoder/position_encodings/encodings"].shape[0],
        max_target_positions=variables["decoder/position_encodings/encodings"].shape[0],
        activation_function="gelu", scale_embedding=False, bos_token_id=START_OF_TRANSCRIPT,
        eos_token_id=END_OF_TEXT, pad_token_id=END_OF_TEXT, decoder_start_token_id=START_OF_TRANSCRIPT,
        tie_word_embeddings=True)
    config.architectures = ["WhisperForConditionalGeneration"]
    model = WhisperForConditionalGeneration(config)
    missing, unexpected = model.load_state_dict(state.tensors, strict=False)
    if unexpected or set(missing) - {"proj_out.weight"}:  # proj_out is tied to embed_tokens
        raise ValueError(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    model.eval()
    model.generation_config = GenerationConfig(
        decoder_start_token_id=START_OF_TRANSCRIPT, bos_token_id=START_OF_TRANSCRIPT, eos_token_id=END_OF_TEXT,
        pad_token_id=END_OF_TEXT, max_length=config.max_target_positions,
        begin_suppress_tokens=ct2_config["suppress_ids_begin"], suppress_tokens=ct2_config["suppress_ids"],
        alignment_heads=ct2_config["alignment_heads"], is_multilingual=False, no_timestamps_token_id=NO_TIMESTAMPS,
        prev_sot_token_id=START_OF_PREVIOUS, max_initial_timestamp_index=50, return_timestamps=False,
        forced_decoder_ids=[[1, NO_TIMESTAMPS]])
    model.save_pretrained(out_dir)

    special = "<|endoftext|>"
    tokenizer = WhisperTokenizerFast(tokenizer_file=str(ct2_dir / "tokenizer.json"), bos_token=special,
                                     eos_token=special, unk_token=special, pad_token=special,
                                     model_max_length=config.max_target_positions)
    features = WhisperFeatureExtractor(feature_size=mel_bins, sampling_rate=16000, hop_length=160, chunk_length=30,
                                       n_fft=400)
    WhisperProcessor(feature_extractor=features, tokenizer=tokenizer).save_pretrained(out_dir)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: ct2_whisper_to_hf.py CT2_DIR OUT_DIR")
    start = time.monotonic()
    convert(Path(sys.argv[1]), Path(sys.argv[2]))
    print(f"saved {sys.argv[2]} in {time.monotonic() - start:.1f}s")
