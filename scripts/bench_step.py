"""Where runnx's SmolLM2-135M decode step goes, and what it would cost without Python between its
kernels, in one process. Prints only.

    .venv/bin/python scripts/bench_step.py [--threads 2] [--contexts 32,2000]

The split: the step's one-row products (the weights streamed from memory; the decode pool's jobs
with two threads), its attention over the KV cache, and everything else (the nodes' Python, the
compiled plan, the shape memos), by wall clock around the kernels' entry points. The products
count from the call into the pool (or into the one-thread loop, or into a native block such as
ResidualGatedMLP's, its residual adds and norms included, or a call the step deferred that reads
weight matrices) to its return, their Python included; GB/s is the matrices' bytes over that time.
The attention counts from the numba kernel's entry (`_attend_kernel`) on, or a deferred call
reading no weights (the decode attention's job, its rotary embedding and cache append with it).

The bound: all 30 layers' products, KV appends, attention, residual adds, RMSNorms and SiLU gates
in one numba loop that posts the pool's own compiled jobs (`post_products`, `post_attention`), on random
weights of the real shapes, timed in alternating blocks against runnx's real step. Not a runner:
no rotary embedding, no mask, numba's exponentials in the SiLU, no shape bookkeeping; a product
costs what it costs in runnx, only the Python around them is gone. Sleeping workers are woken
before each step, as runnx's own calls wake them.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from report import set_threads  # noqa: E402


def _parse():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--contexts", default="32,2000")
    parser.add_argument("--steps", type=int, default=60, help="timed decode steps per context")
    parser.add_argument("--rounds", type=int, default=3, help="timed runs of the steps per context; medians")
    parser.add_argument("--blocks", type=int, default=10, help="alternating blocks per runner of the bound")
    parser.add_argument("--block-steps", type=int, default=10, help="steps per block of the bound")
    return parser.parse_args()


ARGS = _parse()
set_threads(ARGS.threads)

import runnx  # noqa: E402

import numba  # noqa: E402
import numpy as np  # noqa: E402

import bench  # noqa: E402
from runnx.ops import fused, linalg
from runnx.runtime import open_jobs, pool as decode_pool  # noqa: E402
from runnx.runtime.jobs import post_attention, post_products  # noqa: E402
from runnx.runtime.mailbox import make_board  # noqa: E402
from runnx.ops._kernels_fused import add_rms_norm_into  # noqa: E402

bench.runnx, bench.np = runnx, np
SPENT = {"products": 0.0, "attention": 0.0}
PRODUCT_BYTES = [0]
INSIDE = set()  # parts being timed: a call within a call of the same part (a pool job split in two) counts once


def _timed(part: str, fn, matrices=None):
    """fn, its wall time added to SPENT[part] (and its matrices' bytes counted, `matrices` picking
    them from the arguments)."""
    def timed(*args, **kwargs):
        if part in INSIDE:
            return fn(*args, **kwargs)
        INSIDE.add(part)
        begin = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            SPENT[part] += time.perf_counter() - begin
            INSIDE.discard(part)
            if matrices is not None:
                PRODUCT_BYTES[0] += sum(m.nbytes for m in matrices(args))
    return timed


def _after_queue(timed):
    """`timed` run after this thread's deferred calls, as its post would run them first: they are
    timed as calls of their own (`_timed_calls`), not as part of it."""
    def call(*args, **kwargs):
        open_jobs.run_deferred()
        return timed(*args, **kwargs)
    return call


def _weights(arguments) -> list:
    """The weight matrices among a call's arguments, or in tuples of them (2-D arrays of a pooled
    product's size)."""
    flat = [a for argument in arguments for a in (argument if isinstance(argument, tuple) else (argument,))]
    return [a for a in flat if getattr(a, "ndim", 0) == 2 and a.size >= 1 << 16]


def _timed_calls(run_calls):
    """`pool.run_calls` with each deferred call (a step's native blocks and jobs, queued by the
    plan: `runtime/open_jobs.py`) timed: products when it reads weight matrices, else attention."""
    def timed(calls):
        wrapped = [(_timed("products" if _weights(arguments) else "attention", function, _weights),
                    arguments, job) for function, arguments, job in calls]
        return run_calls(wrapped)
    return timed


