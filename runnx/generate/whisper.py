"""Speech to text with Whisper, from an Optimum export folder (`encoder_model.onnx` +
`decoder_model_merged.onnx`, config.json, generation_config.json, tokenizer.json), a folder in
the transformers.js layout (the same files in `onnx/`, in variants chosen by `variant=`) or an
onnxruntime-genai folder (genai_config.json names an encoder that computes the cross-attention KV
and a decoder that takes it at every step: layouts.py).

    from runnx.generate.whisper import transcribe
    transcript = transcribe("speech.wav", "whisper-tiny.en", timestamps=True)
    transcript.text, transcript.language, [(s.start, s.end, s.text) for s in transcript.segments]

How one 30 s window is decoded:

- features: log-mel of the whole audio (mel.py), sliced into 3000-frame windows;
- the encoder runs once per window; its hidden states are a fixed feed of the decoder, whose
  cross-attention KV is taken from the first step and whose self-attention KV grows in place in a
  buffer of `max_target_positions` (448) rows (`DecoderStep`);
- the prompt is <|startoftranscript|>, then for multilingual models <|lang|><|task|> (the language
  detected from the first step's logits when not given), then <|notimestamps|> unless timestamps
  are wanted;
- greedy decoding through the `Generator`, with Whisper's logits rules as its processors
  (`SuppressTokens`, `SuppressAtBegin`, `TimestampRules`), until <|endoftext|>.

Long audio: windows start where the previous window's last complete timestamp pair ended
(openai-whisper's seeking), or 30 s later in no-timestamp mode. Timestamp tokens count 20 ms steps
from the window's start.
"""
from __future__ import annotations

import functools
import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from runnx.capture.ownership import read_only_view
from runnx.errors import RunnxError
from runnx.generate.audio import SAMPLE_RATE, load_audio
from runnx.generate.decoder import DecoderStep
from runnx.generate.generator import Generator
from runnx.generate.layouts import ENCODER_BASES, GENAI_CONFIG, read_folder, transformers_js_variants, whisper_encoder
from runnx.generate.mel import FRAME_SECONDS, N_FRAMES, N_SAMPLES, log_mel_spectrogram, pad_or_trim
from runnx.generate.tokenizer import Tokenizer
from runnx.interp.model import load as runnx_load
from runnx.interp.quiet import BUSY
from runnx.runtime import start_pool_in_background

TIMESTAMP_SECONDS = 0.02  # one timestamp token step: 2 mel frames (the encoder halves the frames)
FRAMES_PER_TIMESTAMP = 2
_LANGUAGE_TOKEN = re.compile(r"^<\|([a-z]{2,3})\|>$")
TASKS = ("transcribe", "translate")
HIDDEN_STATES = "encoder_hidden_states"  # the decoder input fed the encoder's output


class WhisperError(RunnxError):
    """A Whisper folder or request that cannot be served (missing files, unknown language, ...)."""


# -- results ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Segment:
    """A stretch of speech: times in seconds from the start of the audio, its text, and the token ids
    decoded for it (timestamp tokens included in timestamp mode)."""

    start: float
    end: float
    text: str
    tokens: tuple[int, ...]


@dataclass
class Timings:
    """Where the time went, in seconds; `real_time_factor` = processing time / audio duration."""

    audio: float = 0.0
    features: float = 0.0
    encode: float = 0.0
    decode: float = 0.0
    windows: int = 0
    decoded_tokens: int = 0

    @property
    def total(self) -> float:
        return self.features + self.encode + self.decode

    @property
    def real_time_factor(self) -> float:
        return self.total / self.audio if self.audio else 0.0


@dataclass(frozen=True)
class Transcript:
    text: str
    segments: list[Segment]
    language: str | None
    timings: Timings = field(default_factory=Timings, compare=False)


