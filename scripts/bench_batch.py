"""Batch-job throughput on one machine: the same prompts (SmolLM2-135M) and recordings (Whisper
tiny.en) in this process and on a local Ray cluster (one actor per CPU, one runnx thread each).

    .venv/bin/python scripts/bench_batch.py [--prompts 12] [--new-tokens 32] [--copies 1]

Prints, per engine, the wall time of the whole job (Ray: starting the cluster and the actors'
model loads included) and of the work after the first record, as prompts/s (and generated tokens/s)
and audio seconds per second. The recordings are the clips of `make models` (john, fox, weather,
long), listed `--copies` times under distinct names (symlinks) so that ids stay unique.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from runnx.batch import GenerateJob, WhisperJob, read_results, run_batch  # noqa: E402

CACHE = Path(os.environ.get("RUNNX_CACHE") or Path.home() / ".cache" / "runnx").expanduser()
CLIPS = ("john.wav", "fox.wav", "weather.wav", "long.wav")
TOPICS = ("rivers", "the moon", "bread", "trains", "winter", "bees", "clocks", "the sea", "maps", "tea",
          "owls", "bridges", "snow", "music", "gardens", "books")


class FirstRecordClock:
    """A progress stream that notes when the first record line arrives."""

    def __init__(self):
        self.first = None

    def write(self, text: str) -> None:
        if self.first is None and text.startswith("[1/"):
            self.first = time.perf_counter()

    def flush(self) -> None:
        pass


def timed(job, items, output, ray_address):
    clock = FirstRecordClock()
    started = time.perf_counter()
    summary = run_batch(job, items, output, ray_address=ray_address, progress=clock)
    total = time.perf_counter() - started
    assert summary.failed == 0, read_results(output)
    return total, total - (clock.first - started), read_results(output)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--copies", type=int, default=1)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="runnx-bench-batch-"))
    prompts = [{"id": i, "prompt": f"Write two sentences about {TOPICS[i % len(TOPICS)]}.", "settings": {}}
               for i in range(args.prompts)]
    audio = []
    for copy in range(args.copies):
        for clip in CLIPS:
            link = work / f"{copy}-{clip}"
            link.symlink_to(CACHE / "audio" / clip)
            audio.append({"id": link.name, "path": str(link)})
    jobs = {
        "generate": (functools.partial(GenerateJob, str(CACHE / "models" / "smollm2-135m"),
                                       {"max_new_tokens": args.new_tokens, "stop_strings": ()}), prompts),
        "whisper": (functools.partial(WhisperJob, str(CACHE / "models" / "whisper-tiny.en")), audio),
    }
    for name, (job, items) in jobs.items():
        results = {}
        for engine, address in (("in-process", None), ("ray local", "local")):
            total, after_first, records = timed(job, items, work / f"{name}-{engine.replace(' ', '-')}.jsonl", address)
            results[engine] = {key: {k: v for k, v in r.items() if k != "seconds"} for key, r in records.items()}
            if name == "generate":
                tokens = sum(r["new_tokens"] for r in records.values())
                print(f"{name} {engine}: {len(items)} prompts, {tokens} new tokens in {total:.1f} s: "
                      f"{len(items) / total:.3f} prompts/s ({tokens / total:.1f} tokens/s); after the first "
                      f"record {(len(items) - 1) / after_first:.3f} prompts/s", flush=True)
            else:
                seconds = sum(r["audio_seconds"] for r in records.values())
                print(f"{name} {engine}: {len(items)} files, {seconds:.1f} s of audio in {total:.1f} s: "
                      f"{seconds / total:.2f} audio s/s", flush=True)
        print(f"{name}: results identical in both engines: {results['in-process'] == results['ray local']}")
    print(json.dumps({"work": str(work)}))


if __name__ == "__main__":
    main()
