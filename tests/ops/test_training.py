"""Optimiser steps (ai.onnx.preview.training) against the update rules written out."""
from __future__ import annotations

import numpy as np
from onnx import helper

import runnx
from runnx.interp.dtypes import onnx_type

RNG = np.random.default_rng(8)
DOMAIN = "ai.onnx.preview.training"


def run_training_op(op, inputs, outputs, **attributes):
    names = [f"in{i}" for i in range(len(inputs))]
    out_names = [f"out{i}" for i in range(outputs)]
    graph = helper.make_graph(
        [helper.make_node(op, names, out_names, domain=DOMAIN, **attributes)], "step",
        [helper.make_tensor_value_info(n, onnx_type(x.dtype), x.shape) for n, x in zip(names, inputs)],
        [helper.make_value_info(n, helper.TypeProto()) for n in out_names])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(DOMAIN, 1)])
    values = runnx.load(model).run(dict(zip(names, inputs)))
    return [values[n] for n in out_names]


def tensors(count):
    return [RNG.standard_normal((2, 3)).astype(np.float32) for _ in range(count)]


def test_adagrad_two_tensors():
    x1, x2, g1, g2, h1, h2 = tensors(6)
    h1, h2 = np.abs(h1), np.abs(h2)
    r, t = np.array(0.1, np.float32), np.array(3, np.int64)
    got = run_training_op("Adagrad", [r, t, x1, x2, g1, g2, h1, h2], 4, decay_factor=0.5, epsilon=1e-5,
                          norm_coefficient=0.01)
    rate = 0.1 / (1 + 3 * 0.5)
    for x, g, h, new_x, new_h in ((x1, g1, h1, got[0], got[2]), (x2, g2, h2, got[1], got[3])):
        g = 0.01 * x + g
        np.testing.assert_allclose(new_h, h + g * g, rtol=1e-5)
        np.testing.assert_allclose(new_x, x - rate * g / (np.sqrt(h + g * g) + 1e-5), rtol=1e-5)


def test_momentum_first_step_takes_the_whole_gradient():
    x, g, v = tensors(3)
    r = np.array(0.1, np.float32)
    for mode in ("standard", "nesterov"):
        first = run_training_op("Momentum", [r, np.array(0, np.int64), x, g, v], 2, alpha=0.9, beta=0.5, mode=mode,
                                norm_coefficient=0.0)
        later = run_training_op("Momentum", [r, np.array(1, np.int64), x, g, v], 2, alpha=0.9, beta=0.5, mode=mode,
                                norm_coefficient=0.0)
        np.testing.assert_allclose(first[1], 0.9 * v + g, rtol=1e-5)
        np.testing.assert_allclose(later[1], 0.9 * v + 0.5 * g, rtol=1e-5)
        step = later[1] if mode == "standard" else g + 0.9 * later[1]
        np.testing.assert_allclose(later[0], x - 0.1 * step, rtol=1e-5)


def test_adam_bias_correction():
    x, g, v, h = tensors(4)
    h = np.abs(h)
    got = run_training_op("Adam", [np.array(0.01, np.float32), np.array(2, np.int64), x, g, v, h], 3, alpha=0.9,
                          beta=0.99, epsilon=1e-6, norm_coefficient_post=0.1)
    v_new, h_new = 0.9 * v + 0.1 * g, 0.99 * h + 0.01 * g * g
    rate = 0.01 * np.sqrt(1 - 0.99 ** 2) / (1 - 0.9 ** 2)
    np.testing.assert_allclose(got[1], v_new, rtol=1e-5)
    np.testing.assert_allclose(got[2], h_new, rtol=1e-5)
    np.testing.assert_allclose(got[0], 0.9 * (x - rate * v_new / (np.sqrt(h_new) + 1e-6)), rtol=1e-5)
