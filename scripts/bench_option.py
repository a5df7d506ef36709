"""A/B of one runnx setting on SmolLM2-135M decoding, in one process: the model loaded twice, with the
setting on and off, the two taking turns in blocks of steps at each context (as
scripts/bench_pairs.py alternates runners), their greedy tokens compared. Prints only.

    .venv/bin/python scripts/bench_option.py SETTING [--threads 2] [--contexts 32,2000] [--blocks 10]
        [--folder FOLDER]

SETTING is a boolean runnx.Options field (`inplace`, `shape_cache`, ...), `level:LEVEL` for an
optimization level (off: that level, on: `all`), or `pattern:NAME` for one fusion pattern (a
matcher of runnx.interp.fusion's PATTERNS, e.g. `pattern:_rope_projected`), left out when off. Ratios are on / off decode speed per pair of blocks (median and range). With more
than one thread it also gives each setting's median time a step spends outside the decode pool's
native calls (Python: the plan, the kernels' checks, shape memos), which end-to-end noise hides.
--folder: any decoder folder `DecoderStep.from_folder` reads (an onnxruntime-genai folder, a
transformers.js one) instead, its cache restored from random KV of each context, a boolean Options
field or `read_ahead` (external float weights read into huge pages, or memory-mapped) only; the
greedy tokens of a short prompt compared.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

from report import set_threads  # scripts/: this script's folder


def _parse():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("setting", help="a boolean runnx.Options field, level:LEVEL or pattern:NAME (a fusion pattern)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--contexts", default="32,2000")
    parser.add_argument("--blocks", type=int, default=10, help="blocks per setting and context")
    parser.add_argument("--steps", type=int, default=16, help="decode steps per block")
    parser.add_argument("--folder", help="a decoder folder of any layout, instead of SmolLM2's Optimum export")
    return parser.parse_args()


ARGS = _parse()
set_threads(ARGS.threads)

import runnx  # noqa: E402

import numpy as np  # noqa: E402

import bench  # noqa: E402
from runnx.interp import fusion  # noqa: E402
from runnx.runtime import pool as decode_pool  # noqa: E402

bench.runnx, bench.np = runnx, np
NATIVE = [0.0]  # seconds inside the decode pool's native calls so far


def _count_native(method):
    def counted(*arguments):
        begin = time.perf_counter()
        try:
            return method(*arguments)
        finally:
            NATIVE[0] += time.perf_counter() - begin
    return counted


class _Setting(bench._Runnx):
    """SmolLM2 with the setting on or off; records each step's time and its time outside native calls."""

    def __init__(self, path, on: bool):
        if ARGS.setting.startswith("pattern:"):
            name = ARGS.setting.removeprefix("pattern:")
            patterns = fusion.PATTERNS
            if not any(matcher.__name__ == name for _, matcher in patterns):
                sys.exit(f"no fusion pattern {name!r}: {', '.join(m.__name__ for _, m in patterns)}")
            fusion.PATTERNS = patterns if on else tuple(p for p in patterns if p[1].__name__ != name)
            try:
                self.model = runnx.load(path)
            finally:
                fusion.PATTERNS = patterns
        elif ARGS.setting.startswith("level:"):
            self.model = runnx.load(path, optimization_level="all" if on else ARGS.setting.removeprefix("level:"))
        else:
            self.model = runnx.load(path, **{ARGS.setting: on})
        self.kv = [(i.name, i.shape) for i in self.model.inputs if i.name.startswith("past_key_values.")]
        self.outside: list[float] = []

    def step(self, ids, past_length, past, capacity):
        native, begin = NATIVE[0], time.perf_counter()
        result = super().step(ids, past_length, past, capacity)
        self.outside.append(time.perf_counter() - begin - (NATIVE[0] - native))
        return result


def _greedy_tokens(engine, count: int = 12) -> list[int]:
    """Greedy ids from a short prompt, feeding each step's own cache back."""
    tokens, past, length = [1, 422, 3575], bench._random_past(engine.kv, 0, np.random.default_rng(0)), 0
    ids = np.array([tokens], np.int64)
    for _ in range(count):
        feeds = bench._decoder_feeds(ids, length, {n: runnx.with_capacity(v, 2, 64) if not isinstance(v, runnx.Owned)
                                                   else v for n, v in past.items()})
        result = engine.model.run(feeds)
        length += ids.shape[1]
        tokens.append(int(result["logits"][0, -1].argmax()))
        ids = np.array([[tokens[-1]]], np.int64)
        past = {n: runnx.Owned(result[n.replace("past_key_values", "present")]) for n, _ in engine.kv}
    return tokens


