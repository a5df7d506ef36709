"""Input/output names of Optimum-exported decoders, mapped explicitly (never by substring guessing).

Three export shapes exist, and each may carry the Whisper-style `.decoder.` / `.encoder.` KV names:

- a single `model.onnx` whose past inputs are always present (prefill passes length-0 past),
- `decoder_model_merged.onnx`: one top-level `If` on `use_cache_branch` (False: no past; True: past),
- `decoder_model.onnx` (no past inputs) + `decoder_with_past_model.onnx`.

`DecoderIO.of(model)` reads one model's names; `find_decoder_files(folder)` picks the files of a folder.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from runnx.errors import RunnxError

# past_key_values.3.key, past_key_values.3.decoder.value, present.3.encoder.key, ...
_PAST = re.compile(r"^past_key_values\.(\d+)\.(?:(decoder|encoder)\.)?(key|value)$")
_PRESENT = re.compile(r"^present\.(\d+)\.(?:(decoder|encoder)\.)?(key|value)$")

_ROLE_INPUTS = ("input_ids", "attention_mask", "position_ids", "cache_position", "use_cache_branch")


class DecoderIOError(RunnxError):
    """A model or folder does not look like an Optimum decoder export."""


@dataclass(frozen=True, slots=True)
class KVName:
    """One KV tensor: the past input and the present output that carry it from step to step.

    group is '' for decoder-only models, 'decoder' (self-attention) or 'encoder' (cross-attention,
    computed from the encoder output once, at the first step) for encoder-decoder models."""

    layer: int
    group: str
    kind: str  # 'key' or 'value'
    past: str | None  # None when the model takes no past (decoder_model.onnx)
    present: str | None  # None when the model does not return it (cross-attention in decoder_with_past)

    @property
    def slot(self) -> tuple[int, str, str]:
        return (self.layer, self.group, self.kind)

    @property
    def is_cross_attention(self) -> bool:
        return self.group == "encoder"


@dataclass(frozen=True, slots=True)
class DecoderIO:
    """The named roles of one decoder model's inputs and outputs."""

    input_ids: str
    logits: str
    attention_mask: str | None
    position_ids: str | None
    cache_position: str | None
    use_cache_branch: str | None
    kv: tuple[KVName, ...]  # sorted by (layer, group, kind)
    other_inputs: tuple[str, ...]  # e.g. encoder_hidden_states: fed by the caller as fixed feeds

    @property
    def takes_past(self) -> bool:
        return any(k.past for k in self.kv)

    @property
    def past_names(self) -> tuple[str, ...]:
        return tuple(k.past for k in self.kv if k.past)

    @property
    def num_layers(self) -> int:
        return 1 + max(k.layer for k in self.kv) if self.kv else 0

    @classmethod
    def from_names(cls, input_names, output_names) -> "DecoderIO":
        inputs, outputs = list(input_names), list(output_names)
        slots: dict[tuple, dict] = {}
        other = []
        for name in inputs:
            match = _PAST.match(name)
            if match:
                slots.setdefault(_slot(match), {})["past"] = name
            elif name not in _ROLE_INPUTS:
                other.append(name)
        for name in outputs:
            match = _PRESENT.match(name)
            if match:
                slots.setdefault(_slot(match), {})["present"] = name
        if "input_ids" not in inputs:
            raise DecoderIOError(f"no 'input_ids' input (inputs: {', '.join(inputs)})")
        logits = "logits" if "logits" in outputs else None
        if logits is None:
            raise DecoderIOError(f"no 'logits' output (outputs: {', '.join(outputs)})")
        kv = tuple(KVName(layer, group, kind, names.get("past"), names.get("present"))
                   for (layer, group, kind), names in sorted(slots.items()))
        role = {name: (name if name in inputs else None) for name in _ROLE_INPUTS}
        return cls(input_ids="input_ids", logits=logits, attention_mask=role["attention_mask"],
                   position_ids=role["position_ids"], cache_position=role["cache_position"],
                   use_cache_branch=role["use_cache_branch"], kv=kv, other_inputs=tuple(other))

    @classmethod
    def of(cls, model) -> "DecoderIO":
        """Roles of a loaded model (anything with input_names and output_names)."""
        return cls.from_names(model.input_names, model.output_names)


def _slot(match) -> tuple[int, str, str]:
    return (int(match.group(1)), match.group(2) or "", match.group(3))


@dataclass(frozen=True, slots=True)
class DecoderFiles:
    """Which ONNX files of a folder drive the decoder: `first` runs the first step (no past yet),
    `with_past` every later step; both are the same file for `model.onnx` and merged exports."""

    shape: str  # 'single', 'merged' or 'split'
    first: Path
    with_past: Path


def find_decoder_files(folder) -> DecoderFiles:
    """The decoder files of an Optimum export folder (also looks in its `onnx/` subfolder).
    Preference: model.onnx, decoder_model_merged.onnx, decoder_model + decoder_with_past_model."""
    folder = Path(folder)
    for root in (folder, folder / "onnx"):
        single = root / "model.onnx"
        merged = root / "decoder_model_merged.onnx"
        first, with_past = root / "decoder_model.onnx", root / "decoder_with_past_model.onnx"
        if single.is_file():
            return DecoderFiles("single", single, single)
        if merged.is_file():
            return DecoderFiles("merged", merged, merged)
        if first.is_file() and with_past.is_file():
            return DecoderFiles("split", first, with_past)
    raise DecoderIOError(f"{folder} holds no decoder export: expected model.onnx, decoder_model_merged.onnx, "
                         "or decoder_model.onnx with decoder_with_past_model.onnx")
