"""The folder layouts a decoder is downloaded in, read in one place: which ONNX file runs, under
which input/output names, with what KV layout and stop ids.

- Optimum export: `model.onnx`, `decoder_model_merged.onnx` or `decoder_model.onnx` +
  `decoder_with_past_model.onnx` beside config.json, generation_config.json and the tokenizer
  (names discovered from the model: io_names.py).
- transformers.js (the Hugging Face `onnx-community` repositories): the tokenizer and configs at the
  top, the decoder in `onnx/` in variants `model.onnx` (fp32), `model_fp16.onnx`,
  `model_quantized.onnx` (q8), `model_int8.onnx`, `model_uint8.onnx`, `model_q4.onnx`,
  `model_q4f16.onnx`, `model_bnb4.onnx` (or `decoder_model_merged*.onnx`); `variant=` picks one.
  Whisper folders add `onnx/encoder_model*.onnx` in the same variants: `whisper_encoder` picks the
  encoder of the decoder's variant.
- onnxruntime-genai: `genai_config.json` names the file, its inputs and outputs (KV names with %d),
  the KV heads and head size, eos/pad ids, the context length and `past_present_share_buffer`
  (one KV buffer fed as past and written in place as present, GroupQueryAttention finding each
  sequence's length from the attention mask); the chat template comes with the tokenizer files.
  Its Whisper folders (`model.type` "whisper") add `model.encoder`: the encoder file, whose outputs
  are the cross-attention KV of every layer (`present_key_cross_%d`, ...), which the decoder takes
  as inputs of its own (`past_key_cross_%d`, ...) at every step.

`read_folder(folder, variant=None)` returns a `FolderLayout`; for Whisper, `whisper_encoder(layout)`
gives the encoder file beside its decoder (Optimum: `encoder_model.onnx` at the top).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from runnx.errors import RunnxError
from runnx.generate.io_names import DecoderFiles, DecoderIO, KVName, find_decoder_files

GENAI_CONFIG = "genai_config.json"
TRANSFORMERS_JS_DIR = "onnx"
DECODER_BASES = ("model", "decoder_model_merged")  # transformers.js file names before the variant suffix
ENCODER_BASES = ("encoder_model",)  # Whisper's encoder, in the same variants
# variant -> file suffixes tried in order ("" is the fp32 file); q8 is transformers.js's name for model_quantized
VARIANTS = {"fp32": ("",), "fp16": ("_fp16",), "quantized": ("_quantized",), "q8": ("_quantized",),
            "int8": ("_int8", "_quantized"), "uint8": ("_uint8",), "q4": ("_q4",), "q4f16": ("_q4f16",),
            "bnb4": ("_bnb4",)}
# genai_config.json's search options that Generator reads as generation_config.json's
_SEARCH_SETTINGS = ("do_sample", "temperature", "top_k", "top_p", "repetition_penalty")


class LayoutError(RunnxError):
    """A model folder's layout is incomplete or its config is malformed."""


@dataclass(frozen=True)
class GenaiEncoder:
    """An onnxruntime-genai encoder-decoder's encoder (Whisper): its file, its input, and the
    cross-attention KV it computes for every layer, under the names the decoder takes them by."""

    filename: str
    input_name: str  # the audio features
    present_key: str  # its outputs, name templates with %d for the layer
    present_value: str
    past_key: str  # the decoder's inputs that take them
    past_value: str
    num_layers: int

    def cross_names(self) -> tuple[tuple[str, str], ...]:
        """(encoder output, decoder input) of every layer's cross-attention key and value."""
        return tuple((present % layer, past % layer) for layer in range(self.num_layers)
                     for present, past in ((self.present_key, self.past_key), (self.present_value, self.past_value)))


