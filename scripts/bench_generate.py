"""Decode speed of runnx vs onnxruntime on the same decoder export, same thread count, one script.

    .venv/bin/python scripts/bench_generate.py [MODEL_DIR] [--threads 2] [--prompt-tokens 32]
                                               [--new-tokens 64] [--profile]

MODEL_DIR defaults to the SmolLM2-135M that `make models` builds (${RUNNX_CACHE:-~/.cache/runnx}/models/
smollm2-135m). Both runtimes drive model.onnx greedily from the same prompt ids, without stopping at
eos; the script reports time to first token (prefill + first sampling), decode tokens/s over the
remaining tokens, and whether both produced the same ids. onnxruntime is a benchmark peer only.
--json prints one JSON line instead, with the first token of the process's first run (before any
warm-up: the cost of a first prompt after loading) beside the steady one.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run from a checkout without installing runnx

TEXT = ("Once upon a time, in a small village at the edge of a great forest, there lived an old woodcutter "
        "and his three children, who loved to explore the hills and the rivers beyond the old stone bridge.")


def parse_args():
    default_dir = Path(os.environ.get("RUNNX_CACHE") or Path.home() / ".cache" / "runnx").expanduser()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir", nargs="?", default=default_dir / "models" / "smollm2-135m", type=Path)
    parser.add_argument("--threads", type=int, default=2, help="BLAS threads for runnx, intra-op threads for onnxruntime")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=1, help="timed runs per runtime (the best is reported)")
    parser.add_argument("--profile", action="store_true", help="print runnx's per-op profile of a timed run")
    parser.add_argument("--skip-onnxruntime", action="store_true")
    parser.add_argument("--json", action="store_true", help="one JSON line of the figures (no profile)")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    for name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # before numpy loads BLAS
        os.environ[name] = str(args.threads)
    import runnx
    from runnx.generate.generator import Generator

    profile = runnx.Profile() if args.profile else None
    started = time.perf_counter()
    generator = Generator.from_folder(args.model_dir, profile=profile)
    loads = {"runnx": time.perf_counter() - started}
    loaded_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # MiB (Linux: KiB), before any run
    say = (lambda *_: None) if args.json else print
    say(f"runnx load {loads['runnx']:.1f} s, peak RSS {loaded_rss:.0f} MiB")
    prompt = generator.tokenizer.encode(TEXT)[:args.prompt_tokens]
    if len(prompt) != args.prompt_tokens:
        sys.exit(f"the benchmark text has only {len(prompt)} tokens")

    def runnx_run(new_tokens):
        generator.start(max_new_tokens=new_tokens, stop_token_ids=())
        generator.append_tokens(prompt)
        ids = generator.run_until_done()[0]
        stats = generator.stats
        return list(ids), stats.first_token_seconds, stats.total_seconds

    results = {"runnx": _timed(runnx_run, args, lambda: profile.__init__() if profile else None)}
    if profile is not None:
        say(profile.summary(30))
    if not args.skip_onnxruntime:
        started = time.perf_counter()
        runner = _onnxruntime_runner(args.model_dir / "model.onnx", prompt, args.threads)
        loads["onnxruntime"] = time.perf_counter() - started
        say(f"onnxruntime load {loads['onnxruntime']:.1f} s")
        results["onnxruntime"] = _timed(runner, args, None)
    if args.json:
        print(json.dumps({"model": str(args.model_dir), "threads": args.threads, "prompt_tokens": args.prompt_tokens,
                          "new_tokens": args.new_tokens, "same_ids": len({str(r[0]) for r in results.values()}) == 1,
                          **{name: {"load_s": loads[name], "cold_first_token_s": cold, "first_token_s": first,
                                    "decode_tps": (len(ids) - 1) / (total - first)}
                             for name, (ids, first, total, cold) in results.items()},
                          "runnx_loaded_rss_mib": loaded_rss}))
        return 0

    print(f"\n{args.prompt_tokens}-token prompt, {args.new_tokens} new tokens, {args.threads} thread(s)")
    print(f"{'runtime':<14}{'first token ms':>16}{'decode tok/s':>14}{'ms/token':>10}")
    for name, (ids, first, total, _) in results.items():
        per_token = (total - first) / (len(ids) - 1)
        print(f"{name:<14}{first * 1e3:>16.0f}{1 / per_token:>14.2f}{per_token * 1e3:>10.1f}")
    if len(results) == 2:
        same = results["runnx"][0] == results["onnxruntime"][0]
        print(f"same token ids: {same}")
    print("continuation:", repr(generator.tokenizer.decode(results["runnx"][0])))
    return 0


def _timed(run, args, before_timed):
    """The best of the timed runs, and the first token time of the warm-up run before them."""
    cold = run(4)[1]  # warm-up: numba compilation, plan caches, page faults of the weights
    best = None
    for _ in range(args.repeats):
        if before_timed is not None:
            before_timed()
        result = run(args.new_tokens)
        if best is None or result[2] < best[2]:
            best = result
    return (*best, cold)


def _onnxruntime_runner(path: Path, prompt: list[int], threads: int):
    import numpy as np
    import onnxruntime as ort
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    past_inputs = [i for i in session.get_inputs() if i.name.startswith("past_key_values.")]
    output_names = [o.name for o in session.get_outputs()]

    def run(new_tokens):
        cache = {i.name: np.zeros((1, i.shape[1], 0, i.shape[3]), np.float32) for i in past_inputs}
        ids, seen, out, first = prompt, 0, [], 0.0
        started = time.perf_counter()
        for step in range(new_tokens):
            total = seen + len(ids)
            feed = {"input_ids": np.array([ids], np.int64), "attention_mask": np.ones((1, total), np.int64),
                    "position_ids": np.arange(seen, total, dtype=np.int64)[None], **cache}
            outputs = dict(zip(output_names, session.run(None, feed)))
            token = int(outputs["logits"][0, -1].argmax())
            if step == 0:
                first = time.perf_counter() - started
            out.append(token)
            cache = {name: outputs[name.replace("past_key_values.", "present.")] for name in cache}
            seen, ids = total, [token]
        return out, first, time.perf_counter() - started

    return run


if __name__ == "__main__":
    raise SystemExit(main())