@contextlib.contextmanager
def _instrumented():
    """The products' and the attention's entry points timed, while inside: the calls a step defers
    and those it makes at once."""
    originals = (decode_pool.DecodePool.products, linalg.rows_times_matrix, fused._attend_kernel,
                 decode_pool.shared_call, decode_pool.run_calls, decode_pool.DecodePool.column_products)
    decode_pool.DecodePool.products = _timed("products", originals[0], lambda a: a[2])
    decode_pool.DecodePool.column_products = _after_queue(_timed("products", originals[5], lambda a: a[2:3]))
    linalg.rows_times_matrix = _timed("products", originals[1], lambda a: a[1:2])
    fused._attend_kernel = _timed("attention", originals[2])
    decode_pool.shared_call = _timed("products", originals[3],  # native blocks (ResidualGatedMLP)
                                      lambda a: [m for m in a if getattr(m, "ndim", 0) == 2])
    decode_pool.run_calls = _timed_calls(originals[4])
    try:
        yield
    finally:
        (decode_pool.DecodePool.products, linalg.rows_times_matrix, fused._attend_kernel,
         decode_pool.shared_call, decode_pool.run_calls, decode_pool.DecodePool.column_products) = originals


LAYERS, HIDDEN, KV_HEADS, HEADS, DEPTH, INNER, VOCAB = 30, 576, 3, 9, 64, 1536, 49152
# a layer's matrices in order: q, k, v, o, gate, up, down
SHAPES = [(HIDDEN, HIDDEN), (HIDDEN, KV_HEADS * DEPTH), (HIDDEN, KV_HEADS * DEPTH), (HIDDEN, HIDDEN),
          (HIDDEN, INNER), (HIDDEN, INNER), (INNER, HIDDEN)]


@numba.njit(nogil=True)
def add_rms_norm(a, b, residual, epsilon, one, weight):
    """The norm of residual = a + b, a new row (what the fused AddRMSNorm computes)."""
    out = np.empty_like(residual)
    add_rms_norm_into(a.reshape((1, -1)), b.reshape((1, -1)), residual.reshape((1, -1)), epsilon, one, weight,
                      out.reshape((1, -1)))
    return out


@numba.njit(nogil=True)
def native_step(board, workers, x, weights, keys, values, head, norm, scratch, length):
    """One decode step of the layers' arithmetic over caches holding `length` positions; the
    greedy token."""
    residual = x.copy()
    hidden = add_rms_norm(residual, np.zeros_like(residual), residual, 1e-5, 1.0, norm)
    q, k, v = np.empty(HIDDEN, np.float32), np.empty(KV_HEADS * DEPTH, np.float32), np.empty(KV_HEADS * DEPTH, np.float32)
    o, d = np.empty(HIDDEN, np.float32), np.empty(HIDDEN, np.float32)
    gate, up = np.empty(INNER, np.float32), np.empty(INNER, np.float32)
    attended = np.empty((1, HEADS, 1, DEPTH), np.float32)
    for layer in range(LAYERS):
        w = 7 * layer
        post_products(board, workers, hidden, (weights[w], weights[w + 1], weights[w + 2]), (q, k, v), scratch,
                      0.0, 1.0)
        key_cache, value_cache = keys[layer], values[layer]
        for head_index in range(KV_HEADS):
            for j in range(DEPTH):
                key_cache[0, head_index, length, j] = k[head_index * DEPTH + j]
                value_cache[0, head_index, length, j] = v[head_index * DEPTH + j]
        post_attention(board, workers, q.reshape((1, HEADS, 1, DEPTH)), key_cache[:, :, :length + 1],
                       value_cache[:, :, :length + 1], None, 0.125, np.nan, attended)
        post_products(board, workers, attended.reshape(HIDDEN), (weights[w + 3],), (o,), scratch, 0.0, 1.0)
        hidden = add_rms_norm(residual, o, residual, 1e-5, 1.0, norm)
        post_products(board, workers, hidden, (weights[w + 4], weights[w + 5]), (gate, up), scratch, 0.0, 1.0)
        for j in range(INNER):
            gate[j] = gate[j] / (np.float32(1) + np.exp(-gate[j])) * up[j]
        post_products(board, workers, gate, (weights[w + 6],), (d,), scratch, 0.0, 1.0)
        hidden = add_rms_norm(residual, d, residual, 1e-5, 1.0, norm)
    logits = np.empty(VOCAB, np.float32)
    post_products(board, workers, hidden, (head,), (logits,), scratch, 0.0, 1.0)
    return logits.argmax()


