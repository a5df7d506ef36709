"""Optimiser steps of the ai.onnx.preview.training domain: Adagrad, Momentum (standard and Nesterov), Adam.

Each takes a learning rate R and step count T, then n tensors to optimise followed by their
gradients and per-tensor state, and returns the updated tensors then the updated state, in the
spec's order. Results keep the dtype of the tensor they update.
"""
from __future__ import annotations

import numpy as np

from runnx.errors import RunnxError
from runnx.ops.registry import register

DOMAIN = "ai.onnx.preview.training"


def _groups(inputs: tuple, count: int, op: str) -> list[tuple]:
    """Split the variadic inputs into `count` equal groups (tensors, gradients, states...)."""
    if len(inputs) % count or not inputs:
        raise RunnxError(f"{op} expects {count} equally long groups of tensors, got {len(inputs)} inputs")
    n = len(inputs) // count
    return [inputs[i * n:(i + 1) * n] for i in range(count)]


@register("Adagrad", since=1, domain=DOMAIN)
def Adagrad(r, t, *inputs, decay_factor: float = 0.0, epsilon: float = 0.0, norm_coefficient: float = 0.0):
    xs, gs, hs = _groups(inputs, 3, "Adagrad")
    rate = float(r) / (1 + float(t) * decay_factor)
    new_x, new_h = [], []
    for x, g, h in zip(xs, gs, hs):
        g = norm_coefficient * x + g
        h_next = h + g * g
        new_x.append((x - rate * g / (np.sqrt(h_next) + epsilon)).astype(x.dtype))
        new_h.append(h_next.astype(h.dtype))
    return tuple(new_x + new_h)


@register("Momentum", since=1, domain=DOMAIN)
def Momentum(r, t, *inputs, alpha: float, beta: float, mode: str, norm_coefficient: float):
    if mode not in ("standard", "nesterov"):
        raise RunnxError(f"Momentum mode must be 'standard' or 'nesterov', got '{mode}'")
    xs, gs, vs = _groups(inputs, 3, "Momentum")
    gradient_weight = beta if int(t) > 0 else 1.0  # the first step takes the whole gradient
    new_x, new_v = [], []
    for x, g, v in zip(xs, gs, vs):
        g = norm_coefficient * x + g
        v_next = alpha * v + gradient_weight * g
        step = v_next if mode == "standard" else g + alpha * v_next
        new_x.append((x - float(r) * step).astype(x.dtype))
        new_v.append(v_next.astype(v.dtype))
    return tuple(new_x + new_v)


@register("Adam", since=1, domain=DOMAIN)
def Adam(r, t, *inputs, alpha: float = 0.9, beta: float = 0.999, epsilon: float = 0.0, norm_coefficient: float = 0.0,
         norm_coefficient_post: float = 0.0):
    xs, gs, vs, hs = _groups(inputs, 4, "Adam")
    steps = int(t)
    rate = float(r)
    if steps > 0:  # bias correction of both moments
        rate = rate * np.sqrt(1 - beta ** steps) / (1 - alpha ** steps)
    new_x, new_v, new_h = [], [], []
    for x, g, v, h in zip(xs, gs, vs, hs):
        g = norm_coefficient * x + g
        v_next = alpha * v + (1 - alpha) * g
        h_next = beta * h + (1 - beta) * g * g
        x_next = x - rate * (v_next / (np.sqrt(h_next) + epsilon))
        new_x.append(((1 - norm_coefficient_post) * x_next).astype(x.dtype))
        new_v.append(v_next.astype(v.dtype))
        new_h.append(h_next.astype(h.dtype))
    return tuple(new_x + new_v + new_h)
