"""scripts/bench_serve.py's arithmetic: onnxruntime-genai serves one request at a time, so its latency
at N clients is computed from each request's measured time by queueing them; a mistake there would
misstate the comparison with `runnx serve`."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


@pytest.fixture(scope="module")
def bench_serve():
    sys.path.insert(0, str(SCRIPTS))  # it imports bench.py and report.py from its folder
    try:
        import bench_serve
        yield bench_serve
    finally:
        sys.path.remove(str(SCRIPTS))
        for name in ("bench_serve", "bench", "report"):
            sys.modules.pop(name, None)


def test_percentile_interpolates_between_ranks(bench_serve):
    values = [4.0, 1.0, 3.0, 2.0]
    assert bench_serve.percentile(values, 0.5) == 2.5
    assert bench_serve.percentile(values, 0.95) == pytest.approx(3.85)
    assert bench_serve.percentile([7.0], 0.95) == 7.0


def test_genai_levels_queue_requests_behind_one_another(bench_serve):
    requests = [{"latency": 1.0, "first": 0.25, "tokens": 10},
                {"latency": 2.0, "first": 0.5, "tokens": 20},
                {"latency": 3.0, "first": 0.75, "tokens": 30}]
    alone, two = bench_serve.genai_levels(requests, [1, 2])
    # one client: each request is sent when the previous one is answered and waits for nothing
    assert alone["tokens_per_second"] == pytest.approx(60 / 6)
    assert alone["latency_p50"] == pytest.approx(2.0)
    assert alone["first_p50"] == pytest.approx(0.5)
    # two clients: requests 0 and 1 sent at 0, request 2 when request 0 is answered (at 1 s);
    # they finish at 1, 3 and 6 s, and begin at 0, 1 and 3 s
    assert two["tokens_per_second"] == pytest.approx(60 / 6)
    assert two["latency_p50"] == pytest.approx(3.0)  # of 1, 3 and 5 s
    assert two["latency_p95"] == pytest.approx(3.0 + 0.9 * 2.0)
    assert two["first_p50"] == pytest.approx(1.5)  # of 0.25, 1.5 and 2.75 s
    assert bench_serve.genai_levels(requests, [4], cpu=4.0)[0]["tokens_per_cpu_second"] == pytest.approx(15.0)