@dataclass(frozen=True)
class GenaiConfig:
    """What runnx uses of an onnxruntime-genai `genai_config.json` (decoder-only models and
    Whisper)."""

    filename: str
    input_names: dict[str, str]  # role -> model input: input_ids, attention_mask, position_ids
    logits: str
    past_key: str  # name templates with %d for the layer
    past_value: str
    present_key: str
    present_value: str
    num_layers: int
    kv_heads: int
    head_size: int
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    bos_token_id: int | None
    context_length: int | None
    share_buffer: bool
    search: dict = field(default_factory=dict)  # do_sample, temperature, ... when the config sets them
    encoder: GenaiEncoder | None = None  # an encoder-decoder's (Whisper's)
    vocab_size: int | None = None

    def kv_names(self) -> tuple[KVName, ...]:
        return tuple(KVName(layer, "", kind, past % layer, present % layer)
                     for layer in range(self.num_layers)
                     for kind, past, present in (("key", self.past_key, self.present_key),
                                                 ("value", self.past_value, self.present_value)))

    def decoder_io(self, input_names, output_names) -> DecoderIO:
        """The roles of the model's inputs and outputs as the config names them, each checked."""
        inputs, outputs = list(input_names), list(output_names)
        kv = self.kv_names()
        for name in (self.input_names["input_ids"], *(k.past for k in kv)):
            if name not in inputs:
                raise LayoutError(f"{GENAI_CONFIG} names the input '{name}', which {self.filename} lacks "
                                  f"(its inputs: {', '.join(inputs)})")
        for name in (self.logits, *(k.present for k in kv)):
            if name not in outputs:
                raise LayoutError(f"{GENAI_CONFIG} names the output '{name}', which {self.filename} lacks "
                                  f"(its outputs: {', '.join(outputs)})")
        for _, name in self.encoder.cross_names() if self.encoder else ():
            if name not in inputs:
                raise LayoutError(f"{GENAI_CONFIG} names the cross-attention input '{name}', which {self.filename} "
                                  f"lacks (its inputs: {', '.join(inputs)})")
        roles = {role: (name if name in inputs else None) for role, name in self.input_names.items()}
        named = {*self.input_names.values(), *(k.past for k in kv)}
        return DecoderIO(input_ids=self.input_names["input_ids"], logits=self.logits,
                         attention_mask=roles.get("attention_mask"), position_ids=roles.get("position_ids"),
                         cache_position=None, use_cache_branch=None, kv=kv,
                         other_inputs=tuple(name for name in inputs if name not in named))

    @property
    def generation_config(self) -> dict:
        """The stop, pad and sampling defaults, as generation_config.json would state them."""
        config = {"eos_token_id": list(self.eos_token_ids), **self.search}
        if self.pad_token_id is not None:
            config["pad_token_id"] = self.pad_token_id
        if self.bos_token_id is not None:
            config["bos_token_id"] = self.bos_token_id
        return config


def parse_genai_config(data: dict, where: str = GENAI_CONFIG) -> GenaiConfig:
    """Check and read a parsed genai_config.json; a LayoutError names the first thing wrong."""
    def section(parent: dict, key: str, path: str) -> dict:
        value = parent.get(key)
        if not isinstance(value, dict):
            raise LayoutError(f"{where}: {path}.{key} must be an object, got {_shown(value)}")
        return value

    def number(parent: dict, key: str, path: str, *, required: bool = True) -> int | None:
        value = parent.get(key)
        if value is None and not required:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise LayoutError(f"{where}: {path}.{key} must be a non-negative integer, got {_shown(value)}")
        return value

    def template(names: dict, key: str, default: str, path: str) -> str:
        value = names.get(key, default)
        if not isinstance(value, str) or value.count("%d") != 1:
            raise LayoutError(f"{where}: {path}.{key} must be a name with one %d for the layer, got {_shown(value)}")
        return value

    if not isinstance(data, dict):
        raise LayoutError(f"{where}: expected a JSON object, got {_shown(data)}")
    model = section(data, "model", "")
    if "encoder" in model and model.get("type") != "whisper":
        raise LayoutError(f"{where}: an encoder-decoder ({model.get('type')}) onnxruntime-genai folder; runnx reads "
                          "decoder-only genai folders and Whisper's")
    decoder = section(model, "decoder", "model")
    inputs = decoder.get("inputs", {})
    outputs = decoder.get("outputs", {})
    for key, value in (("inputs", inputs), ("outputs", outputs)):
        if not isinstance(value, dict):
            raise LayoutError(f"{where}: model.decoder.{key} must be an object, got {_shown(value)}")
    filename = decoder.get("filename")
    if not isinstance(filename, str) or not filename:
        raise LayoutError(f"{where}: model.decoder.filename must name the ONNX file, got {_shown(filename)}")
    eos = model.get("eos_token_id")
    eos_ids = eos if isinstance(eos, list) else [eos]
    if not eos_ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in eos_ids):
        raise LayoutError(f"{where}: model.eos_token_id must be a token id or a list of them, got {_shown(eos)}")
    search = data.get("search", {})
    if not isinstance(search, dict):
        raise LayoutError(f"{where}: search must be an object, got {_shown(search)}")
    share = search.get("past_present_share_buffer", False)
    if not isinstance(share, bool):
        raise LayoutError(f"{where}: search.past_present_share_buffer must be true or false, got {_shown(share)}")
    input_names = {role: inputs.get(role, role) for role in ("input_ids", "attention_mask", "position_ids")}
    for role, name in input_names.items():
        if not isinstance(name, str):
            raise LayoutError(f"{where}: model.decoder.inputs.{role} must be a name, got {_shown(name)}")
    logits = outputs.get("logits", "logits")
    if not isinstance(logits, str):
        raise LayoutError(f"{where}: model.decoder.outputs.logits must be a name, got {_shown(logits)}")
    encoder = None
    if model.get("type") == "whisper":
        encoder_section = section(model, "encoder", "model")
        encoder_inputs, encoder_outputs = encoder_section.get("inputs", {}), encoder_section.get("outputs", {})
        for key, value in (("inputs", encoder_inputs), ("outputs", encoder_outputs)):
            if not isinstance(value, dict):
                raise LayoutError(f"{where}: model.encoder.{key} must be an object, got {_shown(value)}")
        encoder_file = encoder_section.get("filename")
        features = encoder_inputs.get("audio_features", "audio_features")
        if not isinstance(encoder_file, str) or not encoder_file or not isinstance(features, str):
            raise LayoutError(f"{where}: model.encoder must name its ONNX file (filename) and its audio_features "
                              f"input, got {_shown(encoder_file)} and {_shown(features)}")
        encoder = GenaiEncoder(
            filename=encoder_file, input_name=features,
            present_key=template(encoder_outputs, "cross_present_key_names", "present_key_cross_%d",
                                 "model.encoder.outputs"),
            present_value=template(encoder_outputs, "cross_present_value_names", "present_value_cross_%d",
                                   "model.encoder.outputs"),
            past_key=template(inputs, "cross_past_key_names", "past_key_cross_%d", "model.decoder.inputs"),
            past_value=template(inputs, "cross_past_value_names", "past_value_cross_%d", "model.decoder.inputs"),
            num_layers=number(decoder, "num_hidden_layers", "model.decoder"))
    return GenaiConfig(
        filename=filename, input_names=input_names, logits=logits, encoder=encoder,
        vocab_size=number(model, "vocab_size", "model", required=False),
        past_key=template(inputs, "past_key_names", "past_key_values.%d.key", "model.decoder.inputs"),
        past_value=template(inputs, "past_value_names", "past_key_values.%d.value", "model.decoder.inputs"),
        present_key=template(outputs, "present_key_names", "present.%d.key", "model.decoder.outputs"),
        present_value=template(outputs, "present_value_names", "present.%d.value", "model.decoder.outputs"),
        num_layers=number(decoder, "num_hidden_layers", "model.decoder"),
        kv_heads=number(decoder, "num_key_value_heads", "model.decoder"),
        head_size=number(decoder, "head_size", "model.decoder"),
        eos_token_ids=tuple(eos_ids), pad_token_id=number(model, "pad_token_id", "model", required=False),
        bos_token_id=number(model, "bos_token_id", "model", required=False),
        context_length=number(model, "context_length", "model", required=False), share_buffer=share,
        search={key: search[key] for key in _SEARCH_SETTINGS if key in search})


