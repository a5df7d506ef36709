"""Generation with Optimum-exported decoders.

    from runnx.generate import Generator, Chat
    gen = Generator.from_folder("smollm2-135m")
    print(gen.generate("The capital of France is", max_new_tokens=20))

Modules: `decoder` (DecoderStep: one step, in-place KV cache; reused by the Whisper pipeline),
`io_names` (input/output roles of the export shapes), `kv_cache`, `sampling` (logits processors,
samplers), `tokenizer` (text stream), `generator` (step API, iterators, batches), `chat`, `state`
(.safetensors save/restore), `cli` (`runnx generate`, `runnx chat`); Whisper: `audio`, `mel`,
`whisper` (`transcribe`, `Whisper`, `Transcript`), `whisper_cli` (`runnx whisper`).
"""
from __future__ import annotations

import importlib

# Imported on first use: `runnx` loads runnx.generate.cli at start-up for every subcommand.
_EXPORTS = {
    "Chat": "runnx.generate.chat",
    "DecoderStep": "runnx.generate.decoder",
    "DecoderIO": "runnx.generate.io_names",
    "GenerationOptions": "runnx.generate.generator",
    "Generator": "runnx.generate.generator",
    "KVCache": "runnx.generate.kv_cache",
    "Tokenizer": "runnx.generate.tokenizer",
    "Transcript": "runnx.generate.whisper",
    "Whisper": "runnx.generate.whisper",
    "load_state": "runnx.generate.state",
    "save_state": "runnx.generate.state",
    "transcribe": "runnx.generate.whisper",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'runnx.generate' has no attribute '{name}'")
    return getattr(importlib.import_module(module), name)
