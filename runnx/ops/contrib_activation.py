"""onnxruntime's contrib activations: FastGelu (the tanh approximation, with an optional bias),
BiasGelu (exact erf GELU of a sum), QuickGelu (x * sigmoid(alpha x)) and com.microsoft's Gelu.

float16/bfloat16 inputs are computed in float32 and rounded once, as onnxruntime's CPU kernels do.
"""
from __future__ import annotations

import math

import numpy as np

from runnx.ops._elementwise_util import erf, sigmoid
from runnx.ops.registry import register

DOMAIN = "com.microsoft"


def _widened(x):
    return x.astype(np.float32) if x.dtype.itemsize < 4 else x


def _with_bias(x, bias):
    """x + bias in the compute dtype (a fresh array either way)."""
    work = _widened(x)
    return work + _widened(bias) if bias is not None else work.copy()


@register("FastGelu", since=1, domain=DOMAIN)
def FastGelu(x, bias=None):
    """0.5 y (1 + tanh(sqrt(2/pi) (y + 0.044715 y^3))) with y = x + bias."""
    y = _with_bias(x, bias)
    work = y * y
    work *= y.dtype.type(0.044715)
    work += y.dtype.type(1)
    work *= y
    work *= y.dtype.type(math.sqrt(2 / math.pi))
    np.tanh(work, out=work)
    work += y.dtype.type(1)
    work *= y
    work *= y.dtype.type(0.5)
    return work.astype(x.dtype, copy=False)


def _erf_gelu(y):
    """0.5 y (1 + erf(y / sqrt(2))) of a fresh float32/64 array."""
    work = erf(y * y.dtype.type(1 / math.sqrt(2)), overwrite=(0,))
    work += y.dtype.type(1)
    work *= y
    work *= y.dtype.type(0.5)
    return work


@register("BiasGelu", since=1, domain=DOMAIN)
def BiasGelu(a, bias):
    return _erf_gelu(_with_bias(a, bias)).astype(a.dtype, copy=False)


@register("Gelu", since=1, domain=DOMAIN)
def Gelu(x):
    return _erf_gelu(_with_bias(x, None)).astype(x.dtype, copy=False)


@register("QuickGelu", since=1, domain=DOMAIN)
def QuickGelu(x, *, alpha: float = 1.702):
    y = _widened(x)
    gate = sigmoid(y * y.dtype.type(alpha), overwrite=(0,))
    gate *= y
    return gate.astype(x.dtype, copy=False)
