"""Is runnx's decode speed general? The same weights (SmolLM2-135M's) as three architectures' Optimum
exports, runnx against onnxruntime on each, one thread.

    .venv/bin/python scripts/bench_architectures.py [--threads 1] [--contexts 32,512] [--rounds 3] [--no-write]

Per architecture (smollm2, qwen2, phi3: what `make models` builds, scripts/build_models.py): decode
tokens/s at each context from random past KV and node executions per runnx step (scripts/bench_decode.py
--json), then end-to-end greedy generation of 48 tokens from a 32-token prompt: decode tokens/s and the
first token's time, in the process's first run and steady (scripts/bench_generate.py --json). Each
script runs in its own process per model. Writes the `architectures` section of docs/benchmarks.md,
with the op types a step of each export runs that SmolLM2's does not.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from report import THREAD_VARIABLES, git_revision, machine, update_section  # scripts/: this script's folder

ROOT = Path(__file__).resolve().parents[1]
MODELS = Path(os.environ.get("RUNNX_CACHE") or Path.home() / ".cache" / "runnx").expanduser() / "models"
ARCHITECTURES = {"smollm2": "smollm2-135m", "qwen2": "qwen2-smollm2-135m", "phi3": "phi3-smollm2-135m"}
PROMPT_TOKENS, NEW_TOKENS, REPEATS = 32, 48, 3


def run_json(script: str, arguments: list, threads: int) -> dict:
    """The last line of a benchmark script's output, run in its own process with `threads` set."""
    environment = dict(os.environ, **{v: str(threads) for v in THREAD_VARIABLES}, PYTHONPATH=str(ROOT))
    completed = subprocess.run([sys.executable, str(ROOT / "scripts" / script), *map(str, arguments)],
                               capture_output=True, text=True, env=environment, timeout=3600)
    if completed.returncode:
        sys.exit(f"{script} {' '.join(map(str, arguments))} failed:\n{completed.stderr[-2000:]}")
    return json.loads(completed.stdout.strip().splitlines()[-1])


def measure(folder: Path, args) -> dict:
    decode = run_json("bench_decode.py", [folder, "--json", "--no-baseline", "--threads", args.threads,
                                          "--contexts", *args.contexts.split(","), "--steps", args.steps,
                                          "--rounds", args.rounds], args.threads)
    generate = run_json("bench_generate.py", [folder, "--json", "--threads", args.threads, "--prompt-tokens",
                                              PROMPT_TOKENS, "--new-tokens", NEW_TOKENS, "--repeats", REPEATS],
                        args.threads)
    return {"decode": decode, "generate": generate}


def markdown(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(cells) + " |" for cells in rows])


def table(results: dict, contexts: list[str]) -> str:
    """Decode from random past KV, then end to end: two tables, one row per model."""
    header, rows = ["model"], []
    for context in contexts:
        header += [f"runnx tok/s @{context}", f"onnxruntime tok/s @{context}", f"ratio @{context}"]
    for name, result in results.items():
        decode = result["decode"]["contexts"]
        cells = [name]
        for context in contexts:
            speeds = decode[context]["tokens_per_second"]
            cells += [f"{speeds['runnx']:.1f}", f"{speeds['onnxruntime']:.1f}",
                      f"{speeds['runnx'] / speeds['onnxruntime']:.2f}x"]
        rows.append(cells + ["/".join(str(decode[c]["nodes_per_step"]) for c in contexts),
                             str(all(decode[c]["same_ids"] for c in contexts))])
    decode_table = markdown(header + ["runnx nodes/step", "same ids"], rows)
    header, rows = ["model", "runnx load s / peak RSS MiB"], []
    for runner in ("runnx", "onnxruntime"):
        header += [f"{runner} e2e tok/s", f"{runner} first token ms (first run / steady)"]
    for name, result in results.items():
        generate = result["generate"]
        cells = [name, f"{generate['runnx']['load_s']:.2f} / {generate['runnx_loaded_rss_mib']:.0f}"]
        for runner in ("runnx", "onnxruntime"):
            figures = generate[runner]
            cells += [f"{figures['decode_tps']:.1f}",
                      f"{figures['cold_first_token_s'] * 1e3:.0f} / {figures['first_token_s'] * 1e3:.0f}"]
        rows.append(cells + [f"{generate['runnx']['decode_tps'] / generate['onnxruntime']['decode_tps']:.2f}x",
                             str(generate["same_ids"])])
    return decode_table + "\n\n" + markdown(header + ["e2e ratio", "same ids"], rows)


def op_differences(results: dict, context: str) -> str:
    """Per export, the op types (with executions per step) that differ from SmolLM2's step."""
    base = results["smollm2"]["decode"]["contexts"][context]["op_calls"]
    lines = [f"smollm2, op executions per step at context {context}: "
             + ", ".join(f"{op} {count}" for op, count in sorted(base.items(), key=lambda kv: -kv[1]))]
    same = []
    for name, result in results.items():
        if name == "smollm2":
            continue
        calls = result["decode"]["contexts"][context]["op_calls"]
        changed = [f"{op} {base.get(op, 0)} -> {calls.get(op, 0)}" for op in sorted({*base, *calls})
                   if base.get(op, 0) != calls.get(op, 0)]
        if changed:
            lines.append(f"{name}, against smollm2: " + ", ".join(changed))
        else:
            same.append(name)
    if same:
        lines.append(f"{' and '.join(same)}, against smollm2: the same op types and counts")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--contexts", default="32,512")
    parser.add_argument("--steps", type=int, default=16, help="decode steps per round (bench_decode.py)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per context (bench_decode.py)")
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = parser.parse_args()
    contexts = args.contexts.split(",")
    missing = [str(MODELS / folder / "model.onnx") for folder in ARCHITECTURES.values()
               if not (MODELS / folder / "model.onnx").exists()]
    if missing:
        sys.exit(f"missing {', '.join(missing)}: run `make models` first")
    results, load_before = {}, os.getloadavg()[0]
    for name, folder in ARCHITECTURES.items():
        print(f"{name}: {MODELS / folder}", flush=True)
        results[name] = measure(MODELS / folder, args)
        print(f"  {json.dumps(results[name]['generate'])}", flush=True)
    text = table(results, contexts)
    ops = op_differences(results, contexts[-1])
    load = f"load average {load_before:.1f} at the start, {os.getloadavg()[0]:.1f} at the end"
    print(text + "\n\n" + ops + "\n" + load)
    if args.no_write:
        return
    command = (f".venv/bin/python scripts/bench_architectures.py --threads {args.threads} --contexts {args.contexts} "
               f"--rounds {args.rounds}")
    update_section("architectures", f"""## The same weights as three architectures (`scripts/bench_architectures.py`)

SmolLM2-135M's weights exported by Optimum as Llama (smollm2), Qwen2 (zero q/k/v biases: bias Adds) and Phi-3 (fused
qkv_proj and gate_up_proj products). runnx {git_revision()}; {machine()}; {args.threads} thread(s); {load}. Decode: median
tokens/s of {args.steps} steps x {args.rounds} rounds from random past KV, runnx and onnxruntime interleaved in one process
(`scripts/bench_decode.py`; nodes/step: runnx's node executions); e2e: greedy {NEW_TOKENS} new tokens from a {PROMPT_TOKENS}-token
prompt (`scripts/bench_generate.py`, best of {REPEATS}); first token: the process's first run and steady; runnx's
load and the process's peak RSS after it (before any run).
Command: `{command}`.

{text}

```
{ops}
```
""")


if __name__ == "__main__":
    main()
