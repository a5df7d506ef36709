"""One onnxruntime contrib node (domain com.microsoft unless told) run by runnx and by onnxruntime,
for the contrib op-family tests: onnxruntime is the reference."""
from __future__ import annotations

import numpy as np
import onnxruntime
from onnx import helper, numpy_helper

import runnx
from runnx.interp.dtypes import onnx_type
from runnx.runtime import pool as decode_pool

MS = "com.microsoft"


def contrib_model(op_type, inputs, outputs, *, domain=MS, initializers=(), **attributes):
    """A single-node model: `inputs` arrays (None: an absent optional input), `outputs` names ("" absent);
    inputs at positions in `initializers` become initializers (weights, as exporters write them)."""
    names = [f"in{i}" if x is not None else "" for i, x in enumerate(inputs)]
    node = helper.make_node(op_type, names, list(outputs), domain=domain, **attributes)
    feeds = [helper.make_tensor_value_info(n, onnx_type(x.dtype), x.shape)
             for i, (n, x) in enumerate(zip(names, inputs)) if n and i not in initializers]
    weights = [numpy_helper.from_array(x, n)
               for i, (n, x) in enumerate(zip(names, inputs)) if n and i in initializers]
    graph = helper.make_graph([node], "contrib", feeds,
                              [helper.make_value_info(n, helper.TypeProto()) for n in outputs if n], weights)
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid(MS, 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=10), {
        n: x for i, (n, x) in enumerate(zip(names, inputs)) if n and i not in initializers}


def run_both(op_type, inputs, *, outputs=1, domain=MS, initializers=(), **attributes):
    """(runnx's outputs, onnxruntime's outputs) as lists, for the requested outputs.

    `outputs` is a count, or a sequence of booleans saying which output positions are requested."""
    wanted = [True] * outputs if isinstance(outputs, int) else list(outputs)
    names = [f"out{i}" if w else "" for i, w in enumerate(wanted)]
    while names and not names[-1]:
        names.pop()
    model, feeds = contrib_model(op_type, inputs, names, domain=domain, initializers=initializers, **attributes)
    requested = [n for n in names if n]
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = 1
    options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = onnxruntime.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    expected = session.run(requested, feeds)
    got = runnx.load(model).run({n: np.array(x, copy=True) for n, x in feeds.items()})
    return [got[n] for n in requested], expected


def assert_close(got, expected, rtol=1e-5, atol=1e-5):
    for g, e in zip(got, expected, strict=True):
        assert g.dtype == e.dtype, (g.dtype, e.dtype)
        assert g.shape == e.shape, (g.shape, e.shape)
        np.testing.assert_allclose(g.astype(np.float64), e.astype(np.float64), rtol=rtol, atol=atol)


def alone_and_with_workers(run):
    """(run() with no decode pool workers, run() with two): a result the pool shares out must not
    depend on it."""
    try:
        decode_pool.set_workers(0)
        alone = run()
        decode_pool.set_workers(2)
        shared = run()
    finally:
        decode_pool.set_workers(None)
    return alone, shared
