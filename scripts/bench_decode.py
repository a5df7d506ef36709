"""Decode step speed at a given context: runnx (optimisations on, and all off) vs onnxruntime on the
same Optimum `model.onnx`, the same thread count, interleaved rounds so both see the same machine load.

    python scripts/bench_decode.py [MODEL_DIR] [--variant fp16] [--threads 1] [--contexts 32 512 2000] [--steps 16] [--rounds 3]

--variant NAME reads a transformers.js folder's `onnx/model_NAME.onnx` (fp16, q4f16, q4, quantized, ...). An
onnxruntime-genai folder's `model.onnx` works too (its KV runs as a growing past, not a shared buffer).
The past is random (shape-correct) KV of `context` tokens; each step feeds one token and its own
outputs back, as greedy decoding does (runnx: KV in capacity buffers handed over as runnx.Owned;
onnxruntime: the present outputs). Reports median tokens/s, runnx node executions per step, and
whether the greedy ids of runnx and onnxruntime agree; --json prints them as one JSON line instead,
with the op types runnx executed in a step (scripts/bench_architectures.py reads it).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from report import set_threads  # scripts/ is this script's own folder on sys.path


def parse_args():
    cache = Path(os.environ.get("RUNNX_CACHE") or Path.home() / ".cache" / "runnx").expanduser()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", nargs="?", type=Path, default=cache / "models" / "smollm2-135m")
    parser.add_argument("--variant", help="a transformers.js folder's onnx/model_VARIANT.onnx (default: model.onnx)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--contexts", type=int, nargs="+", default=[32, 512, 2000])
    parser.add_argument("--steps", type=int, default=16, help="decode steps per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-baseline", action="store_true", help="skip runnx with shape_cache and fuse off")
    parser.add_argument("--json", action="store_true", help="one JSON line: tokens/s, nodes and op types per step")
    return parser.parse_args()


ARGS = parse_args()
set_threads(ARGS.threads)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import runnx  # noqa: E402

import numpy as np  # noqa: E402


def _past_names(model):
    return [n for n in model.input_names if n.startswith("past_key_values.")]


def _feeds(declared, token: int, length: int, cache: dict) -> dict:
    """One step's feeds, only those the model declares (an onnxruntime-genai export has no position_ids)."""
    feeds = {"input_ids": np.array([[token]]), "attention_mask": np.ones((1, length + 1), np.int64),
             "position_ids": np.array([[length]]), **cache}
    return {name: value for name, value in feeds.items() if name in declared}


def _kv_dims(shape) -> tuple[int, int]:
    """KV heads and head size: the past input's declared dims, else the folder's layout (a genai
    export names them symbolically; genai_config.json states them)."""
    if isinstance(shape[1], int) and isinstance(shape[3], int):
        return shape[1], shape[3]
    from runnx.generate.layouts import read_folder
    config = read_folder(ARGS.model_dir, ARGS.variant).config
    return config["num_key_value_heads"], config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def runnx_decoder(model, context: int, steps: int, past: dict):
    names = _past_names(model)

    def run():
        cache = {n: runnx.with_capacity(past[n], 2, context + steps + 1) for n in names}
        token, ids, times, profile = 1, [], [], runnx.Profile()
        for step in range(steps):
            length = context + step
            feeds = _feeds(model.input_names, token, length, cache)
            start = time.perf_counter()
            outputs = model.run(feeds, profile=profile if step == steps - 1 else False)
            times.append(time.perf_counter() - start)
            token = int(outputs["logits"][0, -1].argmax())
            ids.append(token)
            cache = {n: runnx.Owned(outputs[n.replace("past_key_values.", "present.")]) for n in names}
        return ids, times, dict(profile.op_calls)

    return run


def ort_decoder(session, context: int, steps: int, past: dict):
    output_names = [o.name for o in session.get_outputs()]
    declared = [i.name for i in session.get_inputs()]

    def run():
        cache = dict(past)
        token, ids, times = 1, [], []
        for step in range(steps):
            length = context + step
            feeds = _feeds(declared, token, length, cache)
            start = time.perf_counter()
            outputs = dict(zip(output_names, session.run(None, feeds)))
            times.append(time.perf_counter() - start)
            token = int(outputs["logits"][0, -1].argmax())
            ids.append(token)
            cache = {n: outputs[n.replace("past_key_values.", "present.")] for n in cache}
        return ids, times, None

    return run


def main():
    import onnxruntime

    path = ARGS.model_dir / "onnx" / f"model_{ARGS.variant}.onnx" if ARGS.variant else ARGS.model_dir / "model.onnx"
    runners = {"runnx": runnx.load(path, threads=ARGS.threads)}
    if not ARGS.no_baseline:
        runners["runnx (no cache/fusion)"] = runnx.load(path, threads=ARGS.threads, shape_cache=False, fuse=False)
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = ARGS.threads
    options.inter_op_num_threads = 1
    session = onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    model = runners["runnx"]
    spec = {i.name: i for i in session.get_inputs()}
    report = {"model": str(path), "threads": ARGS.threads, "contexts": {}}
    if not ARGS.json:
        print(f"{path}, {ARGS.threads} thread(s), {ARGS.steps} decode steps x {ARGS.rounds} rounds, median tokens/s")
        print(f"{'context':>8}" + "".join(f"{name:>26}" for name in [*runners, "onnxruntime"]) + f"{'nodes/step':>12}"
              f"{'same ids':>10}")
    rng = np.random.default_rng(0)
    heads, head_size = _kv_dims(spec[_past_names(model)[0]].shape)
    for context in ARGS.contexts:
        past = {n: rng.standard_normal((1, heads, context, head_size)).astype(
                    np.float16 if spec[n].type == "tensor(float16)" else np.float32) for n in _past_names(model)}
        runs = {name: runnx_decoder(m, context, ARGS.steps, past) for name, m in runners.items()}
        runs["onnxruntime"] = ort_decoder(session, context, ARGS.steps, past)
        times = {name: [] for name in runs}
        ids, op_calls = {}, None
        for name, run in runs.items():
            run()  # warm-up
        for _ in range(ARGS.rounds):
            for name, run in runs.items():
                ids[name], step_times, counted = run()
                times[name] += step_times
                if name == "runnx":
                    op_calls = counted
        same = ids["runnx"] == ids["onnxruntime"]
        speeds = {name: 1 / statistics.median(times[name]) for name in runs}
        nodes = sum(op_calls.values())
        report["contexts"][context] = {"tokens_per_second": speeds, "nodes_per_step": nodes, "op_calls": op_calls,
                                       "same_ids": same}
        if not ARGS.json:
            print(f"{context:>8}" + "".join(f"{speed:>26.1f}" for speed in speeds.values()) + f"{nodes:>12}"
                  f"{str(same):>10}")
    if ARGS.json:
        print(json.dumps(report))


if __name__ == "__main__":
    main()
