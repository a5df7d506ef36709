"""Per-node dispatch overhead: chains of 1000 small elementwise ops, microseconds per node for runnx,
onnxruntime (1 thread) and onnx's ReferenceEvaluator; medians of several runs.

    python scripts/bench_dispatch.py [--nodes 1000] [--repeat 30] [--no-reference] [--json]

Three chains, none with shape bookkeeping to cache or anything to fuse, so they measure the
executor's hot loop and the elementwise kernels' per-call work:
- tiny: Add/Mul/Neg/Relu on 4 floats, the second input of Add/Mul a graph input of the same shape;
- bcast: Add/Mul/Sub on x [1, 8, 64], the second input of every other node a constant [64], a
  graph input [1, 1, 64] or a scalar constant (in turn), of the others a graph input [1, 8, 64];
- comp: Add/Sub/Mul on [1, 8, 64], both inputs computed values: v[i] = op(v[i-2], v[i-1]).
runnx is timed four ways: a first run after loading (planning included), the second run (the
compiling run: the plan is compiled to Python first), interpreted (every run through the
executor's loop, `compile_after=0`) and as a compiled plan (interp/compiled.py, from a plan's 2nd
run on: the default). With --json the figures are printed as one JSON object (keys "<chain>:
<runner>", onnxruntime with 1 thread; scripts/bench.py runs this once per round).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import runnx  # noqa: E402

OPSET = [helper.make_opsetid("", 18)]
WIDE = [1, 8, 64]


def _model(name: str, nodes: list, inputs: dict, output_shape: list, initializers=()):
    graph = helper.make_graph(nodes, name, [helper.make_tensor_value_info(n, TensorProto.FLOAT, s)
                                            for n, s in inputs.items()],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, output_shape)],
                              initializer=list(initializers))
    return helper.make_model(graph, opset_imports=OPSET, ir_version=10)


def _output(index: int, count: int) -> str:
    return "out" if index == count - 1 else f"v{index}"


def tiny_chain(count: int):
    """Add/Mul/Neg/Relu on 4 floats."""
    ops = ("Add", "Mul", "Neg", "Relu")
    nodes, previous = [], "x"
    for index in range(count):
        op = ops[index % len(ops)]
        inputs = [previous, "y"] if op in ("Add", "Mul") else [previous]
        nodes.append(helper.make_node(op, inputs, [_output(index, count)], name=f"n{index}"))
        previous = _output(index, count)
    return _model("tiny", nodes, {"x": [4], "y": [4]}, [4])


def broadcast_chain(count: int, rng):
    """Add/Mul/Sub on x [1, 8, 64]; every other node's second input broadcasts ([64] constant,
    [1, 1, 64] graph input, scalar constant), the others' is a graph input of x's shape. Every
    second operand lies in [0.5, 1]: the values stay normal floats over any length of chain."""
    ops = ("Add", "Mul", "Sub")
    seconds = ("c", "y", "b", "y", "s", "y")
    constants = [numpy_helper.from_array(rng.uniform(0.5, 1, 64).astype(np.float32), "c"),
                 numpy_helper.from_array(np.array(0.75, np.float32), "s")]
    nodes, previous = [], "x"
    for index in range(count):
        nodes.append(helper.make_node(ops[index % 3], [previous, seconds[index % 6]], [_output(index, count)],
                                      name=f"n{index}"))
        previous = _output(index, count)
    return _model("broadcast", nodes, {"x": WIDE, "y": WIDE, "b": [1, 1, 64]}, WIDE, constants)


def computed_chain(count: int):
    """v[i] = op(v[i-2], v[i-1]) cycling Add/Sub/Mul on [1, 8, 64] (v[-2], v[-1] the inputs x, y):
    both inputs computed, the first dying at its node (the order keeps the values normal floats)."""
    ops = ("Add", "Sub", "Mul")
    nodes, before, previous = [], "x", "y"
    for index in range(count):
        nodes.append(helper.make_node(ops[index % 3], [before, previous], [_output(index, count)], name=f"n{index}"))
        before, previous = previous, _output(index, count)
    return _model("computed", nodes, {"x": WIDE, "y": WIDE}, WIDE)


def per_node_us(run, count: int, repeat: int, warm: int = 2) -> float:
    """Median CPU time of this process per node: on a busy shared machine wall time mostly
    measures waiting for a core (the chains are single-threaded in all three runners). `warm` runs
    first (a runnx plan compiles on its 2nd run)."""
    for _ in range(warm):
        run()
    times = []
    for _ in range(repeat):
        start = time.process_time()
        run()
        times.append(time.process_time() - start)
    return statistics.median(times) / count * 1e6


def first_runs_us(model, feeds, count: int, loads: int) -> tuple[float, float]:
    """Medians over fresh loads of the first run's CPU time per node (planning included) and the
    second's (the plan compiled to Python first)."""
    first, second = [], []
    for _ in range(loads):
        runner = runnx.load(model)
        for times in (first, second):
            start = time.process_time()
            runner.run(feeds)
            times.append(time.process_time() - start)
    return statistics.median(first) / count * 1e6, statistics.median(second) / count * 1e6


