"""Save and restore a generation state (KV cache + tokens) as a .safetensors file, so that a long
system prompt is computed once and reused across runs:

    gen.start(); gen.append_tokens(system_prompt_ids); gen.compute_logits()
    save_state(gen, "system.safetensors")
    ...
    load_state(gen, "system.safetensors"); gen.append_tokens(question_ids); ...

The file holds the KV tensors under their past input names, `token_ids` (every token, including
a sampled one not yet run) and `attention_mask`; the metadata names the format and cache length.
"""
from __future__ import annotations

import numpy as np
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from runnx.errors import RunnxError

FORMAT = "runnx.generate.state/1"
TOKEN_IDS = "token_ids"
ATTENTION_MASK = "attention_mask"


def save_state(generator, path) -> None:
    decoder = generator.decoder
    tensors = decoder.kv_arrays()
    tensors[TOKEN_IDS] = np.ascontiguousarray(generator.token_ids)
    tensors[ATTENTION_MASK] = np.ascontiguousarray(generator.attention_mask)
    save_file(tensors, str(path), metadata={"format": FORMAT, "cached_tokens": str(decoder.length)})


def load_state(generator, path) -> None:
    """Put `generator` where it was when the state was saved (same model); configure() it before
    generating."""
    with safe_open(str(path), framework="numpy") as handle:
        metadata = handle.metadata() or {}
    if metadata.get("format") != FORMAT:
        raise RunnxError(f"{path} is not a runnx generation state (format {metadata.get('format')!r})")
    tensors = load_file(str(path))
    token_ids, mask = tensors.pop(TOKEN_IDS), tensors.pop(ATTENTION_MASK)
    cached = int(metadata["cached_tokens"])
    generator.reset(token_ids.shape[0])
    if cached:
        generator.decoder.restore(tensors, mask[:, :cached])
    generator.append_tokens(token_ids, mask)  # the first `cached` of them are in the cache already
