"""The models a server holds, one per folder, named by the folder: a language model with
tokenizer.json served by a `BatchScheduler`, or Whisper in any layout (`layouts.is_whisper`) whose
transcriptions run one at a time. Folders are read as
`generate/layouts.py` reads them (Optimum, transformers.js with a variant, onnxruntime-genai), so
the server stops, pads and bounds the context as `runnx generate` does on the same folder."""
from __future__ import annotations

import json
import threading
from pathlib import Path

from runnx.errors import RunnxError
from runnx.generate.chat import compile_template
from runnx.generate.decoder import DecoderStep
from runnx.generate.layouts import ENCODER_BASES, is_whisper, read_folder, transformers_js_variants
from runnx.generate.tokenizer import Tokenizer
from runnx.serve.errors import ApiError
from runnx.serve.scheduler import BatchScheduler

CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length")
BATCH_CAPACITY = 64  # first KV rows reserved per batch cache (it doubles when short)
UNKNOWN_CONTEXT_TOKENS = 4096  # max_tokens when neither the request nor config.json bounds it


class LanguageModel:
    """A decoder with its tokenizer, chat template, context length and decode loop."""

    kind = "text"

    def __init__(self, folder: Path, *, max_batch: int = 16, variant: str | None = None):
        """`variant` chooses a transformers.js folder's onnx/ file (layouts.VARIANTS)."""
        self.folder = folder
        self.id = folder.name
        if not (folder / "tokenizer.json").is_file():
            raise RunnxError(f"{folder} has no tokenizer.json: the server takes and returns text")
        layout = read_folder(folder, variant)
        self.layout = layout
        self.tokenizer = Tokenizer.from_folder(folder)
        self.config = _read_json(folder / "config.json")
        self.generation_config = layout.generation_config
        self.template = compile_template(self.tokenizer.chat_template) if self.tokenizer.chat_template else None
        self.context = layout.genai.context_length if layout.genai is not None else None
        self.context = self.context or next((int(self.config[key]) for key in CONTEXT_KEYS if self.config.get(key)),
                                            None)
        # A batch grows and shrinks by stacking and cutting KV rows, so each row keeps a cache of its own
        # (never a shared past/present buffer); a model that cannot take left-padded rows (its
        # attention finds each row's length from the mask) decodes one request at a time.
        decoder = DecoderStep.from_folder(folder, capacity=BATCH_CAPACITY, layout=layout, share_buffer=False)
        with_past = decoder.past_model if decoder.past_model is not decoder.first_model else None
        prefill = DecoderStep(decoder.first_model, with_past, capacity=1, config=layout.config,
                              io=layout.decoder_io(decoder.first_model), context_length=decoder.context_length,
                              padding=decoder.padding)
        self.max_batch = max_batch if decoder.padding else 1
        self.scheduler = BatchScheduler(decoder, prefill, self.tokenizer, self.generation_config,
                                        self._stop_ids(), max_batch=self.max_batch, name=self.id)

    def _stop_ids(self) -> set[int]:
        """generation_config.json's eos_token_id(s) and the tokenizer's eos_token."""
        value = self.generation_config.get("eos_token_id")
        ids = set(value if isinstance(value, list) else [] if value is None else [value])
        eos = self.tokenizer.special_tokens.get("eos_token")
        if eos is not None and self.tokenizer.token_id(eos) is not None:
            ids.add(self.tokenizer.token_id(eos))
        return {int(i) for i in ids}

    def chat_prompt(self, messages: list[dict]) -> list[int]:
        if self.template is None:
            raise ApiError(f"the model '{self.id}' has no chat template: use /v1/completions", param="messages",
                           code="no_chat_template")
        try:
            text = self.template.render(messages=messages, add_generation_prompt=True,
                                        **self.tokenizer.special_tokens)
        except Exception as error:  # the template's own raise_exception() or a Jinja error
            raise ApiError(f"the chat template rejected the messages: {error}", param="messages") from None
        return self.tokenizer.encode(text, add_special_tokens=False)

    def text_prompt(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        vocabulary = self.tokenizer.tokenizer.get_vocab_size(with_added_tokens=True)
        if any(not 0 <= t < vocabulary for t in prompt):
            raise ApiError(f"'prompt' holds token ids outside the vocabulary (0..{vocabulary - 1})", param="prompt")
        return list(prompt)

    def budget(self, prompt_ids: list[int], max_tokens: int | None, default: int | None, *,
               limit_param: str, prompt_param: str) -> int:
        """The tokens this request may generate: max_tokens (else `default`, else up to the context),
        refused when the prompt or prompt + max_tokens do not fit the context."""
        if not prompt_ids:
            raise ApiError("the prompt is empty (0 tokens)", param=prompt_param)
        context = self.context
        if context is None:  # no length in config.json: the cache grows as needed
            return max_tokens or default or UNKNOWN_CONTEXT_TOKENS
        room = context - len(prompt_ids)
        if room < 1:
            raise ApiError(f"the prompt has {len(prompt_ids)} tokens; the model's context is {context} tokens",
                           param=prompt_param, code="context_length_exceeded")
        if max_tokens is not None and max_tokens > room:
            raise ApiError(f"'{limit_param}' is {max_tokens}, but the {len(prompt_ids)}-token prompt leaves "
                           f"{room} of the model's {context}-token context", param=limit_param,
                           code="context_length_exceeded")
        return min(max_tokens or default or room, room)

    def start(self) -> None:
        self.scheduler.start()

    def close(self) -> None:
        self.scheduler.close()


class SpeechModel:
    """A Whisper export; its encoder and decoder run one transcription at a time."""

    kind = "audio"

    def __init__(self, folder: Path, *, variant: str | None = None):
        from runnx.generate.whisper import Whisper
        self.folder = folder
        self.id = folder.name
        self.whisper = Whisper(folder, variant=variant)
        self.lock = threading.Lock()

    def transcribe(self, path: str, *, language: str | None, timestamps: bool | None):
        """`timestamps` True asks for timed segments; a model without timestamp tokens gives one
        segment per 30 s window instead."""
        if timestamps and self.whisper.tokens.timestamp_begin is None:
            timestamps = None
        with self.lock:
            return self.whisper.transcribe(path, language=language, timestamps=timestamps)

    def start(self) -> None:
        pass

    def close(self) -> None:
        pass


def load_models(folders, *, max_batch: int = 16, variant: str | None = None) -> dict[str, LanguageModel | SpeechModel]:
    """The models of these folders by id (the folder name); `variant` chooses the file of every
    transformers.js folder among them (other folders have one model and ignore it)."""
    models = {}
    for folder in map(Path, folders):
        if not folder.is_dir():
            raise RunnxError(f"model folder not found: {folder}")
        folder = folder.resolve()
        if folder.name in models:
            raise RunnxError(f"two model folders are named '{folder.name}': model ids are folder names, "
                             "so they must differ")
        chosen = variant if transformers_js_variants(folder) or transformers_js_variants(folder, ENCODER_BASES) else None
        models[folder.name] = (SpeechModel(folder, variant=chosen) if is_whisper(read_folder(folder, chosen))
                               else LanguageModel(folder, max_batch=max_batch, variant=chosen))
    return models


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
