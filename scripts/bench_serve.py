"""Throughput and latency of `runnx serve` at several numbers of concurrent clients.

    python scripts/bench_serve.py [--model DIR] [--clients 1,4,16] [--requests 16] [--max-tokens 32]
                                  [--url http://127.0.0.1:8000]

Starts `runnx serve MODEL` on a free 127.0.0.1 port (or uses --url), warms it up, then at each
concurrency sends the same greedy streaming chat requests (one sentence about a topic each), that
many clients pulling from a shared list. Prints per concurrency: wall time, completion tokens,
total tokens/s (all clients), latency per request (mean, median, max) and time to first token.
Clients at 1 is the sequential baseline: each request served alone, one after another.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

CACHE = Path(os.environ.get("RUNNX_CACHE") or Path.home() / ".cache" / "runnx").expanduser()
TOPICS = ["the ocean", "a cat", "mountains", "coffee", "the moon", "trains", "music", "rain", "bread", "winter",
          "robots", "a forest", "the city", "birds", "history", "chess", "tea", "bicycles", "snow", "libraries",
          "volcanoes", "gardens", "clocks", "bridges", "rivers", "stars", "apples", "ships", "deserts", "owls",
          "paper", "lamps"]


def start_server(model: Path, max_batch: int) -> tuple[subprocess.Popen, str]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    process = subprocess.Popen([sys.executable, "-m", "runnx.cli", "serve", str(model), "--host", "127.0.0.1",
                                "--port", str(port), "--max-batch", str(max_batch)], env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"runnx serve exited with code {process.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return process, url
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    process.kill()
    raise SystemExit("runnx serve did not answer /health within 600 s")


async def one_request(http, model_id: str, topic: str, max_tokens: int) -> dict:
    body = {"model": model_id, "messages": [{"role": "user", "content": f"Write one sentence about {topic}."}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    first = None
    tokens = 0
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif first is None and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                first = time.perf_counter() - started
    latency = time.perf_counter() - started
    return {"latency": latency, "first": first if first is not None else latency, "tokens": tokens}


async def run_level(url: str, model_id: str, clients: int, topics: list[str], max_tokens: int) -> dict:
    pending = list(topics)
    results = []

    async def client(http):
        while pending:
            results.append(await one_request(http, model_id, pending.pop(0), max_tokens))

    async with httpx.AsyncClient(base_url=url, timeout=3600) as http:
        started = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(clients)))
        wall = time.perf_counter() - started
    latencies = [r["latency"] for r in results]
    tokens = sum(r["tokens"] for r in results)
    return {"clients": clients, "requests": len(results), "wall": wall, "tokens": tokens,
            "tokens_per_second": tokens / wall, "latency_mean": statistics.mean(latencies),
            "latency_median": statistics.median(latencies), "latency_max": max(latencies),
            "first_mean": statistics.mean(r["first"] for r in results)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=CACHE / "models" / "smollm2-135m")
    parser.add_argument("--url", help="an already running server (default: start one)")
    parser.add_argument("--clients", default="1,4,16", help="concurrency levels (default 1,4,16)")
    parser.add_argument("--requests", type=int, default=16, help="requests per level (default 16)")
    parser.add_argument("--max-tokens", type=int, default=32, help="max_tokens of each request (default 32)")
    args = parser.parse_args()
    levels = [int(c) for c in args.clients.split(",")]
    topics = [TOPICS[i % len(TOPICS)] for i in range(args.requests)]
    model_id = args.model.name
    process = None
    url = args.url
    if url is None:
        process, url = start_server(args.model, max(levels))
    try:
        asyncio.run(run_level(url, model_id, 1, topics[:1], 4))  # compile and warm up
        print(f"{model_id}: {args.requests} greedy chat requests of max_tokens {args.max_tokens} per level")
        print("| clients | wall s | tokens | tokens/s | latency mean / median / max s | first token mean s |")
        print("|---|---|---|---|---|---|")
        for clients in levels:
            r = asyncio.run(run_level(url, model_id, clients, topics, args.max_tokens))
            print(f"| {clients} | {r['wall']:.1f} | {r['tokens']} | {r['tokens_per_second']:.1f} | "
                  f"{r['latency_mean']:.2f} / {r['latency_median']:.2f} / {r['latency_max']:.2f} | "
                  f"{r['first_mean']:.2f} |", flush=True)
    finally:
        if process is not None:
            process.terminate()
            process.wait(30)


if __name__ == "__main__":
    main()
