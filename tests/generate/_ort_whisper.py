"""Test helpers: onnxruntime behind runnx's model interface (so the Whisper pipeline can drive it),
and an independent greedy Whisper loop on onnxruntime (the recipe's), as the reference."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnxruntime as ort

from runnx.capture import Owned

_ELEM_TYPES = {"tensor(float)": 1, "tensor(int64)": 7, "tensor(bool)": 9, "tensor(int32)": 6}


@dataclass(frozen=True)
class _Info:
    name: str
    shape: tuple
    elem_type: int


def session(path, threads: int = 1):
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


class OrtModel:
    """input_names, output_names, inputs and run(feeds, outputs) like runnx.Model, on onnxruntime."""

    def __init__(self, path, threads: int = 1):
        self.session = session(path, threads)
        self.input_names = [i.name for i in self.session.get_inputs()]
        self.output_names = [o.name for o in self.session.get_outputs()]
        self.inputs = [_Info(i.name, tuple(i.shape), _ELEM_TYPES.get(i.type, 0)) for i in self.session.get_inputs()]

    def run(self, feeds, outputs=None, **_):
        feeds = {name: np.ascontiguousarray(v.array if isinstance(v, Owned) else v) for name, v in feeds.items()}
        names = list(outputs) if outputs else self.output_names
        return dict(zip(names, self.session.run(names, feeds)))


class OrtGreedy:
    """Greedy decoding exactly as the recipe's ort_whisper_transcribe.py does it (no timestamps),
    with the encoder and merged decoder sessions of `folder` loaded once (`encoder`, `decoder`: other
    files, e.g. a transformers.js folder's variants; config.json stays `folder`'s)."""

    def __init__(self, folder, threads: int = 1, *, encoder=None, decoder=None):
        import json
        config = json.loads((folder / "config.json").read_text())
        self.layers, self.heads = config["decoder_layers"], config["decoder_attention_heads"]
        self.head_dim = config["d_model"] // self.heads
        self.encoder = session(encoder or folder / "encoder_model.onnx", threads)
        self.decoder = session(decoder or folder / "decoder_model_merged.onnx", threads)
        self.output_names = [o.name for o in self.decoder.get_outputs()]

    def __call__(self, features: np.ndarray, prompt: list[int], *, eos: int, suppress=(), begin_suppress=(),
                 max_new_tokens: int = 100) -> list[int]:
        hidden = self.encoder.run(None, {"input_features": features})[0]
        past = {f"past_key_values.{layer}.{group}.{kind}": np.zeros((1, self.heads, 1, self.head_dim), np.float32)
                for layer in range(self.layers) for group in ("decoder", "encoder") for kind in ("key", "value")}
        current, generated, first = np.array([prompt], np.int64), [], True
        for _ in range(max_new_tokens):
            feeds = {"input_ids": current, "encoder_hidden_states": hidden, "use_cache_branch": np.array([not first])}
            result = dict(zip(self.output_names, self.decoder.run(None, {**feeds, **past})))
            logits = result["logits"][0, -1].copy()
            logits[list(suppress)] = -np.inf
            if first:
                logits[list(begin_suppress)] = -np.inf
            token = int(logits.argmax())
            for name in past:  # the encoder (cross-attention) KV only from the first step
                if ".decoder." in name or first:
                    past[name] = result[name.replace("past_key_values", "present")]
            first = False
            if token == eos:
                break
            generated.append(token)
            current = np.array([[token]], np.int64)
        return generated
