"""Time and bytes copied per decode step vs past length: runnx in place, runnx with in-place off,
and onnxruntime, on the same Optimum model in one run. Writes a table and a plot into
docs/benchmarks.md.

    .venv/bin/python scripts/bench_kv_growth.py [--model PATH] [--threads N] [--lengths 16,64,...]

The past KV is random (the step's cost does not depend on its values); runnx in place gets it as
`runnx.Owned` capacity buffers, the other two as plain arrays. Bytes copied are runnx's profile
counters (Concat/Attention); for onnxruntime they are the bytes its Concat must write (the whole
present KV), computed from the shapes.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from report import git_revision, machine, set_threads, update_section  # noqa: E402


def _parse():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default = Path(os.environ.get("RUNNX_CACHE", Path.home() / ".cache" / "runnx")) / "models" / "smollm2-135m" / "model.onnx"
    if not default.exists():
        default = ROOT / "tests" / "fixtures" / "tiny-llama" / "model.onnx"
    parser.add_argument("--model", type=Path, default=default)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--lengths", default="16,64,256,1024,4096")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    return parser.parse_args()


ARGS = _parse()
set_threads(ARGS.threads)

import numpy as np  # noqa: E402
import onnxruntime  # noqa: E402

import runnx  # noqa: E402


def _feeds(ids, past_length, past):
    return {"input_ids": ids, "attention_mask": np.ones((1, past_length + 1), np.int64),
            "position_ids": np.array([[past_length]], np.int64), **past}


def _random_past(model, length, rng):
    return {i.name: rng.standard_normal((1, i.shape[1], length, i.shape[3])).astype(np.float32)
            for i in model.inputs if i.name.startswith("past_key_values.")}


def _runnx_steps(model, past, length, steps, in_place):
    times, copied = [], []
    current = {k: runnx.with_capacity(v, 2, length + steps + 1) if in_place else v for k, v in past.items()}
    for step in range(steps):
        profile = runnx.Profile()
        start = time.perf_counter()
        result = model.run(_feeds(np.array([[42]]), length + step, current), profile=profile)
        times.append(time.perf_counter() - start)
        copied.append(profile.counters["Concat.bytes_copied"] + profile.counters["Attention.bytes_copied"])
        presents = {k: result[k.replace("past_key_values", "present")] for k in past}
        current = {k: runnx.Owned(v) for k, v in presents.items()} if in_place else presents
    return statistics.median(times), statistics.median(copied)


def _ort_steps(session, past, length, steps):
    names = [o.name for o in session.get_outputs()]
    times, copied = [], []
    current = past
    for step in range(steps):
        start = time.perf_counter()
        result = dict(zip(names, session.run(None, _feeds(np.array([[42]]), length + step, current))))
        times.append(time.perf_counter() - start)
        current = {k: result[k.replace("past_key_values", "present")] for k in past}
        copied.append(sum(v.nbytes for v in current.values()))
    return statistics.median(times), statistics.median(copied)


def main():
    lengths = [int(x) for x in ARGS.lengths.split(",")]
    in_place, copying = runnx.load(ARGS.model), runnx.load(ARGS.model, inplace=False)
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = ARGS.threads
    session = onnxruntime.InferenceSession(str(ARGS.model), options, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    rows = []
    for length in lengths:
        past = _random_past(in_place, length, rng)
        row = (length, _runnx_steps(in_place, past, length, ARGS.steps, True),
               _runnx_steps(copying, past, length, ARGS.steps, False), _ort_steps(session, past, length, ARGS.steps))
        rows.append(row)
        print(f"past {length:>5}: runnx in place {row[1][0] * 1e3:7.1f} ms {row[1][1] / 1024:9.1f} KiB | "
              f"in place off {row[2][0] * 1e3:7.1f} ms {row[2][1] / 1024:9.1f} KiB | "
              f"onnxruntime {row[3][0] * 1e3:7.1f} ms {row[3][1] / 1024:9.1f} KiB", flush=True)
    if not ARGS.no_write:
        _write(rows)


def _write(rows):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = [r[0] for r in rows]
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for index, label in ((1, "runnx in place"), (2, "runnx in-place off"), (3, "onnxruntime")):
        left.plot(lengths, [r[index][0] * 1e3 for r in rows], marker="o", label=label)
        right.plot(lengths, [r[index][1] / 2**20 for r in rows], marker="o", label=label)
    for axis, title in ((left, "ms per decode step"), (right, "MiB copied into the KV cache per step")):
        axis.set_xscale("log", base=2)
        axis.set_xlabel("past length (tokens)")
        axis.set_title(title)
        axis.grid(alpha=0.3)
    left.legend()
    figure.tight_layout()
    image = ROOT / "docs" / "kv_growth.png"
    image.parent.mkdir(exist_ok=True)
    figure.savefig(image, dpi=90)
    table = ["| past | runnx in place ms | KiB copied | in-place off ms | KiB copied | onnxruntime ms | KiB copied |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for length, mine, off, ort in rows:
        table.append(f"| {length} | {mine[0] * 1e3:.1f} | {mine[1] / 1024:.1f} | {off[0] * 1e3:.1f} | "
                     f"{off[1] / 1024:.1f} | {ort[0] * 1e3:.1f} | {ort[1] / 1024:.1f} |")
    model = ARGS.model.relative_to(ROOT) if ARGS.model.is_relative_to(ROOT) else Path(*ARGS.model.parts[-2:])
    update_section("kv-growth", f"""## KV-cache growth per decode step (`scripts/bench_kv_growth.py`)

Model `{model}`, {ARGS.threads} thread(s), median of {ARGS.steps} steps from random past KV; runnx {git_revision()}; {machine()}.
Command: `.venv/bin/python scripts/bench_kv_growth.py --threads {ARGS.threads}`.

{chr(10).join(table)}

![time and bytes per decode step vs past length](kv_growth.png)
""")


if __name__ == "__main__":
    main()
