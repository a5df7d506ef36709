"""How close runnx's SmolLM2 figures are to what this machine can do at all.

    .venv/bin/python scripts/bench_roofline.py [--threads 1,2] [--rounds 3] [--no-write]

A decode step reads every weight once (a float32 row times each matrix): its floor is the weights'
bytes over the memory bandwidth, which this script measures as the threads' numpy sums over the
parts of a 512 MiB array (a plain stream read; numpy's sum lets go of the GIL), or OpenBLAS's
matrix-vector product over it when that is faster, before and after runnx's figures (the better
of the two: this machine's pace moves within minutes). A prompt's products are compute:
their floor is the floating-point work over the peak of a large float32 product (OpenBLAS's sgemm,
2048 x 2048). For each thread count (a process each, BLAS and numba threads set before numpy loads),
runnx's figures on Optimum's SmolLM2-135M export (`make models`) beside those ceilings: decode at
context 32 (median of 16 steps after random past KV), a 32-token prompt's first token and a
2,000-token prefill (warm, best of `--rounds`); `scripts/bench.py` runs it too. The weights' bytes
are the initializers some node streams as stored (`runnx.interp.loader`'s rule); the work is 2 flops a weight a token (the LM head once) plus the
causal attention's 4 x layers x hidden x (keys a token). Writes its section of docs/benchmarks.md
unless --no-write.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
from report import git_revision, machine, set_threads, update_section  # noqa: E402  (scripts/: this script's folder)

CACHE = Path(os.environ.get("RUNNX_CACHE") or Path.home() / ".cache" / "runnx").expanduser()
SMOLLM2 = CACHE / "models" / "smollm2-135m"
PREFILL, PROMPT, CONTEXT, STEPS = 2000, 32, 32, 16


def _best(call, rounds: int) -> float:
    """The fastest of `rounds` timed calls, after one untimed."""
    call()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return min(times)


def _bandwidth(threads: int) -> float:
    """Bytes a second the threads read 512 MiB at: numpy's sums over its parts (a thread each at a
    time), or OpenBLAS's matrix-vector product over it when that is faster."""
    import numpy as np
    matrix = np.ones((16384, 8192), np.float32)
    vector = np.ones(8192, np.float32)
    parts = np.array_split(matrix.reshape(-1), 4 * threads)
    with ThreadPoolExecutor(threads) as readers:
        summed = _best(lambda: list(readers.map(np.sum, parts)), 10)
    return matrix.nbytes / min(summed, _best(lambda: matrix @ vector, 10))


def worker(threads: int, rounds: int) -> dict:
    set_threads(threads)
    import numpy as np
    import onnx

    from runnx.generate.decoder import DecoderStep
    from runnx.interp.loader import _streamed_names

    bandwidth = _bandwidth(threads)
    square = np.random.default_rng(0).random((2048, 2048), dtype=np.float32)
    peak = 2 * 2048 ** 3 / _best(lambda: square @ square, 5)

    proto = onnx.load(str(SMOLLM2 / "model.onnx"), load_external_data=False)
    streamed = _streamed_names(proto.graph)
    weights = sum(int(np.prod(t.dims)) * onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
                  for t in proto.graph.initializer if t.name in streamed)
    config = json.loads((SMOLLM2 / "config.json").read_text())
    hidden, layers, vocabulary = config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]
    del proto

    decoder = DecoderStep.from_folder(SMOLLM2, capacity=PREFILL + 64)
    heads, depth, dtype = next(iter(decoder._layout.values()))
    names = [kv.past for kv in decoder.past_io.kv if not kv.is_cross_attention]
    rng = np.random.default_rng(0)
    past = {name: rng.standard_normal((1, heads, CONTEXT, depth)).astype(dtype) for name in names}
    token = np.array([[42]], np.int64)

    def decode_steps() -> float:
        decoder.restore(past, np.ones((1, CONTEXT), np.int64))
        decoder.step(token)
        times = []
        for _ in range(STEPS):
            start = time.perf_counter()
            decoder.step(token)
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    def prompt(length: int):
        ids = rng.integers(1000, 20000, (1, length), dtype=np.int64)
        return lambda: (decoder.reset(), decoder.step(ids))

    step = min(decode_steps() for _ in range(rounds))
    first = _best(prompt(PROMPT), rounds)
    prefill = _best(prompt(PREFILL), rounds)
    bandwidth = max(bandwidth, _bandwidth(threads))  # (the machine's pace moves within minutes: its best)
    head = hidden * vocabulary  # the LM head's weights: once a prompt (its last position)

    def work(length: int) -> float:  # products' and causal attention's flops of a prompt
        per_token = weights // 4 - head
        return 2 * per_token * length + 2 * head + 4 * layers * hidden * length * (length + 1) / 2

    return {"threads": threads, "bandwidth": bandwidth, "peak": peak, "weights": weights, "step": step,
            "first": first, "prefill": prefill, "first_work": work(PROMPT), "prefill_work": work(PREFILL)}


def _table(results: list[dict]) -> str:
    lines = ["| threads | memory GB/s | peak GFLOP/s | decode ms @32 | its GB/s | of memory | 32-token prompt ms | its GFLOP/s "
             "| of peak | 2,000-token prefill s | its GFLOP/s | of peak |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        streamed = r["weights"] / r["step"]
        first, prefill = r["first_work"] / r["first"], r["prefill_work"] / r["prefill"]
        lines.append(f"| {r['threads']} | {r['bandwidth'] / 1e9:.1f} | {r['peak'] / 1e9:.0f} | {r['step'] * 1e3:.1f} | "
                     f"{streamed / 1e9:.1f} | {streamed / r['bandwidth']:.0%} | {r['first'] * 1e3:.0f} | "
                     f"{first / 1e9:.0f} | {first / r['peak']:.0%} | {r['prefill']:.2f} | {prefill / 1e9:.0f} | "
                     f"{prefill / r['peak']:.0%} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        print(json.dumps(worker(args.worker, args.rounds)))
        return
    if not (SMOLLM2 / "model.onnx").is_file():
        raise SystemExit(f"no SmolLM2-135M export at {SMOLLM2}: build it with `make models`")
    results = []
    for threads in (int(t) for t in args.threads.split(",")):
        completed = subprocess.run([sys.executable, __file__, "--worker", str(threads), "--rounds", str(args.rounds)],
                                   capture_output=True, text=True, check=True)
        results.append(json.loads(completed.stdout.strip().splitlines()[-1]))
    table = _table(results)
    print(table)
    if not args.no_write:
        weights = results[0]["weights"] / 1e6
        update_section("roofline", f"""## Against this machine's ceilings (`scripts/bench_roofline.py`)

SmolLM2-135M (Optimum's export) beside the machine's ceilings, in one process: memory, the better of two 512 MiB stream
reads; peak, a 2048^3 float32 sgemm. Decode reads the {weights:.0f} MB of weights once a step (median of {STEPS} steps, context
{CONTEXT}); a prompt is 2 flops a weight a token plus causal attention (best of {args.rounds}). runnx {git_revision()}; {machine()}.
Command: `.venv/bin/python scripts/bench_roofline.py --threads {args.threads} --rounds {args.rounds}`.

{table}
""")


if __name__ == "__main__":
    main()
