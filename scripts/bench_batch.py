"""Batch-job throughput on one machine: the same prompts (SmolLM2-135M) and recordings (Whisper
tiny.en) in this process and on a local Ray cluster (one actor per CPU, one runnx thread each).

    .venv/bin/python scripts/bench_batch.py [--prompts 12] [--new-tokens 32] [--copies 1]

Prints, per engine, the wall time of the whole job (Ray: starting the cluster and the actors'
model loads included) as prompts/s (and generated tokens/s) and audio seconds per second, and the
CPU time the items took (the process's CPU time around each item, all its threads): on a machine
shared with other work, wall time measures the neighbours too, CPU time much less so.
The recordings are the clips of `make models` (john, fox, weather, long), listed `--copies` times
under distinct names (symlinks) so that ids stay unique.
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


class CpuTimed:
    """A job whose records also say the CPU time of their item (pickled by value to the actors)."""

    def __init__(self, factory):
        self.job = factory()

    def __call__(self, item):
        started = time.process_time()
        fields = self.job(item)
        return {**fields, "cpu_seconds": time.process_time() - started}


def timed(job, items, output, ray_address):
    started = time.perf_counter()
    summary = run_batch(functools.partial(CpuTimed, job), items, output, ray_address=ray_address,
                        batch_size=1)
    total = time.perf_counter() - started
    assert summary.failed == 0, read_results(output)
    return total, read_results(output)


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
            total, records = timed(job, items, work / f"{name}-{engine.replace(' ', '-')}.jsonl", address)
            results[engine] = {key: {k: v for k, v in r.items() if k not in ("seconds", "cpu_seconds")}
                               for key, r in records.items()}
            cpu = sum(r["cpu_seconds"] for r in records.values())
            if name == "generate":
                tokens = sum(r["new_tokens"] for r in records.values())
                print(f"{name} {engine}: {len(items)} prompts, {tokens} new tokens in {total:.1f} s: "
                      f"{len(items) / total:.3f} prompts/s ({tokens / total:.1f} tokens/s); items' CPU time "
                      f"{cpu:.1f} s: {tokens / cpu:.1f} tokens per CPU second", flush=True)
            else:
                seconds = sum(r["audio_seconds"] for r in records.values())
                print(f"{name} {engine}: {len(items)} files, {seconds:.1f} s of audio in {total:.1f} s: "
                      f"{seconds / total:.2f} audio s/s; items' CPU time {cpu:.1f} s: {seconds / cpu:.2f} audio "
                      f"s per CPU second", flush=True)
        print(f"{name}: results identical in both engines: {results['in-process'] == results['ray local']}")
    print(f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print(json.dumps({"work": str(work)}))


if __name__ == "__main__":
    main()
