"""Throughput and latency of `runnx serve` at several numbers of concurrent clients, beside
onnxruntime-genai serving the same requests one after another.

    python scripts/bench_serve.py [--model DIR] [--clients 1,4,16] [--requests 16] [--max-tokens 32]
                                  [--threads N] [--runs 2] [--url http://127.0.0.1:8000] [--no-write]

Starts `runnx serve MODEL` on a free 127.0.0.1 port (or uses --url), warms it up, then at each
concurrency sends the same greedy streaming chat requests (one sentence about a topic each), that
many clients pulling from a shared list: total tokens/s (all clients), tokens per CPU second of
the serving process (all its threads: on a machine shared with other work it is much less
disturbed by the neighbours than wall time), latency per request (p50, p95), time to first token.

The peer is onnxruntime-genai's own generation loop on its own fp32 export (bench.py's GENAI_MODEL,
in its venv GENAI_PYTHON, as a worker process of this script): the same prompt token ids (the chat
template rendered as the server renders it), max_tokens and greedy search, the same thread count,
each request served alone, one after another (its tokens/s is the same for any number of clients);
its latency at N clients is that of N clients queueing for it: each request waits for those ahead
of it, from the measured time of each. Both engines serve every request once, untimed, before
they are measured (runnx at each concurrency: it compiles kernels and memoizes shapes on first
use). onnxruntime-genai's token ids are checked against runnx's (the Generator,
greedy, as the server is tested to give) and its text against the served text.
Each run measures both, their order alternating run by run; all runs go into docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from bench import CACHE, GENAI_MODEL, GENAI_PYTHON, GenAI  # scripts/: this script's folder
from report import THREAD_VARIABLES, git_revision, machine, update_section

ROOT = Path(__file__).resolve().parent.parent
TOPICS = ["the ocean", "a cat", "mountains", "coffee", "the moon", "trains", "music", "rain", "bread", "winter",
          "robots", "a forest", "the city", "birds", "history", "chess", "tea", "bicycles", "snow", "libraries",
          "volcanoes", "gardens", "clocks", "bridges", "rivers", "stars", "apples", "ships", "deserts", "owls",
          "paper", "lamps"]


def messages(topic: str) -> list[dict]:
    return [{"role": "user", "content": f"Write one sentence about {topic}."}]


def thread_environment(threads: int) -> dict:
    return {**os.environ, "RUNNX_THREADS": str(threads), **{v: str(threads) for v in THREAD_VARIABLES}}


def percentile(values: list[float], fraction: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default)."""
    ordered = sorted(values)
    position = fraction * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summary(clients: int, wall: float, results: list[dict], cpu: float | None) -> dict:
    latencies = [r["latency"] for r in results]
    tokens = sum(r["tokens"] for r in results)
    return {"clients": clients, "requests": len(results), "wall": wall, "tokens": tokens,
            "tokens_per_second": tokens / wall, "tokens_per_cpu_second": tokens / cpu if cpu else None,
            "latency_p50": percentile(latencies, 0.5),
            "latency_p95": percentile(latencies, 0.95),
            "first_p50": percentile([r["first"] for r in results], 0.5)}


