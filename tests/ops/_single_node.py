"""Run one ONNX node through runnx.load (so registration, opset resolution and attribute checks are
exercised too), for the op-family tests."""
from __future__ import annotations

import numpy as np
from onnx import helper

import runnx
from runnx.interp.dtypes import onnx_type


def run_node(op_type, inputs, *, outputs=1, opset=18, owned=False, check_inplace=True, profile=False, **attributes):
    """Outputs of `op_type` applied to `inputs` (arrays; None for a missing optional input).

    owned=True hands every input over (runnx.Owned), so in-place kernels may write into it;
    check_inplace then recomputes each in-place step out of place and compares.
    """
    names = [f"in{i}" if x is not None else "" for i, x in enumerate(inputs)]
    out_names = [f"out{i}" for i in range(outputs)]
    node = helper.make_node(op_type, names, out_names, **attributes)
    graph = helper.make_graph(
        [node], "single",
        [helper.make_tensor_value_info(n, onnx_type(x.dtype), x.shape) for n, x in zip(names, inputs) if n],
        [helper.make_value_info(n, helper.TypeProto()) for n in out_names])
    model = runnx.load(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]),
                       check_inplace=check_inplace)
    feeds = {n: runnx.Owned(np.array(x, copy=True)) if owned else x for n, x in zip(names, inputs) if n}
    result = model.run(feeds, profile=profile)
    values, record = result if profile else (result, None)
    got = tuple(values[n] for n in out_names)
    got = got[0] if outputs == 1 else got
    return (got, record) if profile else got
