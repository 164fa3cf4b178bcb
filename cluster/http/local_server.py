"""An ASGI app under a real uvicorn on 127.0.0.1, in a background thread (tests, benchmarks)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator


@contextlib.contextmanager
def serve_app(app, start_timeout_s: float = 30.0) -> Iterator[str]:
    """Serve `app` on a free loopback port; yields its base URL; stops the server on exit."""
    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout_s
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    if not server.started:
        server.should_exit = True
        raise RuntimeError(f"uvicorn did not start on 127.0.0.1:{port} within {start_timeout_s} s")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
