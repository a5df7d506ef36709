"""The server on SmolLM2-135M and Whisper tiny.en, through the official `openai` client and 16
concurrent streaming httpx clients: every concurrent response complete and equal to its
sequential result."""
from __future__ import annotations

import json
import time

import pytest

from _server import run_concurrently, serve

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

TOPICS = ["the ocean", "a cat", "mountains", "coffee", "the moon", "trains", "music", "rain", "bread", "winter",
          "robots", "a forest", "the city", "birds", "history", "chess"]


@pytest.fixture(scope="module")
def real_server(smollm2_dir, whisper_dir):
    server = serve([smollm2_dir, whisper_dir])
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(real_server):
    return openai.OpenAI(base_url=real_server.url + "/v1", api_key="unused", timeout=600, max_retries=0)


def ask(topic: str) -> list[dict]:
    return [{"role": "user", "content": f"Write one sentence about {topic}."}]


def test_chat_with_the_openai_client_is_the_chat_api_result(client, smollm2_dir):
    from runnx.generate.chat import Chat
    from runnx.generate.generator import Generator
    expected = Chat(Generator.from_folder(smollm2_dir)).ask("What is the capital of France?", max_new_tokens=10)
    reply = client.chat.completions.create(model="smollm2-135m", max_tokens=10, temperature=0,
                                           messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert reply.choices[0].message.content == expected
    assert reply.usage.completion_tokens <= 10 and reply.usage.prompt_tokens > 10
    chunks = list(client.chat.completions.create(model="smollm2-135m", max_tokens=10, temperature=0, stream=True,
                                                 messages=[{"role": "user", "content": "What is the capital of France?"}]))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == reply.choices[0].finish_reason


def test_completion_with_the_openai_client(client):
    first = client.completions.create(model="smollm2-135m", prompt="The capital of France is", max_tokens=6)
    assert "Paris" in first.choices[0].text
    assert first.usage.completion_tokens == 6 and first.choices[0].finish_reason == "length"
    assert [m.id for m in client.models.list()] == ["smollm2-135m", "whisper-tiny.en"]


def test_transcription_with_the_openai_client(client, audio_dir, whisper_dir):
    from runnx.generate.whisper import transcribe
    expected = transcribe(audio_dir / "john.wav", whisper_dir).text
    with open(audio_dir / "john.wav", "rb") as file:
        text = client.audio.transcriptions.create(model="whisper-tiny.en", file=file).text
    assert text == expected and "John" in text
    with open(audio_dir / "john.wav", "rb") as file:
        verbose = client.audio.transcriptions.create(model="whisper-tiny.en", file=file,
                                                     response_format="verbose_json")
    assert verbose.text.strip() and verbose.segments and verbose.segments[-1].end <= verbose.duration + 0.5


def test_openai_client_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=ask("x"))
    with pytest.raises(openai.BadRequestError, match="'n' must be 1"):
        client.chat.completions.create(model="smollm2-135m", messages=ask("x"), n=2)
    with pytest.raises(openai.BadRequestError, match="context"):
        client.chat.completions.create(model="smollm2-135m", messages=ask("x"), max_tokens=9000)
    with pytest.raises(openai.BadRequestError, match="context is 8192 tokens"):
        client.completions.create(model="smollm2-135m", prompt="word " * 9000, max_tokens=1)


async def _stream_chat(http, topic: str, max_tokens: int) -> tuple[str, str]:
    body = {"model": "smollm2-135m", "messages": ask(topic), "max_tokens": max_tokens, "temperature": 0,
            "stream": True}
    pieces, finish, done = [], None, False
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                choice = json.loads(line[6:])["choices"][0]
                pieces.append(choice["delta"].get("content") or "")
                finish = choice["finish_reason"] or finish
    assert done and finish in ("stop", "length")  # every stream complete
    return "".join(pieces), finish


def test_16_concurrent_streams_equal_their_sequential_results(real_server, client):
    limits = [4 + i % 3 for i in range(len(TOPICS))]  # rows leave at different steps
    sequential = []
    for topic, limit in zip(TOPICS, limits):
        reply = client.chat.completions.create(model="smollm2-135m", messages=ask(topic), max_tokens=limit,
                                               temperature=0)
        sequential.append((reply.choices[0].message.content, reply.choices[0].finish_reason))
    scheduler = real_server.models["smollm2-135m"].scheduler
    scheduler.widest = 0

    assert run_concurrently(real_server.url, _stream_chat, zip(TOPICS, limits), 600) == sequential
    assert scheduler.widest >= 8  # the streams shared decode steps


def test_client_leaving_mid_stream_frees_its_row(real_server):
    body = {"model": "smollm2-135m", "prompt": "1, 2, 3, 4, 5, 6,", "max_tokens": 4000, "stream": True}
    with httpx.Client(base_url=real_server.url, timeout=600) as http:
        with http.stream("POST", "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
        # 4000 tokens would take minutes; the row must go at the next step boundary
        deadline = time.monotonic() + 20
        while http.get("/health").json()["models"]["smollm2-135m"]["active"]:
            assert time.monotonic() < deadline, "the abandoned stream still holds its row"
            time.sleep(0.2)
        reply = http.post("/v1/completions", json={"model": "smollm2-135m", "prompt": "Hi", "max_tokens": 2})
        assert reply.status_code == 200


def test_client_leaving_before_a_whole_response_frees_its_row(real_server):
    body = {"model": "smollm2-135m", "prompt": "1, 2, 3, 4, 5, 6,", "max_tokens": 4000}
    with httpx.Client(base_url=real_server.url, timeout=600) as http:
        with pytest.raises(httpx.ReadTimeout):
            http.post("/v1/completions", json=body, timeout=3)
        deadline = time.monotonic() + 20
        while http.get("/health").json()["models"]["smollm2-135m"]["active"]:
            assert time.monotonic() < deadline, "the abandoned request still holds its row"
            time.sleep(0.2)
