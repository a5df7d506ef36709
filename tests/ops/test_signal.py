"""Signal kernels against numpy's FFT and the window formulas."""
from __future__ import annotations

import numpy as np
import pytest

from tests.ops._single_node import run_node

RNG = np.random.default_rng(6)


def test_dft_real_input_full_and_onesided():
    x = RNG.standard_normal((2, 8, 1)).astype(np.float32)
    got = run_node("DFT", [x], opset=17)  # axis attribute defaults to 1
    expected = np.fft.fft(x[..., 0], axis=1)
    np.testing.assert_allclose(got[..., 0] + 1j * got[..., 1], expected, rtol=1e-4, atol=1e-5)
    half = run_node("DFT", [x, None, np.array(-2)], onesided=1, opset=20)
    np.testing.assert_allclose(half[..., 0] + 1j * half[..., 1], expected[:, :5], rtol=1e-4, atol=1e-5)


def test_dft_padded_length_and_inverse_round_trip():
    z = RNG.standard_normal((3, 5, 2)).astype(np.float32)
    spectrum = run_node("DFT", [z, np.array(8)], axis=1, opset=17)
    expected = np.fft.fft(z[..., 0] + 1j * z[..., 1], n=8, axis=1)
    np.testing.assert_allclose(spectrum[..., 0] + 1j * spectrum[..., 1], expected, rtol=1e-4, atol=1e-5)
    back = run_node("DFT", [spectrum], axis=1, inverse=1, opset=17)
    np.testing.assert_allclose(back[:, :5], z, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(back[:, 5:], 0, atol=1e-5)


def test_stft_matches_framed_fft():
    signal = RNG.standard_normal((2, 20, 1)).astype(np.float32)
    window = np.hanning(8).astype(np.float32)
    got = run_node("STFT", [signal, np.array(4), window], opset=17)
    frames = np.stack([signal[:, s:s + 8, 0] * window for s in range(0, 13, 4)], axis=1)
    expected = np.fft.rfft(frames, axis=-1)
    assert got.shape == (2, 4, 5, 2)
    np.testing.assert_allclose(got[..., 0] + 1j * got[..., 1], expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("periodic", [0, 1])
def test_windows(periodic):
    n = 10
    length = n + 1 if periodic else n  # a periodic window is the symmetric one of n + 1, cut short
    np.testing.assert_allclose(run_node("HannWindow", [np.array(n)], periodic=periodic, opset=17),
                               np.hanning(length)[:n], atol=1e-6)
    np.testing.assert_allclose(run_node("BlackmanWindow", [np.array(n)], periodic=periodic, opset=17),
                               np.blackman(length)[:n], atol=1e-6)
    k = np.arange(n)
    hamming = 25 / 46 - 21 / 46 * np.cos(2 * np.pi * k / (length - 1))
    np.testing.assert_allclose(run_node("HammingWindow", [np.array(n)], periodic=periodic, opset=17), hamming,
                               atol=1e-6)


def test_mel_weight_matrix_is_a_bank_of_triangles():
    got = run_node("MelWeightMatrix", [np.array(6), np.array(64), np.array(16000), np.array(0.0, np.float32),
                                       np.array(8000.0, np.float32)], opset=17)
    assert got.shape == (33, 6) and got.dtype == np.float32
    assert (got >= 0).all() and (got <= 1).all()
    peaks = got.argmax(axis=0)
    assert (np.diff(peaks) > 0).all()  # centres rise with the mel bin
    for column in got.T:  # each filter rises to 1, then falls
        nonzero = np.flatnonzero(column)
        top = column.argmax()
        assert column[top] == 1
        assert (np.diff(column[nonzero[0]:top + 1]) >= 0).all() and (np.diff(column[top:nonzero[-1] + 1]) <= 0).all()
