"""Per-node dispatch overhead: a chain of 1000 tiny ops (Add/Mul/Neg/Relu on 4 floats), microseconds per
node for runnx, onnxruntime (1 thread) and onnx's ReferenceEvaluator; medians of several runs.

    python scripts/bench_dispatch.py [--nodes 1000] [--repeat 30] [--no-reference] [--json]

The chain has no shape bookkeeping to cache and nothing to fuse: it measures the executor's hot loop.
With --json the figures are printed as one JSON object (scripts/bench.py runs this once per round).
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
from onnx import TensorProto, helper  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import runnx  # noqa: E402


def chain_model(count: int):
    ops = ("Add", "Mul", "Neg", "Relu")
    nodes, previous = [], "x"
    for index in range(count):
        op = ops[index % len(ops)]
        inputs = [previous, "y"] if op in ("Add", "Mul") else [previous]
        output = "out" if index == count - 1 else f"v{index}"
        nodes.append(helper.make_node(op, inputs, [output], name=f"n{index}"))
        previous = output
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4]),
                                               helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, [4])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def per_node_us(run, count: int, repeat: int) -> float:
    """Median CPU time of this process per node: on a busy shared machine wall time mostly
    measures waiting for a core (the chain is single-threaded in all three runners)."""
    run()  # warm-up (plans, caches)
    times = []
    for _ in range(repeat):
        start = time.process_time()
        run()
        times.append(time.process_time() - start)
    return statistics.median(times) / count * 1e6


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--no-reference", action="store_true", help="skip onnx's ReferenceEvaluator (slow)")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    args = parser.parse_args()
    model = chain_model(args.nodes)
    feeds = {"x": np.linspace(-1, 1, 4, dtype=np.float32), "y": np.full(4, 0.5, np.float32)}
    results = {}
    runner = runnx.load(model)
    expected = runner.run(feeds)["out"]
    results["runnx"] = per_node_us(lambda: runner.run(feeds), args.nodes, args.repeat)
    try:
        import onnxruntime
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = 1
        options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL  # keep every node
        session = onnxruntime.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        np.testing.assert_allclose(session.run(None, feeds)[0], expected, rtol=1e-6)
        results["onnxruntime (1 thread)"] = per_node_us(lambda: session.run(None, feeds), args.nodes, args.repeat)
    except ImportError:
        pass
    if not args.no_reference:
        from onnx.reference import ReferenceEvaluator
        evaluator = ReferenceEvaluator(model)
        results["onnx ReferenceEvaluator"] = per_node_us(lambda: evaluator.run(None, feeds), args.nodes,
                                                         max(3, args.repeat // 10))
    if args.json:
        print(json.dumps(results))
        return
    print(f"{args.nodes}-node chain of tiny ops, median CPU time of {args.repeat} runs")
    for name, value in results.items():
        print(f"  {name:<26}{value:8.2f} us/node")


if __name__ == "__main__":
    main()