def _folder_decoder(on: bool, capacity: int):
    """The folder's decoder with the setting on or off (the generation API's load otherwise);
    `read_ahead` off: its external data memory-mapped whole (`ExternalData.read_ahead` left out)."""
    from runnx.generate.decoder import DecoderStep
    from runnx.interp.external_data import ExternalData
    options = {} if ARGS.setting == "read_ahead" else {ARGS.setting: on}
    load = lambda path: runnx.load(path, check_symbolic_dims=False, last_position=("logits",),  # noqa: E731
                                   **options)
    read_ahead = ExternalData.read_ahead
    if ARGS.setting == "read_ahead" and not on:
        ExternalData.read_ahead = lambda self, tensors: None
    try:
        return DecoderStep.from_folder(ARGS.folder, capacity=capacity, load=load)
    finally:
        ExternalData.read_ahead = read_ahead


def _folder_greedy(decoder, count: int = 12) -> list[int]:
    decoder.reset()
    ids = np.array([[1, 422, 3575]], np.int64)
    tokens = []
    for _ in range(count):
        tokens.append(int(decoder.step(ids)[0, -1].argmax()))
        ids = np.array([[tokens[-1]]], np.int64)
    return tokens


def _folder_main() -> None:
    """--folder: the two decoders take turns in blocks of steps from a restored random cache."""
    contexts = [int(c) for c in ARGS.contexts.split(",")]
    capacity = max(contexts) + 2 * ARGS.blocks * ARGS.steps + 64
    decoders = {"on": _folder_decoder(True, capacity), "off": _folder_decoder(False, capacity)}
    same = _folder_greedy(decoders["on"]) == _folder_greedy(decoders["off"])
    print(f"{ARGS.folder}, {ARGS.setting} on / off, {ARGS.threads} thread(s), {ARGS.blocks} alternating blocks of "
          f"{ARGS.steps} steps; greedy tokens identical: {same}")
    print(f"{'context':>8}{'on tok/s':>10}{'off tok/s':>11}{'ratio':>8}{'block ratios':>14}")
    rng = np.random.default_rng(0)
    token = np.array([[42]], np.int64)
    for context in contexts:
        for decoder in decoders.values():
            heads, head_dim, dtype = next(iter(decoder._layout.values()))
            names = [k.past for k in decoder.past_io.kv if not k.is_cross_attention]
            decoder.restore({name: rng.standard_normal((1, heads, context, head_dim)).astype(dtype) for name in names},
                            np.ones((1, context), np.int64))
            for _ in range(3):
                decoder.step(token)
        speeds = {"on": [], "off": []}
        for _ in range(ARGS.blocks):
            for name, decoder in decoders.items():
                times = []
                for _ in range(ARGS.steps):
                    begin = time.perf_counter()
                    decoder.step(token)
                    times.append(time.perf_counter() - begin)
                speeds[name].append(1 / statistics.median(times))
        ratios = [on / off for on, off in zip(speeds["on"], speeds["off"])]
        print(f"{context:>8}{statistics.median(speeds['on']):>10.1f}{statistics.median(speeds['off']):>11.1f}"
              f"{statistics.median(ratios):>7.3f}x{min(ratios):>8.2f}-{max(ratios):.2f}", flush=True)


def main() -> None:
    if ARGS.folder:
        return _folder_main()
    if not bench.SMOLLM2.exists():
        sys.exit(f"{bench.SMOLLM2} is missing: run `make models` first")
    engines = {"on": _Setting(bench.SMOLLM2, True), "off": _Setting(bench.SMOLLM2, False)}
    same = _greedy_tokens(engines["on"]) == _greedy_tokens(engines["off"])
    pool = decode_pool.DecodePool
    pool.call, pool.products = _count_native(pool.call), _count_native(pool.products)
    print(f"SmolLM2-135M decode, {ARGS.setting} on / off, {ARGS.threads} thread(s), {ARGS.blocks} alternating "
          f"blocks of {ARGS.steps} steps; greedy tokens identical: {same}")
    print(f"{'context':>8}{'on tok/s':>10}{'off tok/s':>11}{'ratio':>8}{'block ratios':>14}"
          + (f"{'outside native calls, on / off (ms a step)':>46}" if ARGS.threads > 1 else ""))
    for context in [int(c) for c in ARGS.contexts.split(",")]:
        for engine in engines.values():
            engine.outside.clear()
        speeds = bench.alternating_blocks(engines, context, ARGS.blocks, ARGS.steps)
        ratios = [on / off for on, off in zip(speeds["on"], speeds["off"])]
        line = (f"{context:>8}{statistics.median(speeds['on']):>10.1f}{statistics.median(speeds['off']):>11.1f}"
                f"{statistics.median(ratios):>7.3f}x{min(ratios):>8.2f}-{max(ratios):.2f}")
        if ARGS.threads > 1:
            outside = [statistics.median(engines[name].outside[1:]) * 1e3 for name in ("on", "off")]
            line += f"{outside[0]:>34.3f} / {outside[1]:.3f}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