# -- runnx serve, over HTTP ------------------------------------------------------------------------
def start_server(model: Path, max_batch: int, threads: int) -> tuple[subprocess.Popen, str]:
    import httpx

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**thread_environment(threads), "RUNNX_COMPILE": "wait",  # compiled by the warm-up, not in the background
           "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
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
    body = {"model": model_id, "messages": messages(topic), "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    first = None
    tokens = 0
    text = []
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                text.append(chunk["choices"][0]["delta"]["content"])
                if first is None:
                    first = time.perf_counter() - started
    latency = time.perf_counter() - started
    return {"topic": topic, "latency": latency, "first": first if first is not None else latency, "tokens": tokens,
            "text": "".join(text)}


def cpu_seconds(pid: int | None) -> float | None:
    """A process's CPU time so far, all its threads (Linux); None without a pid (a server given by --url)."""
    if pid is None:
        return None
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


async def run_level(url: str, model_id: str, clients: int, topics: list[str], max_tokens: int,
                    pid: int | None = None) -> tuple[dict, dict]:
    """(summary, {topic: served text}) of the requests sent by `clients` concurrent clients; the
    server's CPU time is that of process `pid`."""
    import httpx

    pending = list(topics)
    results = []

    async def client(http):
        while pending:
            results.append(await one_request(http, model_id, pending.pop(0), max_tokens))

    async with httpx.AsyncClient(base_url=url, timeout=3600) as http:
        started = time.perf_counter()
        cpu = cpu_seconds(pid)
        await asyncio.gather(*(client(http) for _ in range(clients)))
        wall = time.perf_counter() - started
        cpu = cpu_seconds(pid) - cpu if pid else None
    return summary(clients, wall, results, cpu), {r["topic"]: r["text"] for r in results}


# -- onnxruntime-genai, one request after another (runs in the genai venv) --------------------------
def worker_genai(prompts: list[list[int]], max_tokens: int, threads: int) -> dict:
    """Each prompt served alone by onnxruntime-genai's loop, streaming its text as a server would."""
    engine = GenAI(GENAI_MODEL, threads)
    og, model = engine.og, engine.model
    tokenizer = og.Tokenizer(model)

    def serve(prompt: list[int], new_tokens: int) -> dict:
        started = time.perf_counter()
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=len(prompt) + new_tokens, do_sample=False)
        generator = og.Generator(model, params)
        stream = tokenizer.create_stream()
        generator.append_tokens(np.array(prompt, np.int32))
        first, text, steps = None, [], 0
        while not generator.is_done():
            generator.generate_next_token()
            steps += 1
            text.append(stream.decode(int(generator.get_next_tokens()[0])))
            if first is None:
                first = time.perf_counter() - started
        ids = [int(t) for t in generator.get_sequence(0)[len(prompt):]]  # without the stop token it chose
        return {"latency": time.perf_counter() - started, "first": first, "tokens": steps, "ids": ids,
                "text": "".join(text)}

    for prompt in prompts:  # untimed, as the server gets
        serve(prompt, max_tokens)
    started = time.process_time()
    requests = [serve(prompt, max_tokens) for prompt in prompts]
    return {"requests": requests, "cpu_seconds": time.process_time() - started}


def genai_levels(requests: list[dict], levels: list[int], cpu: float | None = None) -> list[dict]:
    """Clients queueing for a server that takes one request at a time, in order: with N clients, a
    request is sent when the request N places before it is answered and starts when the one just
    before it is done (the server is never idle)."""
    done, elapsed = [], 0.0
    for request in requests:
        elapsed += request["latency"]
        done.append(elapsed)
    rows = []
    for clients in levels:
        queued = []
        for k, request in enumerate(requests):
            sent = done[k - clients] if k >= clients else 0.0
            begins = done[k - 1] if k else 0.0
            queued.append({"latency": done[k] - sent, "first": begins - sent + request["first"],
                           "tokens": request["tokens"]})
        rows.append(summary(clients, elapsed, queued, cpu))
    return rows


def run_genai(prompts: list[list[int]], max_tokens: int, threads: int) -> dict:
    completed = subprocess.run([str(GENAI_PYTHON), __file__, "--worker-genai"], capture_output=True, text=True,
                               env=thread_environment(threads), timeout=3600,
                               input=json.dumps({"prompts": prompts, "max_tokens": max_tokens, "threads": threads}))
    if completed.returncode:
        raise SystemExit(f"the onnxruntime-genai worker failed:\n{completed.stderr[-3000:]}")
    return json.loads(completed.stdout.strip().splitlines()[-1])


