"""Rewrite a Llama Hugging Face folder (SmolLM2-135M's, from gguf_to_hf.py) as another architecture
with the same weights, so that the exported graph differs in structure only and greedy ids stay those
of a real model (random weights have near-tied logits, and their greedy ids are fragile).

    python llama_to_arch.py LLAMA_DIR {qwen2,phi3} OUT_DIR

qwen2: Qwen2ForCausalLM, the same tensors plus q/k/v biases, all zero (the bias Adds stay in the graph).
phi3:  Phi3ForCausalLM, qkv_proj = [q; k; v] and gate_up_proj = [gate; up] concatenated by rows, full
       rotary, no sliding window.
Both keep rope_theta, rms_norm_eps and the tied LM head. The converted model's logits on a prompt must
equal the Llama's (within TOLERANCE) before anything is saved. Runs in the export venv.
"""
from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer, LlamaForCausalLM, Phi3Config, Phi3ForCausalLM, Qwen2Config, Qwen2ForCausalLM

TOLERANCE = 1e-4
PROMPT = "The capital of France is Paris. Water boils at a temperature of"
# the tokenizer and generation files travel unchanged (the model's own config and weights are rewritten)
COPIED = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def shared_config(llama) -> dict:
    c = llama.config
    return dict(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
                num_key_value_heads=c.num_key_value_heads, hidden_act=c.hidden_act,
                max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
                rope_theta=c.rope_theta, rope_scaling=None, tie_word_embeddings=c.tie_word_embeddings,
                bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_id, pad_token_id=c.pad_token_id,
                attention_dropout=0.0, dtype="float32")


def to_qwen2(llama) -> Qwen2ForCausalLM:
    config = Qwen2Config(**shared_config(llama), use_sliding_window=False, sliding_window=None)
    model = Qwen2ForCausalLM(config)
    state = dict(llama.state_dict())
    for layer in range(config.num_hidden_layers):
        for name in ("q_proj", "k_proj", "v_proj"):
            weight = state[f"model.layers.{layer}.self_attn.{name}.weight"]
            state[f"model.layers.{layer}.self_attn.{name}.bias"] = torch.zeros(weight.shape[0])
    return load(model, state)


def to_phi3(llama) -> Phi3ForCausalLM:
    config = Phi3Config(**shared_config(llama), original_max_position_embeddings=llama.config.max_position_embeddings,
                        partial_rotary_factor=1.0, sliding_window=None, resid_pdrop=0.0, embd_pdrop=0.0)
    model = Phi3ForCausalLM(config)
    state = {}
    for key, value in llama.state_dict().items():
        prefix, _, name = key.rpartition(".self_attn.")
        if name in ("k_proj.weight", "v_proj.weight") or key.endswith(("mlp.up_proj.weight",)):
            continue  # joined into their fused products below
        if name == "q_proj.weight":
            state[f"{prefix}.self_attn.qkv_proj.weight"] = torch.cat(
                [value, llama.state_dict()[f"{prefix}.self_attn.k_proj.weight"],
                 llama.state_dict()[f"{prefix}.self_attn.v_proj.weight"]])
        elif key.endswith("mlp.gate_proj.weight"):
            up = llama.state_dict()[key.replace("gate_proj", "up_proj")]
            state[key.replace("gate_proj", "gate_up_proj")] = torch.cat([value, up])
        else:
            state[key] = value
    return load(model, state)


def load(model, state: dict):
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [key for key in missing if key != "lm_head.weight"]  # tied to the embedding
    if missing or unexpected:
        raise ValueError(f"{type(model).__name__}: weights missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    return model.eval()


def convert(llama_dir: Path, arch: str, out_dir: Path) -> None:
    start = time.monotonic()
    llama = LlamaForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    model = {"qwen2": to_qwen2, "phi3": to_phi3}[arch](llama)
    ids = AutoTokenizer.from_pretrained(llama_dir)(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        expected, got = llama(ids).logits, model(ids).logits
    difference = (expected - got).abs().max().item()
    print(f"{type(model).__name__}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters; "
          f"logits on {ids.shape[1]} tokens differ from the Llama's by at most {difference:.2e}")
    if not difference <= TOLERANCE or not torch.equal(expected.argmax(-1), got.argmax(-1)):
        raise ValueError(f"{arch}: the converted logits differ from the Llama's by {difference:.2e} "
                         f"(expected at most {TOLERANCE})")
    model.save_pretrained(out_dir)
    for name in COPIED:
        if (llama_dir / name).is_file():
            shutil.copy2(llama_dir / name, out_dir / name)
    print(f"saved {out_dir} in {time.monotonic() - start:.1f}s")


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[2] not in ("qwen2", "phi3"):
        sys.exit("usage: llama_to_arch.py LLAMA_DIR {qwen2,phi3} OUT_DIR")
    convert(Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3]))
