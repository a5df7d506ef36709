"""Random generators: RandomNormal/Uniform(+Like), Bernoulli, Multinomial.

With a `seed` attribute a node is deterministic: each run draws the same values (a generator
seeded from the seed's float64 bits, so 1.0 and 1.5 differ). Without one, every run draws fresh
values from the operating system's entropy. Samples are drawn in float64 and rounded once into
the requested type.
"""
from __future__ import annotations

import numpy as np

from runnx.errors import RunnxError
from runnx.interp.dtypes import numpy_dtype
from runnx.ops.registry import register


def _generator(seed: float | None) -> np.random.Generator:
    if seed is None:
        return np.random.default_rng()
    return np.random.default_rng(int(np.float64(seed).view(np.uint64)))


def _float_dtype(dtype: int | None, like) -> np.dtype:
    result = like.dtype if dtype is None else numpy_dtype(dtype)
    if result.kind not in "fV":  # V: ml_dtypes floats such as bfloat16
        raise RunnxError(f"random values need a floating-point type, got {result}")
    return result


def _normal(shape, dtype, mean, scale, seed, ctx):
    ctx.check_elements(shape, "random output")
    return _generator(seed).normal(mean, scale, size=tuple(shape)).astype(dtype)


def _uniform(shape, dtype, low, high, seed, ctx):
    ctx.check_elements(shape, "random output")
    return _generator(seed).uniform(low, high, size=tuple(shape)).astype(dtype)


@register("RandomNormal", since=1)
def RandomNormal(*, dtype: int = 1, mean: float = 0.0, scale: float = 1.0, seed: float | None = None,
                 shape: tuple[int, ...], ctx):
    return _normal(shape, numpy_dtype(dtype), mean, scale, seed, ctx)


@register("RandomUniform", since=1)
def RandomUniform(*, dtype: int = 1, high: float = 1.0, low: float = 0.0, seed: float | None = None,
                  shape: tuple[int, ...], ctx):
    return _uniform(shape, numpy_dtype(dtype), low, high, seed, ctx)


@register("RandomNormalLike", since=1)
def RandomNormalLike(x, *, dtype: int | None = None, mean: float = 0.0, scale: float = 1.0,
                     seed: float | None = None, ctx):
    return _normal(x.shape, _float_dtype(dtype, x), mean, scale, seed, ctx)


@register("RandomUniformLike", since=1)
def RandomUniformLike(x, *, dtype: int | None = None, high: float = 1.0, low: float = 0.0,
                      seed: float | None = None, ctx):
    return _uniform(x.shape, _float_dtype(dtype, x), low, high, seed, ctx)


@register("Bernoulli", since=15)
def Bernoulli(probabilities, *, dtype: int | None = None, seed: float | None = None):
    """1 with the probability each input element gives, else 0."""
    draws = _generator(seed).random(probabilities.shape)
    out_dtype = probabilities.dtype if dtype is None else numpy_dtype(dtype)
    return (draws < probabilities.astype(np.float64)).astype(out_dtype)


@register("Multinomial", since=7)
def Multinomial(logits, *, dtype: int = 6, sample_size: int = 1, seed: float | None = None, ctx):
    """`sample_size` class indices per row of unnormalised log-probabilities [batch, classes]."""
    if logits.ndim != 2 or logits.shape[1] < 1:
        raise RunnxError(f"Multinomial takes [batch, classes] log-probabilities, got shape {logits.shape}")
    out_dtype = numpy_dtype(dtype)
    if out_dtype not in (np.dtype(np.int32), np.dtype(np.int64)):
        raise RunnxError(f"Multinomial output must be int32 or int64, got {out_dtype}")
    ctx.check_elements((logits.shape[0], sample_size), "Multinomial output")
    wide = logits.astype(np.float64)
    weights = np.exp(wide - wide.max(axis=1, keepdims=True))
    cumulative = np.cumsum(weights, axis=1)
    cumulative /= cumulative[:, -1:]
    draws = _generator(seed).random((logits.shape[0], sample_size))
    # the first class whose cumulative probability exceeds the draw
    choice = (draws[:, :, None] >= cumulative[:, None, :]).sum(axis=2)
    return np.minimum(choice, logits.shape[1] - 1).astype(out_dtype)
