"""Recurrent layers: RNN, GRU (incl. linear_before_reset), LSTM (incl. peepholes, input_forget).

One driver runs every direction: the input projection X·Wᵀ + Wb is a single matmul over all time
steps; the loop over time then does one h·Rᵀ matmul per step, vectorised over the batch.
sequence_lens is honoured per batch entry: reverse directions read each sequence backwards from its
own last element, finished entries keep their state and write zeros into Y.
"""
from __future__ import annotations

import numpy as np

from runnx.errors import RunnxError
from runnx.ops.registry import register

Strs = tuple[str, ...] | None
Floats = tuple[float, ...] | None


def _sigmoid(x):
    return 0.5 * (1.0 + np.tanh(0.5 * x))  # overflow-free logistic


_ACTIVATIONS = {  # name -> (function of (x, alpha, beta), default alpha, default beta)
    "relu": (lambda x, a, b: np.maximum(x, 0), None, None),
    "tanh": (lambda x, a, b: np.tanh(x), None, None),
    "sigmoid": (lambda x, a, b: _sigmoid(x), None, None),
    "affine": (lambda x, a, b: a * x + b, 1.0, 0.0),
    "leakyrelu": (lambda x, a, b: np.where(x >= 0, x, a * x), 0.01, None),
    "thresholdedrelu": (lambda x, a, b: np.where(x > a, x, 0), 1.0, None),
    "scaledtanh": (lambda x, a, b: a * np.tanh(b * x), 1.0, 1.0),
    "hardsigmoid": (lambda x, a, b: np.clip(a * x + b, 0, 1), 0.2, 0.5),
    "elu": (lambda x, a, b: np.where(x >= 0, x, a * (np.exp(np.minimum(x, 0)) - 1)), 1.0, None),
    "softsign": (lambda x, a, b: x / (1 + np.abs(x)), None, None),
    "softplus": (lambda x, a, b: np.logaddexp(x, 0), None, None),
}


def _activations(names: Strs, alphas: Floats, betas: Floats, defaults: tuple[str, ...], directions: int):
    """One list of activation callables per direction (the spec lists them direction after direction)."""
    names = tuple(names) if names else defaults * directions
    if len(names) == len(defaults):
        names = names * directions
    if len(names) != len(defaults) * directions:
        raise RunnxError(f"expected {len(defaults) * directions} activations, got {len(names)}")
    functions = []
    for i, name in enumerate(names):
        if name.lower() not in _ACTIVATIONS:
            raise RunnxError(f"unknown recurrent activation '{name}'")
        fn, alpha, beta = _ACTIVATIONS[name.lower()]
        alpha = alphas[i] if alphas and i < len(alphas) else alpha
        beta = betas[i] if betas and i < len(betas) else beta
        functions.append(lambda x, fn=fn, a=alpha, b=beta: fn(x, a, b))
    count = len(defaults)
    return [functions[d * count:(d + 1) * count] for d in range(directions)]


def _run(x, w, r, b, sequence_lens, initial_states, *, direction: str, hidden_size: int, gates: int, layout: int,
         step):
    """Drive `step(direction, projected_x_t, states) -> states` over time for each direction.

    Returns Y (T, D, B, H) and the final states, each (D, B, H), in the ONNX layout chosen by `layout`."""
    if layout == 1:  # (B, T, I) -> (T, B, I); initial states (B, D, H) -> (D, B, H)
        x = x.transpose(1, 0, 2)
        initial_states = [None if s is None else s.transpose(1, 0, 2) for s in initial_states]
    steps, batch, _ = x.shape
    directions = 2 if direction == "bidirectional" else 1
    if w.shape[0] != directions or w.shape[1] != gates * hidden_size:
        raise RunnxError(f"W of shape {w.shape} does not fit direction '{direction}' and hidden_size {hidden_size}")
    lengths = (np.full(batch, steps, dtype=np.int64) if sequence_lens is None
               else np.asarray(sequence_lens, dtype=np.int64))
    y = np.zeros((steps, directions, batch, hidden_size), dtype=x.dtype)
    finals = [np.empty((directions, batch, hidden_size), dtype=x.dtype) for _ in initial_states]
    rows = np.arange(batch)
    for d in range(directions):
        backwards = direction == "reverse" or d == 1
        bias_w = b[d, :gates * hidden_size] if b is not None else 0
        projected = x @ w[d].T.astype(x.dtype, copy=False) + bias_w  # (T, B, G*H)
        states = tuple(np.zeros((batch, hidden_size), dtype=x.dtype) if s is None else s[d].astype(x.dtype)
                       for s in initial_states)
        for t in range(steps):
            active = t < lengths
            time = np.where(active, lengths - 1 - t, 0) if backwards else np.full(batch, t)
            updated = step(d, projected[time, rows], states)
            states = tuple(np.where(active[:, None], new, old) for new, old in zip(updated, states))
            y[time[active], d, rows[active]] = states[0][active]
        for final, state in zip(finals, states):
            final[d] = state
    if layout == 1:
        return y.transpose(2, 0, 1, 3), [f.transpose(1, 0, 2) for f in finals]
    return y, finals


