"""First contact with runnx: each command in a process of its own with an empty compiled-code cache
(a fresh NUMBA_CACHE_DIR per command), then, once the background compile of that first run has
filled the cache, the same command warm. Wall time of the process, and for `generate` the time to
its first token (the first byte on stdout, from the process's start), as a markdown table.

    python scripts/bench_first_run.py [--only generate,whisper,run] [--mode background|wait]
                                      [--tree PATH] [--warm-runs N] [--compile-timeout S] [--write]

--mode wait compiles on first use in the command itself (runnx's behaviour before the background
compile); --tree runs another checkout's runnx (e.g. /work/main) with this script's commands.
The real models come from ${RUNNX_CACHE:-~/.cache/runnx} (`make models`). --write puts the table
in its section of docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from runnx._cache_dirs import compiled_code_root  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import git_revision, machine, update_section  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("RUNNX_CACHE") or Path.home() / ".cache" / "runnx").expanduser()
COMMANDS = {
    "generate": ["generate", str(CACHE / "models/smollm2-135m"), "The capital of France is", "--max-new-tokens", "24"],
    "whisper": ["whisper", str(CACHE / "models/whisper-tiny.en"), str(CACHE / "audio/john.wav")],
    "run": ["run", "tests/fixtures/tiny-llama/model.onnx"],
    "run-whisper": ["run", "tests/fixtures/tiny-whisper/encoder_model.onnx"],
}


def timed(argv: list[str], env: dict, tree: Path = ROOT) -> tuple[float, float | None, int, str, float]:
    """(wall seconds, seconds to the first byte on stdout or None, exit code, stderr, CPU seconds of
    the process: on a loaded machine the wall time alone says little) of `runnx argv`."""
    start = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-m", "runnx.cli", *argv], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, env=env, cwd=tree)  # `-m` imports the tree's runnx
    errors = []
    reader = threading.Thread(target=lambda: errors.append(process.stderr.read().decode(errors="replace")))
    reader.start()
    first = None
    while chunk := os.read(process.stdout.fileno(), 4096):
        if first is None and chunk.strip():
            first = time.perf_counter() - start
    _, status, usage = os.wait4(process.pid, 0)
    wall = time.perf_counter() - start
    process.returncode = code = os.waitstatus_to_exitcode(status)
    reader.join()
    return wall, first, code, errors[0] if errors else "", usage.ru_utime + usage.ru_stime


def compiled(cache: Path, timeout: float) -> float | None:
    """Seconds until the background compile of a first run wrote its marker (None: not in `timeout`)."""
    start = time.perf_counter()
    ready = compiled_code_root(str(cache)) / "ready"  # where runnx puts its markers under NUMBA_CACHE_DIR
    while time.perf_counter() - start < timeout:
        if ready.is_dir() and any(p.suffix == "" for p in ready.iterdir()):
            return time.perf_counter() - start
        time.sleep(0.5)
    return None


def seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(COMMANDS), help=f"commands among {', '.join(COMMANDS)}")
    parser.add_argument("--mode", default="background", choices=("background", "wait"), help="RUNNX_COMPILE")
    parser.add_argument("--tree", type=Path, default=ROOT, help="the runnx checkout to run (default: this one)")
    parser.add_argument("--warm-runs", type=int, default=2, help="warm runs per command (the best is shown)")
    parser.add_argument("--compile-timeout", type=float, default=1800, help="seconds to wait for the background "
                                                                            "compile before the warm runs")
    parser.add_argument("--write", action="store_true", help="write the table into docs/benchmarks.md")
    args = parser.parse_args()
    rows = []
    for name in args.only.split(","):
        argv = COMMANDS[name]
        with tempfile.TemporaryDirectory(prefix="runnx-first-run-") as cache:
            env = dict(os.environ, NUMBA_CACHE_DIR=cache, RUNNX_COMPILE=args.mode, PYTHONPATH=str(args.tree.resolve()),
                       PYTHONDONTWRITEBYTECODE="1")
            cold, cold_first, code, errors, cpu = timed(argv, env, args.tree)
            if code:
                print(f"{name}: exit code {code}\n{errors}", file=sys.stderr)
                return 1
            print(f"{name} cold: {cold:.2f} s\n{errors}", file=sys.stderr)
            background = args.mode == "background"
            after = compiled(Path(cache), args.compile_timeout) if background else None
            warm = [timed(argv, env, args.tree) for _ in range(args.warm_runs)] if after is not None or not background else []
            best = min(warm, default=None, key=lambda run: run[0])
            rows.append((name, cold, cold_first, cpu, after, best and best[0], best and best[1], best and best[4]))
            if best:
                print(f"{name} warm: {best[0]:.2f} s\n{best[3]}", file=sys.stderr)
    lines = [f"| command (`runnx ...`, RUNNX_COMPILE={args.mode}) | cold: wall s | first output s | CPU s | "
             f"background compile s | warm: wall s | first output s | CPU s |", "|---|---|---|---|---|---|---|---|"]
    for name, cold, cold_first, cpu, after, warm, warm_first, warm_cpu in rows:
        shown = " ".join(a if " " not in a else f'"{a}"' for a in COMMANDS[name]).replace(str(CACHE), "~/.cache/runnx")
        lines.append(f"| `{shown}` | {cold:.2f} | {seconds(cold_first)} | {cpu:.2f} | {seconds(after)} | "
                     f"{seconds(warm)} | {seconds(warm_first)} | {seconds(warm_cpu)} |")
    load = f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores at the end"
    print("\n".join(lines) + f"\n\n{load}")
    if args.write:
        update_section("first-run", f"""## First run (`scripts/bench_first_run.py`)

What a newcomer meets: each command in its own process with an empty compiled-code cache (a fresh `NUMBA_CACHE_DIR`),
then, once that run's background compile (a niced process of its own) has written its marker, the same command warm.
"first output": the first byte on stdout from the process's start (`generate`'s first token: import, the 540 MB model's
load and the tokenizer included); CPU: the command's own process. runnx {git_revision()}; {machine()}; {load}.
Command: `.venv/bin/python scripts/bench_first_run.py --only {args.only} --warm-runs {args.warm_runs} --write`.

{chr(10).join(lines)}
""")
    return 0


if __name__ == "__main__":
    sys.exit(main())