# -- special tokens --------------------------------------------------------------------------------
@dataclass(frozen=True)
class WhisperTokens:
    """The special token ids and suppression lists of one Whisper model."""

    start_of_transcript: int
    end_of_text: int
    no_timestamps: int | None  # None: the model has no timestamp tokens (e.g. a tiny test model)
    multilingual: bool
    languages: dict  # language code ('en', 'de', ...) -> token id; empty when unknown
    tasks: dict  # 'transcribe' / 'translate' -> token id
    suppress: tuple[int, ...] = ()  # never generated
    suppress_at_begin: tuple[int, ...] = ()  # not as the first generated token (blank, end of text)
    max_initial_timestamp_index: int | None = None  # the first timestamp is at most this many steps in
    vocab_size: int | None = None

    @property
    def timestamp_begin(self) -> int | None:
        """Id of <|0.00|>: timestamp tokens follow <|notimestamps|>, one per 20 ms. None when the
        vocabulary ends at <|notimestamps|> (a model without timestamp tokens)."""
        if self.no_timestamps is None or (self.vocab_size is not None and self.no_timestamps + 1 >= self.vocab_size):
            return None
        return self.no_timestamps + 1

    @property
    def text_end(self) -> int:
        """Text tokens are the ids below the first special token other than <|endoftext|> (which
        tiny.en puts right after the text, and other vocabularies at 0)."""
        specials = [self.start_of_transcript, *self.languages.values(), *self.tasks.values()]
        if self.no_timestamps is not None:
            specials.append(self.no_timestamps)
        return min(specials)

    def is_text(self, token: int) -> bool:
        return token < self.text_end and token != self.end_of_text

    @classmethod
    def from_configs(cls, config: dict, generation: dict, special: dict[str, int]) -> "WhisperTokens":
        """From config.json, generation_config.json and the tokenizer's special tokens (content -> id);
        the generation config wins where both say something."""
        def pick(key, token=None):
            value = generation.get(key, config.get(key))
            return special.get(token) if value is None and token else value

        start = pick("decoder_start_token_id", "<|startoftranscript|>")
        end = pick("eos_token_id", "<|endoftext|>")
        if isinstance(end, list):
            end = end[0]
        if start is None or end is None:
            raise WhisperError("cannot tell <|startoftranscript|> and <|endoftext|>: no decoder_start_token_id/"
                               "eos_token_id in the configs and no tokenizer.json")
        languages = {code.strip("<|>"): int(i) for code, i in (generation.get("lang_to_id") or {}).items()}
        if not languages:
            languages = {m.group(1): i for token, i in special.items() if (m := _LANGUAGE_TOKEN.match(token))}
        tasks = {task: int(i) for task, i in (generation.get("task_to_id") or {}).items()}
        tasks = tasks or {task: special[f"<|{task}|>"] for task in TASKS if f"<|{task}|>" in special}
        multilingual = generation.get("is_multilingual")
        if multilingual is None:  # openai-whisper's rule: multilingual vocabularies have 51865+ tokens
            multilingual = config.get("vocab_size", 0) >= 51865
        return cls(start_of_transcript=int(start), end_of_text=int(end),
                   no_timestamps=pick("no_timestamps_token_id", "<|notimestamps|>"),
                   multilingual=bool(multilingual), languages=languages, tasks=tasks,
                   suppress=tuple(generation.get("suppress_tokens") or config.get("suppress_tokens") or ()),
                   suppress_at_begin=tuple(generation.get("begin_suppress_tokens")
                                           or config.get("begin_suppress_tokens") or ()),
                   max_initial_timestamp_index=generation.get("max_initial_timestamp_index"),
                   vocab_size=config.get("vocab_size"))

    def language_id(self, language: str) -> int:
        code = language.strip("<|>").lower()
        if code not in self.languages:
            known = ", ".join(sorted(self.languages)) or "none"
            raise WhisperError(f"unknown language '{language}' (this model knows: {known})")
        return self.languages[code]

    def task_id(self, task: str) -> int:
        if task not in self.tasks:
            raise WhisperError(f"unknown task '{task}' (this model knows: {', '.join(self.tasks) or 'none'})")
        return self.tasks[task]

    def prompt(self, language: str | None, task: str, timestamps: bool) -> list[int]:
        """<|startoftranscript|> [<|lang|> <|task|>] [<|notimestamps|>]; `language` None leaves the
        language and task out (they follow once the language is detected)."""
        ids = [self.start_of_transcript]
        if self.multilingual and language is not None:
            ids += [self.language_id(language), self.task_id(task)]
        if not timestamps and self.no_timestamps is not None:
            ids.append(self.no_timestamps)
        return ids