# -- runnx's own token ids, for the check -----------------------------------------------------------
def chat_prompts(model: Path, topics: list[str]) -> list[list[int]]:
    """The prompts' token ids as `runnx serve` renders them (runnx/serve/models.py, chat_prompt)."""
    from runnx.generate.chat import compile_template
    from runnx.generate.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_folder(model)
    template = compile_template(tokenizer.chat_template)
    return [tokenizer.encode(template.render(messages=messages(topic), add_generation_prompt=True,
                                             **tokenizer.special_tokens), add_special_tokens=False)
            for topic in topics]


def runnx_ids(model: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from runnx.generate import Generator

    generator = Generator.from_folder(model)
    ids = []
    for prompt in prompts:
        generator.start(max_new_tokens=max_tokens, do_sample=False)
        generator.append_tokens(prompt)
        while not generator.is_done():
            generator.generate_next_token()
        ids.append([t for t in generator.generated[0] if t not in generator.stop_token_ids])
    return ids


def decode(model: Path, ids: list[int]) -> str:
    from runnx.generate.tokenizer import Tokenizer

    return Tokenizer.from_folder(model).decode(ids)


# -- report ------------------------------------------------------------------------------------------
def run_table(served: list[dict], genai: list[dict] | None) -> str:
    """Rows per concurrency and engine, then runnx's ratios to onnxruntime-genai."""
    lines = ["| clients | engine | tokens/s | tokens per CPU s | latency p50 / p95 s | first token p50 s |",
             "|---|---|---|---|---|---|"]

    def row(clients, engine, r):
        per_cpu = f"{r['tokens_per_cpu_second']:.1f}" if r["tokens_per_cpu_second"] else "-"
        lines.append(f"| {clients} | {engine} | {r['tokens_per_second']:.1f} | {per_cpu} | {r['latency_p50']:.2f} / "
                     f"{r['latency_p95']:.2f} | {r['first_p50']:.2f} |")
    for index, mine in enumerate(served):
        row(mine["clients"], "runnx serve", mine)
        if genai:
            row(mine["clients"], "onnxruntime-genai, one at a time", genai[index])
    if genai:
        speed = ", ".join(f"{m['clients']}: {m['tokens_per_second'] / g['tokens_per_second']:.2f}x"
                          for m, g in zip(served, genai))
        lines.append(f"\nrunnx serve / onnxruntime-genai by clients: tokens/s {speed}")
        if all(m["tokens_per_cpu_second"] for m in served) and genai[0]["tokens_per_cpu_second"]:
            per_cpu = ", ".join(f"{m['clients']}: {m['tokens_per_cpu_second'] / g['tokens_per_cpu_second']:.2f}x"
                                for m, g in zip(served, genai))
            lines[-1] += f"; tokens per CPU second {per_cpu}"
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=CACHE / "models" / "smollm2-135m")
    parser.add_argument("--url", help="an already running server (default: start one)")
    parser.add_argument("--clients", default="1,4,16", help="concurrency levels (default 1,4,16)")
    parser.add_argument("--requests", type=int, default=16, help="requests per level (default 16)")
    parser.add_argument("--max-tokens", type=int, default=32, help="max_tokens of each request (default 32)")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="threads of each engine (default: cores)")
    parser.add_argument("--runs", type=int, default=1, help="measurements of both engines (default 1)")
    parser.add_argument("--no-genai", action="store_true", help="runnx serve only")
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = parser.parse_args()
    levels = [int(c) for c in args.clients.split(",")]
    topics = [TOPICS[i % len(TOPICS)] for i in range(args.requests)]
    model_id = args.model.name
    genai = not args.no_genai and GENAI_PYTHON.exists() and (GENAI_MODEL / "genai_config.json").exists()
    if not args.no_genai and not genai:
        print(f"onnxruntime-genai skipped: {GENAI_PYTHON} or {GENAI_MODEL} missing (see the top of scripts/bench.py)")
    prompts = chat_prompts(args.model, topics)
    print(f"{model_id}: {args.requests} greedy chat requests of max_tokens {args.max_tokens}, {args.threads} "
          f"thread(s) each engine, {args.runs} run(s)", flush=True)
    process, url = (None, args.url) if args.url else start_server(args.model, max(levels), args.threads)
    tables, texts, genai_runs = [], {}, []
    try:
        for clients in levels:  # untimed: runnx compiles and memoizes per shape on first use
            asyncio.run(run_level(url, model_id, clients, topics, args.max_tokens))
        for run in range(args.runs):
            served, theirs, load = [], None, os.getloadavg()[0]
            for engine in (["runnx", "genai"] if run % 2 == 0 else ["genai", "runnx"]):
                if engine == "genai" and genai:
                    measured = run_genai(prompts, args.max_tokens, args.threads)
                    genai_runs.append(measured["requests"])
                    theirs = genai_levels(measured["requests"], levels, measured["cpu_seconds"])
                elif engine == "runnx":
                    for clients in levels:
                        result, level_texts = asyncio.run(run_level(url, model_id, clients, topics, args.max_tokens,
                                                                     process and process.pid))
                        served.append(result)
                        for topic, text in level_texts.items():
                            texts.setdefault(topic, set()).add(text)
            tables.append(f"Run {run + 1} (load average {load:.1f} at its start, {os.getloadavg()[0]:.1f} at its "
                          f"end):\n\n{run_table(served, theirs)}")
            print(tables[-1], flush=True)
    finally:
        if process is not None:
            process.terminate()
            process.wait(30)
    served_same = all(len(texts[topic]) == 1 for topic in topics)
    agreement = (f"runnx serve gave each request {'the same text' if served_same else 'DIFFERENT texts'} at every "
                 "concurrency and run.")
    if genai:
        mine = runnx_ids(args.model, prompts, args.max_tokens)
        same_ids = sum(all(r[k]["ids"] == mine[k] for r in genai_runs) for k in range(len(prompts)))
        same_text = sum(all(r[k]["text"] == text for r in genai_runs for text in texts[topic])
                        for k, topic in enumerate(topics))
        agreement += (" Token ids: onnxruntime-genai's equal runnx's (the Generator, greedy; stop token aside) "
                      f"for {same_ids} of {len(prompts)} prompts; its text equals the text runnx serve streamed "
                      f"for {same_text} of {len(prompts)} (at every concurrency).")
        for k in range(len(prompts)):
            if genai_runs[0][k]["ids"] != mine[k]:
                print(f"  {topics[k]!r}: runnx {decode(args.model, mine[k])!r}\n"
                      f"  {' ' * len(repr(topics[k]))}  genai {genai_runs[0][k]['text']!r}")
    print(agreement)
    if args.no_write:
        return
    command = (f".venv/bin/python scripts/bench_serve.py --requests {args.requests} --max-tokens {args.max_tokens} "
               f"--runs {args.runs}")
    tokens = sum(r["tokens"] for r in genai_runs[0]) if genai_runs else None
    runs_text = "\n\n".join(tables)
    update_section("serve", f"""## Serving (`scripts/bench_serve.py`)

`runnx serve` with SmolLM2-135M (fp32): {args.requests} greedy chat requests of {args.max_tokens} new tokens at most{f' ({tokens} in all)' if tokens else ''} from
{', '.join(map(str, levels))} concurrent streaming clients (latency: a request's whole time; first token: from its start), beside
onnxruntime-genai's own loop on its fp32 export (`scripts/bench.py`'s GENAI_MODEL) serving the same prompt ids one after
another (at N clients, N requests queueing for it). {args.threads} thread(s) each, the engines alternating; runnx {git_revision()}; {machine()}.
Command: `{command}`.

{runs_text}

{agreement}
""")


if __name__ == "__main__":
    if sys.argv[1:] == ["--worker-genai"]:  # in the genai venv: neither runnx nor httpx there
        import numpy as np

        job = json.loads(sys.stdin.read())
        print(json.dumps(worker_genai(job["prompts"], job["max_tokens"], job["threads"])))
    else:
        main()
