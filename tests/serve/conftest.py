"""Fixtures of the serve tests: a server of the tiny fixtures and a client of it (`_server.py`)."""
from __future__ import annotations

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from _server import serve  # noqa: E402  (after the import checks)


@pytest.fixture(scope="module")
def tiny_server(fixtures_dir):
    """tiny-llama (chat template), tiny-gpt2 (none) and tiny-whisper, with a small body limit."""
    server = serve([fixtures_dir / "tiny-llama", fixtures_dir / "tiny-gpt2", fixtures_dir / "tiny-whisper"],
                   max_body_bytes=2 * 1024 * 1024)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(tiny_server):
    with httpx.Client(base_url=tiny_server.url, timeout=300) as http:
        yield http