# -- logits rules (transformers' processor contract: (token_ids [batch, n], scores [batch, vocab])) --
@dataclass(frozen=True)
class SuppressTokens:
    """These tokens are never generated."""

    token_ids: tuple[int, ...]

    def __call__(self, token_ids: np.ndarray, scores: np.ndarray) -> np.ndarray:
        scores = scores.copy()
        scores[:, self._indices] = -np.inf
        return scores

    @functools.cached_property
    def _indices(self) -> np.ndarray:  # an index array made once: a list is converted every step
        return np.array(self.token_ids, np.intp)


@dataclass(frozen=True)
class SuppressAtBegin:
    """These tokens are not the first generated one (a blank or an empty transcript)."""

    token_ids: tuple[int, ...]
    begin_index: int  # length of the prompt

    def __call__(self, token_ids: np.ndarray, scores: np.ndarray) -> np.ndarray:
        if token_ids.shape[1] == self.begin_index:
            scores = SuppressTokens(self.token_ids)(token_ids, scores)
        return scores


@dataclass(frozen=True)
class TimestampRules:
    """Whisper's timestamp grammar (openai-whisper's ApplyTimestampRules):

    - generated text sits between timestamp pairs <|t0|> text <|t1|>; after an opening timestamp
      comes text, after a closing one another timestamp (or the end): a text token cannot follow
      where a timestamp must, and a third timestamp cannot follow two;
    - timestamps never decrease, and a segment has nonzero length;
    - the first token is a timestamp, at most `max_initial_index` steps (1 s) in;
    - when the timestamps together are more likely than the best text token, a timestamp it is.
    """

    timestamp_begin: int
    end_of_text: int
    text_end: int  # text tokens are below it (WhisperTokens.text_end)
    no_timestamps: int
    begin_index: int
    max_initial_index: int | None = None

    def __call__(self, token_ids: np.ndarray, scores: np.ndarray) -> np.ndarray:
        first = self.timestamp_begin
        scores = scores.copy()
        scores[:, self.no_timestamps] = -np.inf
        for row in range(scores.shape[0]):
            generated = token_ids[row, self.begin_index:]
            last_was_timestamp = generated.size >= 1 and generated[-1] >= first
            penultimate_was_timestamp = generated.size < 2 or generated[-2] >= first
            if last_was_timestamp:
                if penultimate_was_timestamp:  # a pair just closed, or the start: text comes next
                    scores[row, first:] = -np.inf
                else:  # after text: a timestamp or the end of text
                    end_score = scores[row, self.end_of_text]
                    scores[row, :self.text_end] = -np.inf
                    scores[row, self.end_of_text] = end_score
            timestamps = generated[generated >= first]
            if timestamps.size:
                closing = last_was_timestamp and not penultimate_was_timestamp
                lowest = timestamps[-1] if closing else timestamps[-1] + 1
                scores[row, first:lowest] = -np.inf
        if token_ids.shape[1] == self.begin_index:
            scores[:, :first] = -np.inf
            if self.max_initial_index is not None:
                scores[:, first + self.max_initial_index + 1:] = -np.inf
        log_probs = _log_softmax(scores)
        for row in range(scores.shape[0]):
            timestamp_mass = np.logaddexp.reduce(log_probs[row, first:])
            if timestamp_mass > log_probs[row, :first].max():
                scores[row, :first] = -np.inf
        return scores


