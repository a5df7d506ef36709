"""Bounded fuzzing: mutated seed models (structured protobuf edits and byte damage) with random
feeds. Every case must end in a result or a runnx error; `scripts/fuzz.py` runs many more."""
from collections import Counter

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import runnx
from corpus import fixture_models, mutated, random_feeds, run_case, seed_models

CASES = 5000
FIXTURE_CASES = 20  # a fixture model takes ~0.1 s to load: scripts/fuzz.py --fixtures runs many more
PER_EXAMPLE = 5  # cases drawn from one example's random stream: hypothesis' own overhead stays small
SEEDS = seed_models()


def test_mutated_models_and_random_feeds_raise_only_runnx_errors():
    outcomes = Counter()
    names = sorted(SEEDS)

    @settings(max_examples=CASES // PER_EXAMPLE, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.sampled_from(names), st.integers(1, 3), st.integers(0, 2**32 - 1))
    def cases(name, mutations, seed):
        rng = np.random.default_rng(seed)
        for _ in range(PER_EXAMPLE):
            outcomes[run_case(mutated(SEEDS[name], rng, mutations), rng)] += 1

    cases()
    print(f"fuzz: {sum(outcomes.values())} cases: {dict(outcomes.most_common())}")
    assert sum(outcomes.values()) >= CASES, outcomes
    assert outcomes["ok"] >= CASES // 20, outcomes  # the mutations leave enough models runnable


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(st.sampled_from(sorted(SEEDS)), st.integers(0, 2**32 - 1))
def test_unmutated_seeds_run_on_random_valid_feeds(name, seed):
    rng = np.random.default_rng(seed)
    model = runnx.load(SEEDS[name])
    try:
        model.run(random_feeds(model, rng, wrong=0.0))
    except runnx.RunnxError as error:  # with valid feeds only a kernel may refuse (e.g. Loop on a 0-size input)
        assert getattr(error, "node_context", False), error


def test_mutated_fixture_models_raise_only_runnx_errors():
    fixtures = fixture_models()
    assert fixtures, "no fixture model found under tests/fixtures: nothing would be fuzzed"
    outcomes = Counter()
    names = sorted(fixtures)

    @settings(max_examples=FIXTURE_CASES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.sampled_from(names), st.integers(1, 3), st.integers(0, 2**32 - 1))
    def cases(name, mutations, seed):
        rng = np.random.default_rng(seed)
        outcomes[run_case(mutated(fixtures[name], rng, mutations), rng)] += 1

    cases()
    print(f"fixture fuzz: {sum(outcomes.values())} cases: {dict(outcomes.most_common())}")
    assert sum(outcomes.values()) == FIXTURE_CASES
