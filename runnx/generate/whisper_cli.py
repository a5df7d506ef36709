"""`runnx whisper MODEL_DIR AUDIO... [--timestamps] [--format txt|srt|vtt|json] [--language L] [--variant V]`,
and the batch form `runnx whisper MODEL_DIR --input-list files.txt --output results.jsonl [--ray]`
(runnx.batch: records as `--format json` prints them, resumable, optionally on Ray).

Prints the transcript of each file on stdout (plain text, timed text, SubRip or WebVTT subtitles,
or one JSON object per file), and on stderr a progress bar for audio longer than one window and
the real-time factor split into feature, encoder and decoder time.
"""
from __future__ import annotations

import json
import os
import sys

from runnx.batch.cli import add_batch_arguments, batch_requested
from runnx.generate.mel import CHUNK_SECONDS

FORMATS = ("txt", "srt", "vtt", "json")


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "whisper", help="transcribe speech with a Whisper export (encoder_model.onnx + decoder_model_merged.onnx)",
        description="Transcribe audio files (WAV/FLAC/OGG, any rate, mixed down to 16 kHz mono) with a Whisper "
                    "model exported by Optimum, downloaded in the transformers.js layout (onnx/ subfolder, "
                    "--variant) or built by onnxruntime-genai (genai_config.json).")
    parser.add_argument("model_dir", metavar="MODEL_DIR", help="folder with encoder_model.onnx, "
                        "decoder_model_merged.onnx (at the top, or in onnx/ with their variants), config.json, "
                        "generation_config.json, tokenizer.json; or an onnxruntime-genai folder")
    parser.add_argument("audio", metavar="AUDIO", nargs="*", help="audio file(s) (or --input-list FILE)")
    parser.add_argument("--timestamps", action="store_true",
                        help="decode timestamps and print timed segments (srt/vtt always have them)")
    parser.add_argument("--format", choices=FORMATS, default="txt",
                        help="txt (default), srt or vtt subtitles, json (one object per file and line)")
    parser.add_argument("--language", metavar="L", default=None,
                        help="language code for multilingual models (default: detected from the first window)")
    parser.add_argument("--task", choices=("transcribe", "translate"), default="transcribe",
                        help="multilingual models: transcribe, or translate into English")
    parser.add_argument("--variant", metavar="NAME",
                        help="transformers.js folder: which onnx/encoder_model_*.onnx + decoder_model_merged_*.onnx "
                             "pair (fp32 (default), fp16, int8, quantized, q4, ...)")
    add_batch_arguments(parser, "--input-list", "audio files, one path per line (blank lines and # comments "
                                                "skipped)")
    parser.set_defaults(func=run, compile_key=_compile_key, compile_argv=_compile_argv)


def _compile_key(args) -> list:
    """What chooses the kernels a transcription calls (`runnx/background_compile.py`): the model."""
    return ["whisper", os.path.abspath(args.model_dir), args.variant]


def _compile_argv(args) -> list[str] | None:
    """The transcription that compiles them: the first file's (a batch job compiles on first use)."""
    if not args.audio:
        return None
    argv = ["whisper", args.model_dir, args.audio[0], "--task", args.task]
    return argv + (["--language", args.language] if args.language else []) + (
        ["--variant", args.variant] if args.variant else [])


def run(args) -> int:
    """Errors (unreadable audio, a folder that is no Whisper export) are RunnxErrors: the runnx
    command prints them as one line."""
    from runnx.generate.whisper import Whisper

    if batch_requested(args, args.audio, "--input-list"):
        from runnx.batch.cli import run_whisper_batch
        return run_whisper_batch(args, True if args.timestamps else None)
    model = Whisper(args.model_dir, variant=args.variant)
    timestamps = True if args.timestamps or args.format in ("srt", "vtt") else None
    for index, path in enumerate(args.audio):
        bar = ProgressBar(path)
        transcript = model.transcribe(path, language=args.language, task=args.task, timestamps=timestamps,
                                      progress=bar.update)
        bar.close()
        if len(args.audio) > 1 and args.format != "json":  # json lines name their file
            print(f"\n==> {path} <==" if index else f"==> {path} <==")
        sys.stdout.write(render(transcript, args.format, args.timestamps, path))
        sys.stdout.flush()
        print(timing_line(transcript.timings), file=sys.stderr)
    return 0


# -- output formats -------------------------------------------------------------------------------
def clock(seconds: float, separator: str = ".", hours: bool = True) -> str:
    """00:01:02.345 (SubRip uses ',' before the milliseconds; short audio may drop the hours)."""
    millis = int(round(seconds * 1000))
    h, rest = divmod(millis, 3_600_000)
    m, rest = divmod(rest, 60_000)
    s, ms = divmod(rest, 1000)
    head = f"{h:02d}:" if hours or h else ""
    return f"{head}{m:02d}:{s:02d}{separator}{ms:03d}"


def render(transcript, fmt: str, timestamps: bool = False, source: str | None = None) -> str:
    segments = transcript.segments
    if fmt == "json":
        return json.dumps(transcript_fields(transcript, source), ensure_ascii=False) + "\n"
    if fmt == "srt":
        return "".join(f"{i}\n{clock(s.start, ',')} --> {clock(s.end, ',')}\n{s.text}\n\n"
                       for i, s in enumerate(segments, 1))
    if fmt == "vtt":
        return "WEBVTT\n\n" + "".join(f"{clock(s.start)} --> {clock(s.end)}\n{s.text}\n\n" for s in segments)
    if timestamps:
        return "".join(f"[{clock(s.start, hours=False)} --> {clock(s.end, hours=False)}]  {s.text}\n" for s in segments)
    return transcript.text + "\n"


def transcript_fields(transcript, source: str | None) -> dict:
    """The JSON form of a transcript (--format json, and the records of batch jobs)."""
    return {"file": source, "language": transcript.language, "text": transcript.text,
            "segments": [{"start": s.start, "end": s.end, "text": s.text} for s in transcript.segments]}


def timing_line(timings) -> str:
    audio = timings.audio or 1.0
    return (f"{timings.audio:.1f} s of audio in {timings.total:.2f} s: real-time factor {timings.real_time_factor:.3f} "
            f"(features {timings.features / audio:.3f}, encode {timings.encode / audio:.3f}, "
            f"decode {timings.decode / audio:.3f}; {timings.windows} window(s), {timings.decoded_tokens} decoder steps)")


class ProgressBar:
    """A one-line bar on stderr, shown only for audio longer than one window."""

    WIDTH = 30

    def __init__(self, label: str, stream=None):
        self.label = label
        self.stream = stream or sys.stderr
        self.shown = False

    def update(self, done: float, total: float) -> None:
        if total <= CHUNK_SECONDS:
            return
        filled = int(self.WIDTH * min(done / total, 1.0))
        self.stream.write(f"\r{self.label} [{'#' * filled}{'.' * (self.WIDTH - filled)}] "
                          f"{done:6.1f}/{total:.1f} s")
        self.stream.flush()
        self.shown = True

    def close(self) -> None:
        if self.shown:
            self.stream.write("\n")
            self.stream.flush()