def _shown(value) -> str:
    text = json.dumps(value) if value is not None else "nothing"
    return text if len(text) <= 60 else text[:57] + "..."


def read_genai_config(folder) -> GenaiConfig:
    path = Path(folder) / GENAI_CONFIG
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as error:
        raise LayoutError(f"{path} is not valid JSON: {error}") from None
    return parse_genai_config(data, str(path))


@dataclass(frozen=True)
class FolderLayout:
    """How to run one folder's decoder. `config` is what DecoderStep reads the KV heads and head
    size from when the past inputs do not declare them; `generation_config` gives stop, pad and
    sampling defaults; `genai` is set for onnxruntime-genai folders."""

    kind: str  # 'optimum', 'transformers.js' or 'onnxruntime-genai'
    folder: Path
    files: DecoderFiles
    config: dict
    generation_config: dict
    variant: str | None = None  # the transformers.js variant chosen
    genai: GenaiConfig | None = None

    def decoder_io(self, model) -> DecoderIO | None:
        """Explicit input/output roles (genai folders), or None to discover them from the names."""
        if self.genai is None:
            return None
        return self.genai.decoder_io(model.input_names, model.output_names)

    @property
    def share_buffer(self) -> bool:
        return self.genai is not None and self.genai.share_buffer

    @property
    def context_length(self) -> int | None:
        if self.genai is not None:
            return self.genai.context_length
        return self.config.get("max_position_embeddings")


