"""A runnx server on 127.0.0.1 in a background thread (uvicorn on a socket bound to a free port),
for the serve tests."""
from __future__ import annotations

import socket
import threading
import time

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")


class RunningServer:
    """Serves `app` on 127.0.0.1:<free port> until stop(); `url` is its base address."""

    def __init__(self, app, models: dict):
        import uvicorn
        self.app = app
        self.models = models
        self.socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.socket.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.socket.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]}, daemon=True)

    def start(self) -> "RunningServer":
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.socket.close()


def serve(folders, **options) -> RunningServer:
    from runnx.serve.app import create_app
    from runnx.serve.models import load_models
    models = load_models(folders, max_batch=options.pop("max_batch", 16))
    return RunningServer(create_app(models, **options), models).start()


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
