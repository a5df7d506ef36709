"""Logits processors against hand-computed expectations, and the samplers."""
from __future__ import annotations

import numpy as np

from runnx.generate.sampling import (
    MinP, Multinomial, RepetitionPenalty, Temperature, TopK, TopP, apply_processors, argmax, build_processors,
    softmax,
)

IDS = np.array([[3, 1, 3]], np.int64)


def test_repetition_penalty_divides_positive_and_multiplies_negative_scores():
    scores = np.array([[1.0, 2.0, 0.5, -1.0, 4.0]], np.float32)
    out = RepetitionPenalty(2.0)(np.array([[1, 3, 3]]), scores)
    np.testing.assert_allclose(out, [[1.0, 1.0, 0.5, -2.0, 4.0]])
    assert scores[0, 1] == 2.0  # the input is not modified


def test_temperature_scales():
    np.testing.assert_allclose(Temperature(0.5)(IDS, np.array([[1.0, -2.0]], np.float32)), [[2.0, -4.0]])


def test_top_k_keeps_ties_with_the_kth():
    scores = np.array([[1.0, 3.0, 2.0, 2.0, 0.0]], np.float32)
    out = TopK(2)(IDS, scores)
    assert np.isneginf(out).tolist() == [[True, False, False, False, True]]


def test_top_p_keeps_the_smallest_nucleus():
    probs = np.array([[0.5, 0.3, 0.15, 0.05]])
    scores = np.log(probs).astype(np.float32)
    assert np.isneginf(TopP(0.7)(IDS, scores)).tolist() == [[False, False, True, True]]
    assert np.isneginf(TopP(0.85)(IDS, scores)).tolist() == [[False, False, False, True]]  # 0.5 + 0.3 < 0.85
    assert np.isneginf(TopP(0.01)(IDS, scores)).tolist() == [[False, True, True, True]]


def test_min_p_is_relative_to_the_best_token():
    scores = np.log(np.array([[0.6, 0.25, 0.1, 0.05]])).astype(np.float32)
    assert np.isneginf(MinP(0.2)(IDS, scores)).tolist() == [[False, False, True, True]]


def test_chain_order_and_user_processors():
    chain = build_processors(temperature=0.5, top_k=2, top_p=1.0, min_p=0.0, repetition_penalty=1.3)
    assert [type(p) for p in chain] == [RepetitionPenalty, Temperature, TopK]
    assert build_processors(temperature=1.0) == []

    def ban_token_0(token_ids, scores):
        scores = scores.copy()
        scores[:, 0] = -np.inf
        return scores

    scores = np.array([[5.0, 1.0, 3.0, 2.0]], np.float32)
    out = apply_processors(chain + [ban_token_0], IDS, scores)
    assert argmax(out).tolist() == [2]
    assert np.isneginf(out).tolist() == [[True, True, False, True]]


def test_multinomial_is_reproducible_and_follows_the_distribution():
    scores = np.log(np.array([[0.7, 0.2, 0.1, 0.0], [0.0, 0.0, 0.0, 1.0]]) + 1e-30).astype(np.float32)
    draws = np.stack([Multinomial(seed=7)(scores) for _ in range(3)])
    assert (draws == draws[0]).all()
    sampler = Multinomial(seed=0)
    many = np.stack([sampler(scores) for _ in range(4000)])
    assert (many[:, 1] == 3).all()
    frequencies = np.bincount(many[:, 0], minlength=4) / len(many)
    np.testing.assert_allclose(frequencies, [0.7, 0.2, 0.1, 0.0], atol=0.03)
    assert not np.isneginf(softmax(scores)).any()


def test_masked_tokens_are_never_drawn():
    scores = np.array([[0.0, 0.0, -np.inf, 0.0]], np.float32)
    sampler = Multinomial(seed=1)
    assert 2 not in {int(sampler(scores)[0]) for _ in range(500)}
