"""Recurrent layers against step-by-step references written from the ONNX equations."""
from __future__ import annotations

import numpy as np
import pytest

from tests.ops._single_node import run_node

RNG = np.random.default_rng(4)
T, B, I, H = 5, 3, 4, 6


def sigmoid(x):
    return 1 / (1 + np.exp(-x))


def reference_lstm(x, w, r, b, p, h, c, lengths=None, backwards=False):
    """One direction, batch entry by batch entry, time step by time step."""
    y = np.zeros((x.shape[0], x.shape[1], H))
    h, c = h.copy(), c.copy()
    wb, rb = b[:4 * H], b[4 * H:]
    for n in range(x.shape[1]):
        length = x.shape[0] if lengths is None else lengths[n]
        steps = range(length - 1, -1, -1) if backwards else range(length)
        for t in steps:
            gates = x[t, n] @ w.T + h[n] @ r.T + wb + rb
            i = sigmoid(gates[:H] + p[:H] * c[n])
            f = sigmoid(gates[2 * H:3 * H] + p[2 * H:] * c[n])
            c[n] = f * c[n] + i * np.tanh(gates[3 * H:])
            o = sigmoid(gates[H:2 * H] + p[H:2 * H] * c[n])
            h[n] = o * np.tanh(c[n])
            y[t, n] = h[n]
    return y, h, c


def reference_gru(x, w, r, b, h, linear_before_reset):
    y = np.zeros((x.shape[0], x.shape[1], H))
    h = h.copy()
    wb, rb = b[:3 * H], b[3 * H:]
    for t in range(x.shape[0]):
        xw = x[t] @ w.T + wb
        z = sigmoid(xw[:, :H] + h @ r[:H].T + rb[:H])
        reset = sigmoid(xw[:, H:2 * H] + h @ r[H:2 * H].T + rb[H:2 * H])
        if linear_before_reset:
            candidate = np.tanh(xw[:, 2 * H:] + reset * (h @ r[2 * H:].T + rb[2 * H:]))
        else:
            candidate = np.tanh(xw[:, 2 * H:] + (reset * h) @ r[2 * H:].T + rb[2 * H:])
        h = (1 - z) * candidate + z * h
        y[t] = h
    return y, h


def weights(gates, directions=1):
    return (RNG.standard_normal((directions, gates * H, I)).astype(np.float32) * 0.5,
            RNG.standard_normal((directions, gates * H, H)).astype(np.float32) * 0.5,
            RNG.standard_normal((directions, 2 * gates * H)).astype(np.float32) * 0.5)


def test_lstm_bidirectional_with_peepholes_and_sequence_lengths():
    x = RNG.standard_normal((T, B, I)).astype(np.float32)
    w, r, b = weights(4, 2)
    p = RNG.standard_normal((2, 3 * H)).astype(np.float32)
    h0 = RNG.standard_normal((2, B, H)).astype(np.float32)
    c0 = RNG.standard_normal((2, B, H)).astype(np.float32)
    lengths = np.array([5, 2, 4], np.int32)
    y, y_h, y_c = run_node("LSTM", [x, w, r, b, lengths, h0, c0, p], outputs=3, hidden_size=H,
                           direction="bidirectional")
    for d in range(2):
        ry, rh, rc = reference_lstm(x, w[d], r[d], b[d], p[d], h0[d], c0[d], lengths, backwards=d == 1)
        np.testing.assert_allclose(y[:, d], ry, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(y_h[d], rh, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(y_c[d], rc, rtol=1e-4, atol=1e-5)


def test_lstm_layout_1_is_batch_first():
    x = RNG.standard_normal((T, B, I)).astype(np.float32)
    w, r, b = weights(4)
    y0, h0 = run_node("LSTM", [x, w, r, b], outputs=2, hidden_size=H, opset=14)
    y1, h1 = run_node("LSTM", [x.transpose(1, 0, 2).copy(), w, r, b], outputs=2, hidden_size=H, layout=1, opset=14)
    np.testing.assert_allclose(y1, y0.transpose(2, 0, 1, 3), rtol=1e-6)
    np.testing.assert_allclose(h1, h0.transpose(1, 0, 2), rtol=1e-6)


@pytest.mark.parametrize("linear_before_reset", [0, 1])
def test_gru(linear_before_reset):
    x = RNG.standard_normal((T, B, I)).astype(np.float32)
    w, r, b = weights(3)
    h0 = RNG.standard_normal((1, B, H)).astype(np.float32)
    y, y_h = run_node("GRU", [x, w, r, b, None, h0], outputs=2, hidden_size=H,
                      linear_before_reset=linear_before_reset)
    ry, rh = reference_gru(x, w[0], r[0], b[0], h0[0], linear_before_reset)
    np.testing.assert_allclose(y[:, 0], ry, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(y_h[0], rh, rtol=1e-4, atol=1e-5)


def test_rnn_reverse_with_custom_activation_and_clip():
    x = RNG.standard_normal((T, B, I)).astype(np.float32) * 3
    w, r, b = weights(1)
    y, y_h = run_node("RNN", [x, w, r, b], outputs=2, hidden_size=H, direction="reverse",
                      activations=["LeakyRelu"], activation_alpha=[0.1], clip=2.0)
    h = np.zeros((B, H))
    expected = np.zeros((T, B, H))
    for t in reversed(range(T)):
        pre = np.clip(x[t] @ w[0].T + h @ r[0].T + b[0, :H] + b[0, H:], -2, 2)
        h = np.where(pre >= 0, pre, 0.1 * pre)
        expected[t] = h
    np.testing.assert_allclose(y[:, 0], expected, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(y_h[0], expected[0], rtol=1e-4, atol=1e-5)
