"""Signal processing: DFT (opset 17 attribute axis, opset 20 input axis), STFT, the Hann/Hamming/Blackman
windows and MelWeightMatrix.

ONNX spells complex tensors as real ones with a trailing axis of 1 (real) or 2 (real, imaginary);
transforms go through numpy's FFT and come back in that layout.
"""
from __future__ import annotations

import numpy as np

from runnx.errors import RunnxError
from runnx.interp.dtypes import numpy_dtype
from runnx.ops.registry import register


def _as_complex(x: np.ndarray) -> np.ndarray:
    if x.shape[-1] == 1:
        return x[..., 0]
    if x.shape[-1] == 2:
        return x[..., 0] + 1j * x[..., 1]
    raise RunnxError(f"the last axis of a signal must be 1 (real) or 2 (complex), got shape {x.shape}")


def _as_pairs(values: np.ndarray, dtype) -> np.ndarray:
    return np.stack([values.real, values.imag], axis=-1).astype(dtype)


def _dft(x, dft_length, axis: int, inverse: int, onesided: int, ctx):
    axis = axis % x.ndim
    if axis == x.ndim - 1:
        raise RunnxError("DFT axis cannot be the trailing real/imaginary axis")
    if dft_length is not None:
        length = int(dft_length)
    else:
        length = 2 * (x.shape[axis] - 1) if inverse and onesided else x.shape[axis]
    if length < 1:
        raise RunnxError(f"DFT length must be positive, got {length}")
    ctx.check_elements(x.shape[:axis] + (length,) + x.shape[axis + 1:], "DFT output")
    signal = _as_complex(x)
    if inverse:
        if onesided:  # one-sided spectrum back to a real signal
            return np.fft.irfft(signal, n=length, axis=axis)[..., None].astype(x.dtype)
        return _as_pairs(np.fft.ifft(signal, n=length, axis=axis), x.dtype)
    spectrum = np.fft.fft(signal, n=length, axis=axis)
    if onesided:
        spectrum = np.take(spectrum, np.arange(length // 2 + 1), axis=axis)
    return _as_pairs(spectrum, x.dtype)


@register("DFT", since=17)
def DFT_17(x, dft_length=None, *, axis: int = 1, inverse: int = 0, onesided: int = 0, ctx):
    return _dft(x, dft_length, axis, inverse, onesided, ctx)


@register("DFT", since=20)
def DFT(x, dft_length=None, axis=None, *, inverse: int = 0, onesided: int = 0, ctx):
    return _dft(x, dft_length, -2 if axis is None else int(axis), inverse, onesided, ctx)


@register("STFT", since=17)
def STFT(signal, frame_step, window=None, frame_length=None, *, onesided: int = 1, ctx):
    step = int(frame_step)
    if step < 1:
        raise RunnxError(f"STFT frame_step must be positive, got {step}")
    if frame_length is not None:
        length = int(frame_length)
    else:
        length = window.shape[0] if window is not None else signal.shape[1]
    frames = 1 + (signal.shape[1] - length) // step
    if frames < 1:
        raise RunnxError(f"signal of length {signal.shape[1]} is shorter than one frame of {length}")
    ctx.check_elements((signal.shape[0], frames, length, 2), "STFT frames")
    samples = _as_complex(signal)  # (batch, length)
    starts = np.arange(frames)[:, None] * step + np.arange(length)[None, :]
    framed = samples[:, starts]  # (batch, frames, length)
    if window is not None:
        framed = framed * window
    spectrum = np.fft.fft(framed, n=length, axis=-1)
    if onesided:
        spectrum = spectrum[..., :length // 2 + 1]
    return _as_pairs(spectrum, signal.dtype)


def _window(size, periodic: int, output_datatype: int, terms: tuple[float, ...], ctx):
    """sum_k terms[k] * cos(2 pi k n / N), the generalised cosine window (N = size if periodic else size - 1)."""
    count = int(size)
    if count < 0:
        raise RunnxError(f"window size must not be negative, got {count}")
    ctx.check_elements([count], "window")
    denominator = count if periodic else count - 1
    n = np.arange(count, dtype=np.float64)
    values = np.zeros(count)
    for k, term in enumerate(terms):
        values += term * np.cos(2 * np.pi * k * n / denominator) if denominator else term * (k == 0)
    return values.astype(numpy_dtype(output_datatype))


@register("HannWindow", since=17)
def HannWindow(size, *, output_datatype: int = 1, periodic: int = 1, ctx):
    return _window(size, periodic, output_datatype, (0.5, -0.5), ctx)


@register("HammingWindow", since=17)
def HammingWindow(size, *, output_datatype: int = 1, periodic: int = 1, ctx):
    alpha = 25.0 / 46.0
    return _window(size, periodic, output_datatype, (alpha, alpha - 1.0), ctx)


@register("BlackmanWindow", since=17)
def BlackmanWindow(size, *, output_datatype: int = 1, periodic: int = 1, ctx):
    return _window(size, periodic, output_datatype, (0.42, -0.5, 0.08), ctx)


@register("MelWeightMatrix", since=17)
def MelWeightMatrix(num_mel_bins, dft_length, sample_rate, lower_edge_hertz, upper_edge_hertz, *,
                    output_datatype: int = 1, ctx):
    bins, length, rate = int(num_mel_bins), int(dft_length), int(sample_rate)
    if bins < 1 or length < 1 or rate < 1:
        raise RunnxError(f"MelWeightMatrix needs positive sizes, got {bins} bins, length {length}, rate {rate}")
    ctx.check_elements((length // 2 + 1, bins), "MelWeightMatrix output")
    low_mel = 2595 * np.log1p(float(lower_edge_hertz) / 700) / np.log(10)
    high_mel = 2595 * np.log1p(float(upper_edge_hertz) / 700) / np.log(10)
    # bins + 2 triangle corners spaced evenly in mel, as the ONNX reference and its test data do
    mels = np.arange(bins + 2) * ((high_mel - low_mel) / (bins + 2)) + low_mel
    hertz = 700 * np.expm1(mels / 2595 * np.log(10))
    corners = (((length + 1) * hertz) // rate).astype(np.int64)
    out = np.zeros((length // 2 + 1, bins))
    for i in range(bins):  # one triangle per mel bin
        left, center, right = corners[i], corners[i + 1], corners[i + 2]
        if center == left:
            out[center, i] = 1
        else:
            j = np.arange(left, center + 1)
            out[j, i] = (j - left) / (center - left)
        if right > center:
            j = np.arange(center, right)
            out[j, i] = (right - j) / (right - center)
    return out.astype(numpy_dtype(output_datatype))
