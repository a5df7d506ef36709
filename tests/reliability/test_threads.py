"""One InferenceSession shared by several threads: every run gets exactly the result it gets alone
(per-run state is never shared), including runs through If/Loop subgraphs and a real decoder."""
import threading

import numpy as np
import pytest

import runnx
from corpus import fixture_models, random_feeds, seed_models
from runnx.cli import generated_input

THREADS, ROUNDS = 4, 6


def _decoder_feeds(session, seed):
    rng = np.random.default_rng(seed)
    dims = {"batch_size": 1, "sequence_length": int(rng.integers(1, 4)), "past_sequence_length": int(rng.integers(0, 3))}
    feeds = {}
    for info in session.model.inputs:
        value = generated_input(info, dims, rng)[0]
        if info.name == "input_ids":
            value = rng.integers(0, 50, value.shape).astype(value.dtype)
        feeds[info.name] = value
    return feeds


def _seed_feeds(session, seed):
    feeds = random_feeds(session.model, np.random.default_rng(seed), wrong=0.0)
    return {n: v.array if isinstance(v, runnx.Owned) else v for n, v in feeds.items()}


def _sources():
    if "control_flow" in seed_models():
        yield pytest.param(seed_models()["control_flow"], _seed_feeds, id="control_flow")
    fixtures = fixture_models()
    if "tiny-llama/model.onnx" in fixtures:
        yield pytest.param(fixtures["tiny-llama/model.onnx"], _decoder_feeds, id="tiny-llama")


@pytest.mark.parametrize("source, make_feeds", list(_sources()))
def test_one_session_serves_several_threads_at_once(source, make_feeds):
    session = runnx.InferenceSession(source.SerializeToString())
    jobs = [make_feeds(session, seed) for seed in range(THREADS * ROUNDS)]
    owned = [{n: runnx.Owned(v.copy()) if isinstance(v, np.ndarray) and index % 2 else v for n, v in job.items()}
             for index, job in enumerate(jobs)]
    expected = [session.run(None, dict(job)) for job in jobs]
    results, barrier = {}, threading.Barrier(THREADS)

    def worker(thread):
        barrier.wait()
        for index in range(thread, len(jobs), THREADS):
            results[index] = session.run(None, owned[index])

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == len(jobs)
    for index, want in enumerate(expected):
        assert [g.tobytes() for g in results[index]] == [w.tobytes() for w in want], index
