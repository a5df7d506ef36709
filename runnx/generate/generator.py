"""The generation loop: a step API like onnxruntime-genai's, and iterators of token ids and text on top.

    gen = Generator.from_folder("smollm2-135m")
    print(gen.generate("The capital of France is", max_new_tokens=20))
    for piece in gen.stream("Tell me a story", do_sample=True, temperature=0.7, seed=0):
        print(piece, end="", flush=True)

    gen.start(max_new_tokens=8)                  # step by step
    gen.append_tokens(gen.tokenizer.encode("Hello"))
    while not gen.is_done():
        gen.generate_next_token()
        print(gen.get_next_tokens())             # one id per batch row

Tokens are fed to the model lazily: a sampled token is run only when the next one is asked for, so
`decoder.length` counts the tokens whose KV is cached and a stop token is never run (a chat turn or
a saved state can continue from exactly there). Rows of a batch are left-padded and stop on their own.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace

import numpy as np

from runnx.errors import RunnxError
from runnx.generate.decoder import DecoderStep
from runnx.generate.layouts import LayoutError, is_whisper, read_folder
from runnx.generate.sampling import Multinomial, apply_processors, argmax, build_processors
from runnx.generate.tokenizer import TextStream, Tokenizer, as_tokenizer


SAMPLING_SETTINGS = ("temperature", "top_k", "top_p", "min_p")
CAPACITY_STEP = 256  # a generation's KV capacity is a multiple of this many rows (`compute_logits`)


@dataclass(frozen=True)
class GenerationOptions:
    """Decoding settings. do_sample=None samples as soon as a sampling setting is given. Settings
    left at None take generation_config.json's value (as transformers does), greedy by default."""

    max_new_tokens: int | None = 256
    max_length: int | None = None  # prompt + generated tokens
    do_sample: bool | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop_token_ids: tuple[int, ...] | None = None  # None: eos_token_id of generation_config.json
    stop_strings: tuple[str, ...] = ()
    processors: tuple = ()  # your own (token_ids, scores) -> scores, run after the built-in ones

    @property
    def sampling(self) -> bool:
        if self.do_sample is not None:
            return self.do_sample
        return any(getattr(self, name) is not None for name in SAMPLING_SETTINGS)


@dataclass
class GenerationStats:
    """Timings of the last generation: time to first token covers running the prompt."""

    prompt_tokens: int = 0
    new_tokens: int = 0
    first_token_seconds: float = 0.0
    total_seconds: float = 0.0

    @property
    def prompt_tokens_per_second(self) -> float:
        return self.prompt_tokens / self.first_token_seconds if self.first_token_seconds else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        """Tokens per second after the first one (each of them one decoder step)."""
        seconds = self.total_seconds - self.first_token_seconds
        return (self.new_tokens - 1) / seconds if self.new_tokens > 1 and seconds > 0 else 0.0


