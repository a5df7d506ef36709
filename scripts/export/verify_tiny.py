"""Check the tiny fixtures against PyTorch: onnxruntime runs each exported file (prefill, then one
decode step with the returned past) and its logits must match the Hugging Face model's.

    python verify_tiny.py HF_ROOT FIXTURES_DIR

HF_ROOT holds make_tiny.py's folders (tiny-llama, tiny-gpt2, tiny-whisper). Runs in the export venv.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnxruntime
import torch
from transformers import AutoModelForCausalLM, WhisperForConditionalGeneration

TOLERANCE = 1e-4
PROMPT = np.array([[5, 17, 230, 999, 42, 7, 300]], np.int64)
NEXT = np.array([[64]], np.int64)


def session(path: Path):
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = 1
    return onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def run(sess, feeds: dict) -> dict:
    names = {i.name for i in sess.get_inputs()}
    outputs = sess.run(None, {k: v for k, v in feeds.items() if k in names})
    return dict(zip([o.name for o in sess.get_outputs()], outputs))


def check(label: str, got: np.ndarray, want: np.ndarray) -> None:
    difference = float(np.abs(got - want).max())
    print(f"  {label}: max |onnxruntime - torch| = {difference:.2e}")
    if not difference < TOLERANCE:
        raise SystemExit(f"{label}: onnxruntime and torch differ by {difference}")


def decoder_feeds(input_ids, past: dict | None, past_length: int, layers: int, kv_heads: int, head_dim: int,
                  empty_past_length: int) -> dict:
    length = input_ids.shape[1]
    feeds = {"input_ids": input_ids, "attention_mask": np.ones((1, past_length + length), np.int64),
             "position_ids": np.arange(past_length, past_length + length, dtype=np.int64)[None],
             "use_cache_branch": np.array([past is not None])}
    for layer in range(layers):
        for kind in ("key", "value"):
            name = f"past_key_values.{layer}.{kind}"
            feeds[name] = (past[f"present.{layer}.{kind}"] if past is not None
                           else np.zeros((1, kv_heads, empty_past_length, head_dim), np.float32))
    return feeds


def verify_decoder(hf_dir: Path, onnx_file: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    config = model.config
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = config.hidden_size // config.num_attention_heads
    sess = session(onnx_file)
    merged = any(i.name == "use_cache_branch" for i in sess.get_inputs())
    shape = (config.num_hidden_layers, kv_heads, head_dim, 1 if merged else 0)  # the merged If still wants a past
    first = run(sess, decoder_feeds(PROMPT, None, 0, *shape))
    second = run(sess, decoder_feeds(NEXT, first, PROMPT.shape[1], *shape))
    with torch.no_grad():
        full = model(torch.from_numpy(np.concatenate([PROMPT, NEXT], 1))).logits.numpy()
    check(f"{onnx_file.parent.name}/{onnx_file.name} prefill", first["logits"], full[:, :PROMPT.shape[1]])
    check(f"{onnx_file.parent.name}/{onnx_file.name} decode", second["logits"][:, -1], full[:, -1])


def verify_whisper(hf_dir: Path, folder: Path) -> None:
    model = WhisperForConditionalGeneration.from_pretrained(hf_dir).eval()
    config = model.config
    heads, head_dim = config.decoder_attention_heads, config.d_model // config.decoder_attention_heads
    features = np.random.default_rng(0).standard_normal((1, config.num_mel_bins, 3000)).astype(np.float32)
    hidden = run(session(folder / "encoder_model.onnx"), {"input_features": features})["last_hidden_state"]
    decoder = session(folder / "decoder_model_merged.onnx")
    prompt = np.array([[config.decoder_start_token_id, 5, 6, 7]], np.int64)
    feeds = {"input_ids": prompt, "encoder_hidden_states": hidden, "use_cache_branch": np.array([False])}
    past_names = [f"past_key_values.{layer}.{side}.{kind}" for layer in range(config.decoder_layers)
                  for side in ("decoder", "encoder") for kind in ("key", "value")]
    feeds.update({name: np.zeros((1, heads, 1, head_dim), np.float32) for name in past_names})
    first = run(decoder, feeds)
    feeds = {"input_ids": NEXT, "encoder_hidden_states": hidden, "use_cache_branch": np.array([True])}
    feeds.update({name: first[name.replace("past_key_values", "present")] for name in past_names})
    second = run(decoder, feeds)
    with torch.no_grad():
        reference_hidden = model.model.encoder(torch.from_numpy(features)).last_hidden_state
        full = model(encoder_outputs=(reference_hidden,),
                     decoder_input_ids=torch.from_numpy(np.concatenate([prompt, NEXT], 1))).logits.numpy()
    check("tiny-whisper/encoder_model.onnx", hidden, reference_hidden.numpy())
    check("tiny-whisper/decoder_model_merged.onnx prefill", first["logits"], full[:, :prompt.shape[1]])
    check("tiny-whisper/decoder_model_merged.onnx decode", second["logits"][:, -1], full[:, -1])


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: verify_tiny.py HF_ROOT FIXTURES_DIR")
    hf_root, fixtures = Path(sys.argv[1]), Path(sys.argv[2])
    verify_decoder(hf_root / "tiny-llama", fixtures / "tiny-llama" / "model.onnx")
    for name in ("decoder_model_merged.onnx", "decoder_with_past_model.onnx"):
        verify_decoder(hf_root / "tiny-llama", fixtures / "tiny-llama-merged" / name)
    verify_decoder(hf_root / "tiny-gpt2", fixtures / "tiny-gpt2" / "model.onnx")
    verify_whisper(hf_root / "tiny-whisper", fixtures / "tiny-whisper")
    print("all tiny fixtures match PyTorch")
