"""A runnx server on 127.0.0.1 in a background thread (uvicorn on a socket bound to a free port),
and clients talking to it at once: helpers of the serve tests (a module of its own: `conftest`
names more than one module in this suite)."""
from __future__ import annotations

import asyncio
import socket
import threading
import time

import httpx


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


def run_concurrently(url: str, stream, jobs, timeout: float) -> list:
    """`stream(http, *job)` for every job at once on one event loop (one httpx client); the results
    in the jobs' order."""
    async def all_at_once():
        async with httpx.AsyncClient(base_url=url, timeout=timeout) as http:
            return await asyncio.gather(*(stream(http, *job) for job in jobs))
    return asyncio.run(all_at_once())