def _recurrence_bias(b, d, gates, hidden_size):
    return b[d, gates * hidden_size:] if b is not None else 0


def _clipped(value, clip):
    return value if clip is None else np.clip(value, -clip, clip)


@register("RNN", since=1)
def RNN(x, w, r, b=None, sequence_lens=None, initial_h=None, *, activation_alpha: Floats = None,
        activation_beta: Floats = None, activations: Strs = None, clip: float | None = None,
        direction: str = "forward", hidden_size: int, layout: int = 0, output_sequence: int = 0):
    functions = _activations(activations, activation_alpha, activation_beta, ("Tanh",),
                             2 if direction == "bidirectional" else 1)

    def step(d, projected, states):
        (h,) = states
        f = functions[d][0]
        return (f(_clipped(projected + h @ r[d].T + _recurrence_bias(b, d, 1, hidden_size), clip)),)

    y, (y_h,) = _run(x, w, r, b, sequence_lens, [initial_h], direction=direction, hidden_size=hidden_size,
                     gates=1, layout=layout, step=step)
    return y, y_h


@register("GRU", since=1)
def GRU(x, w, r, b=None, sequence_lens=None, initial_h=None, *, activation_alpha: Floats = None,
        activation_beta: Floats = None, activations: Strs = None, clip: float | None = None,
        direction: str = "forward", hidden_size: int, layout: int = 0, linear_before_reset: int = 0,
        output_sequence: int = 0):
    functions = _activations(activations, activation_alpha, activation_beta, ("Sigmoid", "Tanh"),
                             2 if direction == "bidirectional" else 1)
    size = hidden_size

    def step(d, projected, states):
        (h,) = states
        f, g = functions[d]
        rb = _recurrence_bias(b, d, 3, size) if b is not None else np.zeros(3 * size, dtype=x.dtype)
        hz_hr = h @ r[d, :2 * size].T + rb[:2 * size]
        z = f(_clipped(projected[:, :size] + hz_hr[:, :size], clip))
        reset = f(_clipped(projected[:, size:2 * size] + hz_hr[:, size:], clip))
        if linear_before_reset:
            candidate = projected[:, 2 * size:] + reset * (h @ r[d, 2 * size:].T + rb[2 * size:])
        else:
            candidate = projected[:, 2 * size:] + (reset * h) @ r[d, 2 * size:].T + rb[2 * size:]
        h_tilde = g(_clipped(candidate, clip))
        return ((1 - z) * h_tilde + z * h,)

    y, (y_h,) = _run(x, w, r, b, sequence_lens, [initial_h], direction=direction, hidden_size=hidden_size,
                     gates=3, layout=layout, step=step)
    return y, y_h


@register("LSTM", since=1)
def LSTM(x, w, r, b=None, sequence_lens=None, initial_h=None, initial_c=None, p=None, *,
         activation_alpha: Floats = None, activation_beta: Floats = None, activations: Strs = None,
         clip: float | None = None, direction: str = "forward", hidden_size: int, input_forget: int = 0,
         layout: int = 0, output_sequence: int = 0):
    functions = _activations(activations, activation_alpha, activation_beta, ("Sigmoid", "Tanh", "Tanh"),
                             2 if direction == "bidirectional" else 1)
    size = hidden_size

    def step(d, projected, states):
        h, c = states
        f, g, act_h = functions[d]
        gates = projected + h @ r[d].T + _recurrence_bias(b, d, 4, size)  # order i, o, f, c
        peep_i, peep_o, peep_f = (p[d, :size], p[d, size:2 * size], p[d, 2 * size:]) if p is not None else (0, 0, 0)
        i = f(_clipped(gates[:, :size] + peep_i * c, clip))
        forget = 1 - i if input_forget else f(_clipped(gates[:, 2 * size:3 * size] + peep_f * c, clip))
        c_new = forget * c + i * g(_clipped(gates[:, 3 * size:], clip))
        o = f(_clipped(gates[:, size:2 * size] + peep_o * c_new, clip))
        return o * act_h(c_new), c_new

    y, (y_h, y_c) = _run(x, w, r, b, sequence_lens, [initial_h, initial_c], direction=direction,
                         hidden_size=hidden_size, gates=4, layout=layout, step=step)
    return y, y_h, y_c