class RowText:
    """Decoded text of one row's generated tokens, cut at the first stop string (the Generator's
    rows, and each request of the server's batches: runnx/serve/scheduler.py)."""

    def __init__(self, tokenizer: Tokenizer, stop_strings: tuple[str, ...]):
        self.stream = TextStream(tokenizer)
        self.stop_strings = stop_strings
        self.text = ""
        self.emitted = 0  # characters already handed out
        self.stopped = False

    def put(self, token_id: int) -> None:
        self._add(self.stream.put(token_id))

    def finish(self) -> None:
        if not self.stopped:
            self._add(self.stream.flush())

    def _add(self, piece: str) -> None:
        if not piece or self.stopped:
            return
        # a stop string may straddle the previous text and this piece
        start = max(0, len(self.text) - max((len(s) for s in self.stop_strings), default=0))
        self.text += piece
        hits = [i for i in (self.text.find(s, start) for s in self.stop_strings) if i >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            self.stopped = True

    def take(self, final: bool) -> str:
        """New text that can no longer turn out to be the start of a stop string."""
        end = len(self.text)
        if not final and not self.stopped:
            end -= self._held_back()
        piece = self.text[self.emitted:end]
        self.emitted = max(self.emitted, end)
        return piece

    def _held_back(self) -> int:
        longest = 0
        for stop in self.stop_strings:
            for size in range(min(len(stop) - 1, len(self.text)), longest, -1):
                if self.text.endswith(stop[:size]):
                    longest = size
                    break
        return longest


class Generator:
    """Drives a `DecoderStep`: feeds tokens, chooses the next ones, stops rows, decodes text."""

    def __init__(self, decoder: DecoderStep, tokenizer=None, generation_config: dict | None = None):
        self.decoder = decoder
        self.tokenizer = as_tokenizer(tokenizer) if tokenizer is not None else None
        self.generation_config = dict(generation_config or {})
        self.options = GenerationOptions()
        self.stats = GenerationStats()
        self.reset()

    @classmethod
    def from_folder(cls, folder, *, capacity: int = 256, profile=None, load=None, variant: str | None = None,
                    share_buffer: bool | None = None) -> "Generator":
        """A model folder with its tokenizer: an Optimum export, a transformers.js download (its
        onnx/ `variant`: fp32, fp16, int8, q4, ...) or an onnxruntime-genai folder (layouts.py);
        `share_buffer` None: the KV buffer is shared between past and present as genai_config.json says."""
        layout = read_folder(folder, variant)
        if is_whisper(layout):
            raise LayoutError(f"{layout.folder} holds Whisper, a speech-to-text model: transcribe audio with "
                              f"`runnx whisper {layout.folder} AUDIO` (or runnx.generate.transcribe)")
        decoder = DecoderStep.from_folder(layout.folder, capacity=capacity, profile=profile, load=load,
                                          share_buffer=share_buffer, layout=layout)
        tokenizer = Tokenizer.from_folder(layout.folder) if (layout.folder / "tokenizer.json").is_file() else None
        return cls(decoder, tokenizer, layout.generation_config)

    @classmethod
    def from_model(cls, model, tokenizer=None, *, with_past=None, config: dict | None = None,
                   generation_config: dict | None = None, capacity: int = 256, profile=None) -> "Generator":
        """A loaded runnx Model (plus `with_past` for a decoder_model/decoder_with_past pair)."""
        decoder = DecoderStep(model, with_past, capacity=capacity, config=config, profile=profile)
        return cls(decoder, tokenizer, generation_config)

    # -- step API ----------------------------------------------------------------------------
    def reset(self, batch_size: int = 1) -> None:
        """Forget all tokens and the KV cache."""
        self.decoder.reset(batch_size)
        self.token_ids = np.zeros((batch_size, 0), np.int64)  # every token, fed or not
        self.attention_mask = np.zeros((batch_size, 0), np.int64)
        self._logits = None
        self.configure()

    def start(self, options: GenerationOptions | None = None, **settings) -> None:
        """reset() then configure(): a fresh generation."""
        self.reset()
        self.configure(options, **settings)

    def configure(self, options: GenerationOptions | None = None, **settings) -> None:
        """Settings for the tokens generated from now on; the tokens so far (and their cache) stay."""
        options = self._with_config_defaults(replace(options or GenerationOptions(), **settings))
        batch = self.batch_size
        self.options = options
        self.stop_token_ids = set(options.stop_token_ids if options.stop_token_ids is not None
                                  else self._config_ids("eos_token_id"))
        self.processors = build_processors(
            temperature=options.temperature if options.sampling else None,
            top_k=options.top_k if options.sampling else None,
            top_p=options.top_p if options.sampling else None,
            min_p=options.min_p if options.sampling else None,
            repetition_penalty=options.repetition_penalty) + list(options.processors)
        self.sampler = Multinomial(options.seed) if options.sampling else argmax
        if options.stop_strings and self.tokenizer is None:
            raise RunnxError("stop strings need a tokenizer")
        self.generated: list[list[int]] = [[] for _ in range(batch)]
        self.done = np.zeros(batch, bool)
        self._texts = [RowText(self.tokenizer, tuple(options.stop_strings)) for _ in range(batch)] \
            if self.tokenizer is not None else None
        self._next = np.zeros(batch, np.int64)
        self._started_at = None
        self.stats = GenerationStats()

    def _with_config_defaults(self, options: GenerationOptions) -> GenerationOptions:
        config = self.generation_config
        do_sample = options.do_sample
        if do_sample is None:  # a sampling setting of the caller's means sampling; else the config decides
            do_sample = options.sampling or bool(config.get("do_sample", False))
        defaults = {name: config[name] for name in (*SAMPLING_SETTINGS, "repetition_penalty")
                    if getattr(options, name) is None and config.get(name) is not None}
        return replace(options, do_sample=do_sample, **defaults)

    @property
    def batch_size(self) -> int:
        return self.decoder.batch_size

    def append_tokens(self, token_ids, attention_mask=None) -> None:
        """Add tokens (one row: a list of ids; a batch: [batch, n] left-padded, with its mask).
        They run through the model when the next token is asked for."""
        ids = np.asarray(token_ids, np.int64)
        if ids.ndim == 1:
            ids = ids[None]
        if ids.shape[0] != self.batch_size:
            raise RunnxError(f"{ids.shape[0]} rows of tokens for a batch of {self.batch_size}: reset(batch_size) first")
        mask = np.ones_like(ids) if attention_mask is None else np.asarray(attention_mask, np.int64)
        self.token_ids = np.concatenate([self.token_ids, ids], axis=1)
        self.attention_mask = np.concatenate([self.attention_mask, mask], axis=1)
        self._logits = None

    def rewind(self, length: int) -> None:
        """Keep only the first `length` tokens (the cache is shortened, not recomputed)."""
        self.token_ids = self.token_ids[:, :length]
        self.attention_mask = self.attention_mask[:, :length]
        self.decoder.truncate(length)
        self._logits = None

    def compute_logits(self) -> np.ndarray:
        """Run the tokens not yet in the cache; the last position's logits [batch, vocab]."""
        if self._logits is None:
            fed = self.decoder.length
            pending = self.token_ids[:, fed:]
            if pending.shape[1] == 0:
                raise RunnxError("no tokens to run: append_tokens() first")
            if fed == 0 and not self.decoder.started:  # the whole generation's rows, in steps of CAPACITY_STEP
                # (untouched rows cost no memory; equal capacities let the next prefill take these buffers)
                rows = -(-self._length_limit() // CAPACITY_STEP) * CAPACITY_STEP
                self.decoder.capacity = max(self.decoder.capacity, rows)
            self._logits = self.decoder.step(pending, self.attention_mask[:, fed:])[:, -1]
        return self._logits

    def generate_next_token(self) -> np.ndarray:
        """Choose one token per row (rows already done get the pad token) and return them."""
        if self.is_done():
            raise RunnxError("generation is done: configure() or start() a new one")
        if self._started_at is None:
            self._started_at = time.perf_counter()
            self.stats.prompt_tokens = self.token_ids.shape[1] - self.decoder.length
        scores = self.compute_logits().astype(np.float32)
        scores = apply_processors(self.processors, self.token_ids, scores)
        chosen = np.where(self.done, self._pad_id(), self.sampler(scores))
        self.append_tokens(chosen[:, None])
        for row, token in enumerate(chosen.tolist()):
            if self.done[row]:
                continue
            self.generated[row].append(token)
            self._check_stop(row, token)
        self._next = chosen
        elapsed = time.perf_counter() - self._started_at
        if self.stats.new_tokens == 0:
            self.stats.first_token_seconds = elapsed
        self.stats.new_tokens += 1
        self.stats.total_seconds = elapsed
        return chosen

    def run_until_done(self) -> list[list[int]]:
        """generate_next_token() until every row is done; the generated ids per row."""
        while not self.is_done():
            self.generate_next_token()
        return self.generated

    def get_next_tokens(self) -> np.ndarray:
        return self._next

    def is_done(self) -> bool:
        return all(self.done.tolist())  # numpy's all() on a few rows costs microseconds, twice a token

    def _check_stop(self, row: int, token: int) -> None:
        options = self.options
        if token in self.stop_token_ids:
            self.done[row] = True
            return
        if self._texts is not None:
            self._texts[row].put(token)
            self.done[row] = self._texts[row].stopped
        if options.max_new_tokens is not None and len(self.generated[row]) >= options.max_new_tokens:
            self.done[row] = True
        if options.max_length is not None and self.token_ids.shape[1] >= options.max_length:
            self.done[row] = True

    def text(self, row: int = 0, final: bool | None = None) -> str:
        """The text generated for a row since the last call (held back while it could still
        become a stop string; everything once the row is done)."""
        if self._texts is None:
            raise RunnxError("text needs a tokenizer")
        row_text = self._texts[row]
        final = self.done[row] if final is None else final
        if final:
            row_text.finish()
        return row_text.take(final)

    def _length_limit(self) -> int:
        limits = []
        if self.options.max_new_tokens is not None:
            limits.append(self.token_ids.shape[1] + self.options.max_new_tokens)
        if self.options.max_length is not None:
            limits.append(self.options.max_length)
        return min(limits) if limits else 0

    def _config_ids(self, key: str) -> list[int]:
        value = self.generation_config.get(key)
        if value is None:
            return []
        return [int(v) for v in value] if isinstance(value, list) else [int(value)]

    def _pad_id(self) -> int:
        pads = self._config_ids("pad_token_id") or self._config_ids("eos_token_id")
        return pads[0] if pads else 0

    # -- iterators and one-call generation ------------------------------------------------------
    def encode(self, prompt, add_special_tokens: bool = True) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RunnxError("a text prompt needs a tokenizer: pass token ids")
            return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        return [int(t) for t in prompt]

    def token_stream(self, prompt, **settings):
        """Yield generated token ids (stop tokens excluded) for one prompt (text or ids)."""
        self.start(**settings)
        self.append_tokens(self.encode(prompt))
        while not self.is_done():
            token = int(self.generate_next_token()[0])
            if token not in self.stop_token_ids:
                yield token

    def stream(self, prompt, **settings):
        """Yield text pieces as soon as they are valid UTF-8 (and not part of a stop string)."""
        self.start(**settings)
        self.append_tokens(self.encode(prompt))
        yield from self.continue_stream()

    def continue_stream(self):
        """Generate from the current tokens with the configured settings, yielding text pieces."""
        while not self.is_done():
            self.generate_next_token()
            piece = self.text(0)
            if piece:
                yield piece
        piece = self.text(0, final=True)
        if piece:
            yield piece

    def generate(self, prompt, **settings) -> str:
        return "".join(self.stream(prompt, **settings))

    def generate_batch(self, prompts, **settings) -> list[str]:
        """Several prompts at once (left padding); each row stops on its own."""
        rows = [self.encode(p) for p in prompts]
        width = max(len(r) for r in rows)
        ids = np.full((len(rows), width), self._pad_id(), np.int64)
        mask = np.zeros((len(rows), width), np.int64)
        for i, row in enumerate(rows):
            ids[i, width - len(row):] = row
            mask[i, width - len(row):] = 1
        self.reset(len(rows))
        self.configure(**settings)
        self.append_tokens(ids, mask)
        self.run_until_done()
        if self._texts is None:
            raise RunnxError("generate_batch returns text: it needs a tokenizer (use the step API for ids)")
        return [self.text(row, final=True) for row in range(len(rows))]