def read_folder(folder, variant: str | None = None) -> FolderLayout:
    """The layout of a decoder folder (see the module docstring); `variant` chooses among a
    transformers.js folder's files."""
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise LayoutError(f"{folder} is not a folder")
    config = _read_json(folder / "config.json")
    generation_config = _read_json(folder / "generation_config.json")
    if (folder / GENAI_CONFIG).is_file():
        if variant is not None:
            raise LayoutError(f"variant={variant!r} chooses among a transformers.js folder's onnx/model_*.onnx "
                              f"files; {folder} is an onnxruntime-genai folder (one model, {GENAI_CONFIG})")
        genai = read_genai_config(folder)
        path = folder / genai.filename
        if not path.is_file():
            raise LayoutError(f"{folder / GENAI_CONFIG} names the model {genai.filename}, which is not in {folder}")
        kv_config = {"num_key_value_heads": genai.kv_heads, "head_dim": genai.head_size}
        return FolderLayout("onnxruntime-genai", folder, DecoderFiles("single", path, path), kv_config,
                            {**generation_config, **genai.generation_config}, genai=genai)
    variants = transformers_js_variants(folder)
    top_level = any((folder / name).is_file() for name in ("model.onnx", "decoder_model_merged.onnx",
                                                           "decoder_model.onnx"))
    if variants and not top_level:
        chosen = variant or ("fp32" if "fp32" in variants else None)
        if chosen is None and len(variants) == 1:
            chosen = next(iter(variants))
        if chosen is None:
            raise LayoutError(f"{folder} holds several decoder variants and no fp32 model.onnx: choose one with "
                              f"variant= (--variant): {', '.join(variants)}")
        path = _variant_file(folder, chosen, variants)
        return FolderLayout("transformers.js", folder, DecoderFiles("single", path, path), config,
                            generation_config, variant=chosen)
    if variant is not None:
        raise LayoutError(f"variant={variant!r} chooses among a transformers.js folder's "
                          f"{TRANSFORMERS_JS_DIR}/model_*.onnx files; {folder} has none")
    return FolderLayout("optimum", folder, find_decoder_files(folder), config, generation_config)


def transformers_js_variants(folder, bases=DECODER_BASES) -> dict[str, Path]:
    """The variants of a folder's onnx/ files named `base[_variant].onnx` for one of `bases`
    (default: the decoder's): variant name -> file ('fp32' for the file without a suffix)."""
    subfolder = Path(folder) / TRANSFORMERS_JS_DIR
    if not subfolder.is_dir():
        return {}
    pattern = re.compile(r"^(?:%s)(_[a-z0-9]+)?\.onnx$" % "|".join(bases))
    found = {}
    for path in sorted(subfolder.iterdir()):
        match = pattern.match(path.name)
        if match and path.is_file():
            found.setdefault((match.group(1) or "_fp32")[1:], path)
    return found


def whisper_encoder(layout: FolderLayout) -> Path:
    """The encoder that goes with a Whisper folder's decoder: `encoder_model.onnx` beside an Optimum
    export, the same variant's `onnx/encoder_model[_variant].onnx` in a transformers.js folder, the
    file genai_config.json names in an onnxruntime-genai folder."""
    if layout.genai is not None:
        if layout.genai.encoder is None:
            raise LayoutError(f"{layout.folder / GENAI_CONFIG} describes a decoder-only model (no model.encoder): "
                              "not a Whisper folder")
        path = layout.folder / layout.genai.encoder.filename
        if not path.is_file():
            raise LayoutError(f"{layout.folder / GENAI_CONFIG} names the encoder {layout.genai.encoder.filename}, "
                              f"which is not in {layout.folder}")
        return path
    if layout.kind == "transformers.js":
        encoders = transformers_js_variants(layout.folder, ENCODER_BASES)
        if not encoders:
            raise LayoutError(f"{layout.folder / TRANSFORMERS_JS_DIR} has no encoder_model*.onnx (a transformers.js "
                              "Whisper folder holds encoder_model[_variant].onnx beside "
                              "decoder_model_merged[_variant].onnx)")
        return _variant_file(layout.folder, layout.variant, encoders, "encoder ")
    return layout.folder / "encoder_model.onnx"


def is_whisper(layout: FolderLayout) -> bool:
    """Whether the folder holds Whisper (speech to text: an encoder beside the decoder) rather than
    a text decoder."""
    if layout.genai is not None:
        return layout.genai.encoder is not None
    return (layout.config.get("model_type") == "whisper" or (layout.folder / "encoder_model.onnx").is_file()
            or bool(transformers_js_variants(layout.folder, ENCODER_BASES)))


def _variant_file(folder: Path, variant: str, present: dict[str, Path], what: str = "") -> Path:
    if variant in present:
        return present[variant]
    suffixes = VARIANTS.get(variant)
    if suffixes is not None:
        for suffix in suffixes:
            name = suffix[1:] or "fp32"
            if name in present:
                return present[name]
    known = "" if suffixes is not None else f" ('{variant}' is not a variant runnx knows: {', '.join(VARIANTS)})"
    raise LayoutError(f"{folder / TRANSFORMERS_JS_DIR} has no {what}{variant} variant{known}; the {what}variants "
                      f"present: {', '.join(present)}")


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except ValueError as error:
        raise LayoutError(f"{path} is not valid JSON: {error}") from None