def measure(name: str, model, feeds: dict, args, results: dict, ways: bool) -> None:
    """Time `model` in each runner, runnx's result checked against onnxruntime's."""
    prefix = f"{name}: " if ways else ""  # names of at most 26 characters: bench.py's table column
    runner = runnx.load(model)
    expected = runner.run(feeds)["out"]
    if ways:
        first, second = first_runs_us(model, feeds, args.nodes, 5)
        results[f"{prefix}runnx first run"] = first
        results[f"{prefix}runnx compiling run"] = second
        interpreted = runnx.load(model, compile_after=0)
        np.testing.assert_array_equal(interpreted.run(feeds)["out"], expected)
        results[f"{prefix}runnx interpreted"] = per_node_us(lambda: interpreted.run(feeds), args.nodes, args.repeat)
    results[f"{prefix}runnx compiled" if ways else "runnx"] = per_node_us(lambda: runner.run(feeds), args.nodes,
                                                                          args.repeat)
    np.testing.assert_array_equal(runner.run(feeds)["out"], expected)
    try:
        import onnxruntime
    except ImportError:
        return
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = 1
    options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL  # keep every node
    session = onnxruntime.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(session.run(None, feeds)[0], expected, rtol=1e-6)
    results[f"{prefix}onnxruntime" if ways else "onnxruntime (1 thread)"] = per_node_us(
        lambda: session.run(None, feeds), args.nodes, args.repeat)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--no-reference", action="store_true", help="skip onnx's ReferenceEvaluator (slow)")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    results = {}
    tiny = tiny_chain(args.nodes)
    tiny_feeds = {"x": np.linspace(-1, 1, 4, dtype=np.float32), "y": np.full(4, 0.5, np.float32)}
    measure("tiny", tiny, tiny_feeds, args, results, ways=False)
    if not args.no_reference:
        from onnx.reference import ReferenceEvaluator
        evaluator = ReferenceEvaluator(tiny)
        results["onnx ReferenceEvaluator"] = per_node_us(lambda: evaluator.run(None, tiny_feeds), args.nodes,
                                                         max(3, args.repeat // 10), warm=1)
    wide = {"x": rng.uniform(0.5, 1, WIDE).astype(np.float32), "y": rng.uniform(0.5, 1, WIDE).astype(np.float32)}
    measure("bcast", broadcast_chain(args.nodes, rng), {**wide, "b": rng.uniform(0.5, 1, (1, 1, 64))
                                                           .astype(np.float32)}, args, results, ways=True)
    measure("comp", computed_chain(args.nodes), wide, args, results, ways=True)
    if args.json:
        print(json.dumps(results))
        return
    print(f"{args.nodes}-node chains of small elementwise ops, us/node of CPU time: median of {args.repeat} runs")
    for name, value in results.items():
        print(f"  {name:<42}{value:8.2f} us/node")


if __name__ == "__main__":
    main()
