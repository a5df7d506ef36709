"""Assertions shared by the tiny-fixture and the real-model generation tests."""
from __future__ import annotations


def assert_batch_matches_per_row(generator, prompts, max_new_tokens: int) -> None:
    """A left-padded batch gives each row exactly the text and ids it gets on its own."""
    settings = dict(max_new_tokens=max_new_tokens, stop_token_ids=())
    singles, single_ids = [], []
    for prompt in prompts:
        singles.append(generator.generate(prompt, **settings))
        single_ids.append(list(generator.generated[0]))
    assert generator.generate_batch(prompts, **settings) == singles
    assert generator.generated == single_ids