def _log_softmax(scores: np.ndarray) -> np.ndarray:
    scores = scores.astype(np.float64)
    top = scores.max(axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        return scores - top - np.log(np.exp(scores - top).sum(axis=-1, keepdims=True))


# -- long audio: turning a window's tokens into segments ------------------------------------------
def split_segments(tokens, timestamp_begin: int | None, window_frames: int):
    """(segments as (start_frame, end_frame, tokens) relative to the window, frames to seek) for the
    tokens one window generated (without <|endoftext|>), following openai-whisper: complete
    <|t0|> text <|t1|> pairs become segments and the next window starts at the last closing
    timestamp, unless the window ended on a single timestamp (speech ran to its end: seek past it)."""
    tokens = list(tokens)
    if timestamp_begin is None:
        return [(0, window_frames, tokens)], window_frames
    is_timestamp = [t >= timestamp_begin for t in tokens]
    single_timestamp_ending = is_timestamp[-2:] == [False, True]
    boundaries = [i for i in range(1, len(tokens)) if is_timestamp[i - 1] and is_timestamp[i]]
    if not boundaries:  # no pair closed and reopened: one segment up to the last timestamp (if any)
        end = window_frames
        timestamps = [t for t in tokens if t >= timestamp_begin]
        if timestamps and timestamps[-1] != timestamp_begin:
            end = min(window_frames, (timestamps[-1] - timestamp_begin) * FRAMES_PER_TIMESTAMP)
        return [(0, end, tokens)], window_frames
    if single_timestamp_ending:
        boundaries.append(len(tokens))
    segments, start = [], 0
    for stop in boundaries:
        piece = tokens[start:stop]
        segments.append(((piece[0] - timestamp_begin) * FRAMES_PER_TIMESTAMP,
                         (piece[-1] - timestamp_begin) * FRAMES_PER_TIMESTAMP, piece))
        start = stop
    if single_timestamp_ending:
        return segments, window_frames
    seek = (tokens[start - 1] - timestamp_begin) * FRAMES_PER_TIMESTAMP
    return segments, seek if seek > 0 else window_frames


# -- the model -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Decoded:
    """One window's result: generated token ids (without <|endoftext|>) and the language used."""

    tokens: list[int]
    language: str | None


class Whisper:
    """An encoder and a step-wise decoder loaded once, for any number of transcriptions.

    `load` loads one ONNX file (default `runnx.load`; tests pass an onnxruntime-backed one);
    `variant` chooses the files of a transformers.js folder (fp32 by default: layouts.VARIANTS)."""

    def __init__(self, folder, *, load=None, variant: str | None = None):
        self.folder = Path(folder)
        encoders = transformers_js_variants(self.folder, ENCODER_BASES)
        if (not encoders and not (self.folder / "encoder_model.onnx").is_file()
                and not (self.folder / GENAI_CONFIG).is_file()):
            raise WhisperError(f"{self.folder} has no encoder_model.onnx (an Optimum Whisper export folder holds "
                               "encoder_model.onnx and decoder_model_merged.onnx; a transformers.js one holds them "
                               "in onnx/, with variants such as encoder_model_int8.onnx)")
        layout = read_folder(self.folder, variant)
        encoder_path = whisper_encoder(layout)
        self.variant = layout.variant
        start_pool_in_background()  # beside the loads below
        config = _read_json(self.folder / "config.json")
        if layout.genai is not None and layout.genai.vocab_size and "vocab_size" not in config:
            # a genai folder as its builder writes it has no config.json: the vocabulary tells a
            # multilingual model (openai-whisper's rule)
            config["vocab_size"] = layout.genai.vocab_size
        generation = _read_json(self.folder / "generation_config.json")
        self.tokenizer = (Tokenizer.from_folder(self.folder) if (self.folder / "tokenizer.json").is_file()
                          else None)
        special = self.tokenizer.tokenizer.get_added_tokens_decoder() if self.tokenizer else {}
        self.tokens = WhisperTokens.from_configs(config, generation,
                                                 {token.content: i for i, token in special.items()})
        self.max_positions = int(config.get("max_target_positions", layout.context_length or 448))
        # onnxruntime-genai's encoder computes every layer's cross-attention KV: (its output, the decoder's input)
        self._cross = layout.genai.encoder.cross_names() if layout.genai is not None else ()
        self.encoder = (load or runnx_load)(str(encoder_path))
        # load=None: DecoderStep's own loader (it knows what a merged decoder's feeds look like)
        self.decoder = DecoderStep.from_folder(self.folder, capacity=self.max_positions, load=load, layout=layout)
        # greedy; Whisper's own rules as processors; text is made per segment, so no tokenizer here
        self.generator = Generator(self.decoder, None, generation)
        self.n_mels = _mel_bins(self.encoder, config)
        self.encoder_input = self.encoder.input_names[0]
        decoder_inputs = [name for _, name in self._cross] or [HIDDEN_STATES]
        missing = [name for name in decoder_inputs if name not in self.decoder.first_io.other_inputs]
        if missing:
            raise WhisperError(f"the decoder of {self.folder} takes no {missing[0]} input")

    # -- one window --------------------------------------------------------------------------------
    def encode(self, features: np.ndarray):
        """What `decode` takes of a window's features [1, n_mels, 3000]: the encoder hidden states
        [1, 1500, d_model], or, from an onnxruntime-genai folder's encoder, {decoder input: array}
        of every layer's cross-attention keys and values (read-only: each step feeds the same arrays).
        The decoder lets go of the last window's arrays first (`release`)."""
        self.release()
        if not self._cross:
            return next(iter(self.encoder.run({self.encoder_input: features}).values()))
        outputs = self.encoder.run({self.encoder_input: features}, [output for output, _ in self._cross])
        return {name: read_only_view(outputs[output]) for output, name in self._cross}

    def release(self) -> None:
        """Let go of the last window's arrays, which the decoder holds after decoding it (its encoder
        states or cross-attention KV, its self-attention cache: 23 MiB for Whisper tiny): held on, they
        stayed alive beside the next window's encoder and the next audio's features, and in an idle
        model between transcriptions. `encode` and the end of `transcribe` call it."""
        self.generator.reset()
        self.generator.decoder.reset()

    def decode(self, hidden, *, language: str | None = None, task: str = "transcribe",
               timestamps: bool = False, max_new_tokens: int | None = None) -> Decoded:
        """Greedy decoding of one window (`hidden`: what `encode` gave for it; at most `max_new_tokens`,
        default 224). Multilingual models detect the language from the first step when `language` is
        None; English-only models ignore `language`."""
        tokens = self.tokens
        if timestamps and tokens.timestamp_begin is None:
            raise WhisperError(f"{self.folder}: this model has no timestamp tokens (none after <|notimestamps|>)")
        if not tokens.multilingual:
            language = None
        generator = self._start(hidden)
        prompt = tokens.prompt(language, task, timestamps)
        if tokens.multilingual and language is None:
            generator.append_tokens(prompt[:1])
            language = self._detect(generator.compute_logits()[0])
            prompt = tokens.prompt(language, task, timestamps)
            generator.append_tokens(prompt[1:])
        else:
            generator.append_tokens(prompt)
        # openai-whisper's default: half the text context (224), which also bounds a looping window
        budget = self.max_positions // 2 if max_new_tokens is None else max_new_tokens
        budget = min(budget, self.max_positions - len(prompt))
        generator.configure(max_new_tokens=budget, stop_token_ids=(tokens.end_of_text,),
                            processors=tuple(self._rules(len(prompt), timestamps)))
        generated = generator.run_until_done()[0]
        if generated and generated[-1] == tokens.end_of_text:
            generated = generated[:-1]
        return Decoded(generated, language if tokens.multilingual else "en")

    def detect_language(self, hidden) -> str:
        """The most likely language of a window (multilingual models)."""
        if not self.tokens.multilingual:
            raise WhisperError(f"{self.folder} is an English-only model: it does not detect languages")
        generator = self._start(hidden)
        generator.append_tokens([self.tokens.start_of_transcript])
        return self._detect(generator.compute_logits()[0])

    def _start(self, hidden) -> Generator:
        """The generator, reset, with the window's encoder states as the decoder's fixed feed."""
        self.generator.reset()
        self.generator.decoder.reset(1, fixed_feeds=hidden if isinstance(hidden, dict) else {HIDDEN_STATES: hidden})
        return self.generator

    def _detect(self, logits: np.ndarray) -> str:
        if not self.tokens.languages:
            raise WhisperError(f"{self.folder}: no language tokens known (no tokenizer.json or lang_to_id)")
        codes = list(self.tokens.languages)
        scores = logits[[self.tokens.languages[c] for c in codes]]
        return codes[int(scores.argmax())]

    def _rules(self, begin_index: int, timestamps: bool) -> list:
        tokens = self.tokens
        rules = []
        if tokens.suppress_at_begin:
            rules.append(SuppressAtBegin(tokens.suppress_at_begin, begin_index))
        if tokens.suppress:
            rules.append(SuppressTokens(tokens.suppress))
        if timestamps:
            rules.append(TimestampRules(tokens.timestamp_begin, tokens.end_of_text, tokens.text_end, tokens.no_timestamps,
                                        begin_index, tokens.max_initial_timestamp_index))
        return rules

    # -- whole audio -------------------------------------------------------------------------------
    def transcribe(self, audio, *, sample_rate: int | None = None, language: str | None = None,
                   task: str = "transcribe", timestamps: bool | None = None, max_new_tokens: int | None = None,
                   progress=None) -> Transcript:
        """Transcribe a file or array (see audio.load_audio). `timestamps` None: decode timestamps
        only when the audio is longer than one window (they place the windows). `max_new_tokens`
        bounds each window (default 224). `progress(done_s, total_s)` is called after every window."""
        if self.tokenizer is None:
            raise WhisperError(f"{self.folder} has no tokenizer.json: transcribe() makes text from it "
                               "(decode() gives token ids)")
        with BUSY:  # (the mel's and windows' arrays too: `quiet.py`, as a decoder's step)
            return self._transcribe(audio, sample_rate, language, task, timestamps, max_new_tokens, progress)

    def _transcribe(self, audio, sample_rate, language, task, timestamps, max_new_tokens, progress) -> Transcript:
        timings = Timings()
        started = time.perf_counter()
        samples = load_audio(audio, sample_rate)
        timings.audio = samples.size / SAMPLE_RATE
        mel = log_mel_spectrogram(samples, self.n_mels, padding=N_SAMPLES)
        timings.features = time.perf_counter() - started
        content_frames = mel.shape[1] - N_FRAMES
        if timestamps is None:
            timestamps = content_frames > N_FRAMES and self.tokens.timestamp_begin is not None
        if language is not None and self.tokens.multilingual:
            self.tokens.language_id(language)  # fail before any work
        segments: list[Segment] = []
        seek = 0
        while seek < content_frames:
            window_frames = min(N_FRAMES, content_frames - seek)
            window = pad_or_trim(mel[:, seek:seek + N_FRAMES], N_FRAMES)[None]
            clock = time.perf_counter()
            hidden = self.encode(window)
            encoded = time.perf_counter()
            timings.encode += encoded - clock
            decoded = self.decode(hidden, language=language, task=task, timestamps=timestamps,
                                  max_new_tokens=max_new_tokens)
            del hidden  # (else alive through the next window's encoder)
            timings.decode += time.perf_counter() - encoded
            timings.windows += 1
            timings.decoded_tokens += len(decoded.tokens) + 1
            language = language or decoded.language
            pieces, advance = split_segments(decoded.tokens, self.tokens.timestamp_begin if timestamps else None,
                                             window_frames)
            for start, end, piece in pieces:
                segment = self._segment(seek + start, seek + min(end, window_frames), piece, content_frames)
                if segment.text:
                    segments.append(segment)
            seek += advance
            if progress is not None:
                progress(min(seek, content_frames) * FRAME_SECONDS, content_frames * FRAME_SECONDS)
        self.release()
        text = self._text([t for s in segments for t in s.tokens])
        return Transcript(text, segments, language if self.tokens.multilingual else "en", timings)

    def _segment(self, start_frame: int, end_frame: int, tokens, content_frames: int) -> Segment:
        end_frame = min(max(end_frame, start_frame), content_frames)
        return Segment(round(min(start_frame, content_frames) * FRAME_SECONDS, 3), round(end_frame * FRAME_SECONDS, 3),
                       self._text(tokens), tuple(tokens))

    def _text(self, tokens) -> str:
        return self.tokenizer.decode([t for t in tokens if self.tokens.is_text(t)]).strip()


def transcribe(audio, model_dir, **options) -> Transcript:
    """Transcribe `audio` (a path or an array) with the Whisper export in `model_dir` (or a loaded
    `Whisper`). Options: sample_rate, language, task ('transcribe'/'translate'), timestamps,
    max_new_tokens, progress; `variant` for a transformers.js folder."""
    variant = options.pop("variant", None)
    model = model_dir if isinstance(model_dir, Whisper) else Whisper(model_dir, variant=variant)
    return model.transcribe(audio, **options)


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _mel_bins(encoder, config: dict) -> int:
    """Mel bins from the encoder's input_features shape [batch, n_mels, 3000], else config.json."""
    infos = getattr(encoder, "inputs", ())
    shape = infos[0].shape if infos and infos[0].shape is not None else ()
    if len(shape) == 3 and isinstance(shape[1], int):
        return shape[1]
    if "num_mel_bins" in config:
        return int(config["num_mel_bins"])
    raise WhisperError("cannot tell the number of mel bins: the encoder input has no static size and "
                       "config.json has no num_mel_bins")
