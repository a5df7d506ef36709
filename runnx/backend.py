"""runnx as an `onnx.backend.base.Backend` (the conventional name, like `onnxruntime.backend`).

    import runnx.backend
    rep = runnx.backend.prepare(model_proto)
    outputs = rep.run([x, y])          # positional or {name: array}
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx.backend.base import Backend, BackendRep

from runnx.errors import RunnxError
from runnx.interp.model import Model, load


class RunnxRep(BackendRep):
    def __init__(self, model: Model):
        self.model = model

    def run(self, inputs, **kwargs):
        names = self.model.input_names
        if isinstance(inputs, dict):
            feeds = dict(inputs)
        else:
            if isinstance(inputs, np.ndarray) or not isinstance(inputs, (list, tuple)):
                inputs = [inputs]
            feeds = dict(zip(names, inputs))
        feeds = {k: np.asarray(v) if isinstance(v, np.generic) else v for k, v in feeds.items()}
        result = self.model.run(feeds)
        return tuple(result[name] for name in self.model.output_names)


class RunnxBackend(Backend):
    @classmethod
    def is_compatible(cls, model, device="CPU", **kwargs):
        return cls.supports_device(device)

    @classmethod
    def prepare(cls, model, device="CPU", **kwargs):
        if not cls.supports_device(device):
            raise RunnxError(f"runnx runs on the CPU only, not on '{device}'")
        return RunnxRep(load(model, **kwargs))

    @classmethod
    def run_model(cls, model, inputs, device="CPU", **kwargs):
        return cls.prepare(model, device, **kwargs).run(inputs)

    @classmethod
    def run_node(cls, node, inputs, device="CPU", outputs_info=None, **kwargs):
        values = [np.asarray(v) for v in inputs]
        graph = onnx.helper.make_graph(
            [node], "run_node",
            [onnx.helper.make_tensor_value_info(name, onnx.helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
             for name, v in zip(node.input, values)],
            [onnx.helper.make_empty_tensor_value_info(name) for name in node.output])
        return cls.run_model(onnx.helper.make_model(graph), values, device)

    @classmethod
    def supports_device(cls, device: str) -> bool:
        return device.upper() == "CPU"


prepare = RunnxBackend.prepare
run_model = RunnxBackend.run_model
run_node = RunnxBackend.run_node
supports_device = RunnxBackend.supports_device
is_compatible = RunnxBackend.is_compatible
