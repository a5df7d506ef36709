"""Quantized files beside onnxruntime on the same file: decode tokens/s from random past KV, the two
alternating in one process (`scripts/bench_decode.py`), greedy ids compared.

    .venv/bin/python scripts/bench_quantized.py [--threads 1] [--contexts 32,512] [--rounds 3] [--no-write]

Files: transformers.js's int8 export (`model_quantized.onnx`: DynamicQuantizeLinear + MatMulInteger)
and onnxruntime's `MatMulNBitsQuantizer` over Optimum's export (4 bits, block 32), both built by
`make models`. Writes its section of docs/benchmarks.md unless --no-write.
"""
from __future__ import annotations

import argparse
import os

from bench_architectures import MODELS, markdown, run_json  # scripts/: this script's folder
from report import git_revision, machine, update_section

# (name shown, folder, transformers.js variant or None)
FILES = (("smollm2-135m-tjs `model_quantized.onnx`", "smollm2-135m-tjs", "quantized"),
         ("smollm2-135m-int4 `model.onnx`", "smollm2-135m-int4", None))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--contexts", default="32,512")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = parser.parse_args()
    contexts = args.contexts.split(",")
    header, rows = ["file"], []
    for context in contexts:
        header += [f"runnx / onnxruntime @{context}", "ratio"]
    for name, folder, variant in FILES:
        decode = run_json("bench_decode.py", [MODELS / folder, "--json", "--no-baseline", "--threads", args.threads,
                                              "--contexts", *contexts, "--rounds", args.rounds]
                          + (["--variant", variant] if variant else []), args.threads)["contexts"]
        cells = [name]
        for context in contexts:
            speeds = decode[context]["tokens_per_second"]
            cells += [f"{speeds['runnx']:.1f} / {speeds['onnxruntime']:.1f}",
                      f"{speeds['runnx'] / speeds['onnxruntime']:.2f}x"]
        rows.append(cells + [str(decode[contexts[-1]]["nodes_per_step"]),
                             "yes" if all(decode[c]["same_ids"] for c in contexts) else "no"])
    text = markdown(header + ["nodes/step", "same ids"], rows)
    print(text)
    if args.no_write:
        return
    command = (f".venv/bin/python scripts/bench_quantized.py --threads {args.threads} --contexts {args.contexts} "
               f"--rounds {args.rounds}")
    update_section("quantized", f"""## Quantized files beside onnxruntime on the same file (`scripts/bench_quantized.py`)

Decode tokens/s from random past KV, runnx and onnxruntime alternating in one process (`scripts/bench_decode.py`), {args.threads} thread(s), greedy ids compared (the int8 file's differ: onnxruntime's u8 x s8 MatMulInteger saturates 16-bit pair sums on AVX2; runnx is exact).
runnx {git_revision()}; {machine()}; load average {os.getloadavg()[0]:.1f} at the end. Command: `{command}`.

{text}
""")


if __name__ == "__main__":
    main()
