"""Run an ASGI app under uvicorn on a background thread: for notebooks, tests and benchmarks."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@contextmanager
def background(app: Any, host: str = "127.0.0.1", port: int | None = None, timeout: float = 60.0) -> Iterator[str]:
    """Serve `app` until the block ends; yields its base URL, e.g. http://127.0.0.1:PORT.

    The server runs its lifespan (so `create_app`'s batcher starts and stops with it) and
    shuts down gracefully when the block exits.
    """
    import uvicorn

    port = port or free_port(host)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="error", lifespan="on"))
    thread = threading.Thread(target=server.run, name="driftlab-uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError(f"the server on {host}:{port} did not start")
        time.sleep(0.02)
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout)
