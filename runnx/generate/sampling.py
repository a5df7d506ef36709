"""Choosing the next token: a chain of logits processors, then a sampler.

A logits processor is any callable `(token_ids, scores) -> scores` (transformers' contract):
`token_ids` [batch, tokens so far] int64, `scores` [batch, vocab] float. The built-in ones follow
transformers' definitions and order (repetition penalty, temperature, top-k, top-p, min-p); append
your own function to the chain to extend it. Removed tokens get -inf.

A sampler turns the final scores into token ids [batch]: `argmax` (greedy) or a seeded
`Multinomial` (numpy Generator: the same seed gives the same tokens).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def softmax(scores: np.ndarray) -> np.ndarray:
    shifted = scores - scores.max(axis=-1, keepdims=True)
    exp = np.exp(shifted)
    return exp / exp.sum(axis=-1, keepdims=True)


@dataclass(frozen=True)
class RepetitionPenalty:
    """Makes tokens already present less likely: score/penalty if positive, score*penalty if not
    (CTRL paper; transformers' RepetitionPenaltyLogitsProcessor)."""

    penalty: float

    def __call__(self, token_ids: np.ndarray, scores: np.ndarray) -> np.ndarray:
        scores = scores.copy()
        for row in range(scores.shape[0]):
            seen = np.unique(token_ids[row])
            values = scores[row, seen]
            scores[row, seen] = np.where(values < 0, values * self.penalty, values / self.penalty)
        return scores


@dataclass(frozen=True)
class Temperature:
    temperature: float

    def __call__(self, token_ids: np.ndarray, scores: np.ndarray) -> np.ndarray:
        return scores / np.float32(self.temperature)


@dataclass(frozen=True)
class TopK:
    """Keeps the k highest scores (and every token tied with the k-th)."""

    k: int

    def __call__(self, token_ids: np.ndarray, scores: np.ndarray) -> np.ndarray:
        k = min(self.k, scores.shape[-1])
        kth = np.partition(scores, -k, axis=-1)[:, -k][:, None]
        return np.where(scores < kth, -np.inf, scores)


@dataclass(frozen=True)
class TopP:
    """Nucleus sampling: keeps the most likely tokens whose probabilities add up to at least p."""

    p: float

    def __call__(self, token_ids: np.ndarray, scores: np.ndarray) -> np.ndarray:
        order = np.argsort(scores, axis=-1, kind="stable")  # ascending, as transformers does
        ascending = np.take_along_axis(scores, order, axis=-1)
        cumulative = np.cumsum(softmax(ascending), axis=-1)
        remove_sorted = cumulative <= 1 - self.p
        remove_sorted[:, -1] = False  # always keep the most likely token
        remove = np.empty_like(remove_sorted)
        np.put_along_axis(remove, order, remove_sorted, axis=-1)
        return np.where(remove, -np.inf, scores)


@dataclass(frozen=True)
class MinP:
    """Keeps tokens whose probability is at least min_p times the most likely token's."""

    min_p: float

    def __call__(self, token_ids: np.ndarray, scores: np.ndarray) -> np.ndarray:
        probs = softmax(scores)
        threshold = self.min_p * probs.max(axis=-1, keepdims=True)
        return np.where(probs < threshold, -np.inf, scores)


def build_processors(*, temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
                     min_p: float | None = None, repetition_penalty: float | None = None) -> list:
    """The built-in chain for these settings, in transformers' order; no-op settings are left out."""
    chain = []
    if repetition_penalty is not None and repetition_penalty != 1.0:
        chain.append(RepetitionPenalty(repetition_penalty))
    if temperature is not None and temperature != 1.0:
        chain.append(Temperature(temperature))
    if top_k is not None and top_k > 0:
        chain.append(TopK(top_k))
    if top_p is not None and top_p < 1.0:
        chain.append(TopP(top_p))
    if min_p is not None and min_p > 0.0:
        chain.append(MinP(min_p))
    return chain


def apply_processors(processors, token_ids: np.ndarray, scores: np.ndarray) -> np.ndarray:
    for processor in processors:
        scores = processor(token_ids, scores)
    return scores


def argmax(scores: np.ndarray) -> np.ndarray:
    """Greedy choice per row (the first index among equal maxima, as numpy and torch do)."""
    return scores.argmax(axis=-1).astype(np.int64)


class Multinomial:
    """Draws one token per row from softmax(scores) with a numpy Generator seeded once."""

    def __init__(self, seed: int | None = None):
        self.rng = np.random.default_rng(seed)

    def __call__(self, scores: np.ndarray) -> np.ndarray:
        probs = softmax(scores.astype(np.float64))
        cumulative = np.cumsum(probs, axis=-1)
        draws = self.rng.random(scores.shape[0]) * cumulative[:, -1]
        chosen = [np.searchsorted(cumulative[row], draws[row], side="right") for row in range(scores.shape[0])]
        return np.minimum(np.array(chosen, np.int64), scores.shape[-1] - 1)