class NativeBound:
    """The loop above on random weights and caches of `context` positions (and room for more)."""

    def __init__(self, context: int):
        rng = np.random.default_rng(0)
        self.weights = numba.typed.List([(rng.standard_normal(shape) * 0.02).astype(np.float32)
                                         for _ in range(LAYERS) for shape in SHAPES])
        self.head = (rng.standard_normal((HIDDEN, VOCAB)) * 0.02).astype(np.float32)
        capacity = (1, KV_HEADS, context + 8, DEPTH)
        self.keys = numba.typed.List([rng.standard_normal(capacity).astype(np.float32) for _ in range(LAYERS)])
        self.values = numba.typed.List([rng.standard_normal(capacity).astype(np.float32) for _ in range(LAYERS)])
        self.norm = rng.standard_normal(HIDDEN).astype(np.float32)
        self.x = rng.standard_normal(HIDDEN).astype(np.float32)
        self.scratch = np.empty(8 * VOCAB, np.float32)
        self.context = context

    def step(self) -> None:
        pool = decode_pool.pool()
        arguments = (self.x, self.weights, self.keys, self.values, self.head, self.norm, self.scratch, self.context)
        if pool is None:
            native_step(make_board()[0], 0, *arguments)
            return
        pool._wake_sleeping()
        with pool._lock:
            native_step(pool.board, pool._workers, *arguments)


TOKEN = np.array([[42]], np.int64)


def _started(engine, context: int, steps: int) -> tuple:
    """(past, length) after a first step from a random past of `context` positions, the cache with
    room for `steps` more."""
    past = engine.step(TOKEN, context, bench._random_past(engine.kv, context, np.random.default_rng(0)),
                       context + steps + 8)
    return past, context + 1


def _split(engine, context: int) -> dict:
    """Medians over rounds of {part: ms a step} and the products' GB/s at `context`."""
    past, length = _started(engine, context, (ARGS.rounds + 1) * ARGS.steps)
    for _ in range(ARGS.steps // 4):  # warm-up
        past = engine.step(TOKEN, length, past, 0)
        length += 1
    rounds = []
    for _ in range(ARGS.rounds):
        SPENT.update(products=0.0, attention=0.0)
        PRODUCT_BYTES[0] = 0
        begin = time.perf_counter()
        for _ in range(ARGS.steps):
            past = engine.step(TOKEN, length, past, 0)
            length += 1
        step = (time.perf_counter() - begin) / ARGS.steps
        products, attention = SPENT["products"] / ARGS.steps, SPENT["attention"] / ARGS.steps
        rounds.append({"step": step, "products": products, "attention": attention,
                       "rest": step - products - attention,
                       "GB/s": PRODUCT_BYTES[0] / ARGS.steps / products / 1e9 if products else 0.0})
    return {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}


def _bound_blocks(engine, context: int) -> dict:
    """{runner: [median step seconds of each block]}, runnx's real step and the bound alternating."""
    past, length = _started(engine, context, ARGS.blocks * ARGS.block_steps)
    bound = NativeBound(context)
    bound.step()
    times = {"runnx": [], "native": []}
    for block in range(ARGS.blocks):
        for name in ("runnx", "native") if block % 2 == 0 else ("native", "runnx"):
            time.sleep(0.02)
            steps = []
            for _ in range(ARGS.block_steps):
                begin = time.perf_counter()
                if name == "runnx":
                    past = engine.step(TOKEN, length, past, 0)
                    length += 1
                else:
                    bound.step()
                steps.append(time.perf_counter() - begin)
            times[name].append(statistics.median(steps))
    return times


def main() -> None:
    if not bench.SMOLLM2.exists():
        sys.exit(f"{bench.SMOLLM2} is missing: run `make models` first")
    engine = bench._Runnx(bench.SMOLLM2, ARGS.threads)
    contexts = [int(c) for c in ARGS.contexts.split(",")]
    print(f"SmolLM2-135M decode step in runnx, {ARGS.threads} thread(s), medians of {ARGS.rounds} runs of "
          f"{ARGS.steps} steps (ms a step)")
    print(f"{'context':>8}{'step':>9}{'products':>10}{'GB/s':>7}{'attention':>11}{'rest':>8}")
    with _instrumented():
        for context in contexts:
            split = _split(engine, context)
            print(f"{context:>8}{split['step'] * 1e3:>9.2f}{split['products'] * 1e3:>10.2f}{split['GB/s']:>7.1f}"
                  f"{split['attention'] * 1e3:>11.2f}{split['rest'] * 1e3:>8.2f}", flush=True)
    print(f"\nthe same step with no Python between its kernels (the bound), {ARGS.blocks} alternating blocks of "
          f"{ARGS.block_steps} steps (ms a step)")
    print(f"{'context':>8}{'runnx':>9}{'native':>9}{'ratio':>8}{'block ratios':>14}")
    for context in contexts:
        times = _bound_blocks(engine, context)
        ratios = [native / mine for native, mine in zip(times["native"], times["runnx"])]
        print(f"{context:>8}{statistics.median(times['runnx']) * 1e3:>9.2f}"
              f"{statistics.median(times['native']) * 1e3:>9.2f}{statistics.median(ratios):>7.2f}x"
              f"{min(ratios):>8.2f}-{max(ratios):.2f}", flush=True)


if __name__ == "__main__":
    main()
