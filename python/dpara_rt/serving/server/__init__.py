"""`dpara-rt serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over the request scheduler.

    from dpara_rt.serving.server import create_app, ServerThread
    app = create_app(Scheduler(engine), tokenizer, "tiny")
    with ServerThread(app) as srv:          # uvicorn on 127.0.0.1, a free port, in a background thread
        openai.OpenAI(base_url=srv.url + "/v1", api_key="-").completions.create(model="tiny", prompt="def f(")

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with ``"stream": true`` as server-sent
events ending in ``data: [DONE]``), ``GET /v1/models``, ``GET /health`` (503 while draining) and ``GET /metrics``
(Prometheus text). Errors carry OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``: 400 for bad
JSON / fields / values and over-long prompts (code ``context_length_exceeded``), 404 for an unknown model or
path, 413 for a body over 1 MiB, 429 when the scheduler's queue is full, 503 while shutting down.

Chat needs a chat template: the target directory's, or ``--chat-template FILE``. The embedded pair is a code
model with none, so there chat requests get a 400 that says so (no made-up template).

Shutdown (SIGTERM / SIGINT, :func:`run`): the server stops accepting connections and new requests (503),
lets running requests finish for ``grace_s`` seconds, then cancels the rest (their responses end with
finish_reason ``"abort"``), closes the scheduler and returns 0.
"""
from __future__ import annotations

import signal
import socket
import threading

from dpara_rt.serving.server.app import Generation, ServerState, create_app
from dpara_rt.serving.server.protocol import APIError


def _server(app, sock: socket.socket, log_level: str, grace_s: float, cls=None):
    import uvicorn
    config = uvicorn.Config(app, log_level=log_level, lifespan="off", timeout_graceful_shutdown=grace_s,
                            access_log=False)
    return (cls or uvicorn.Server)(config)


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


class ServerThread:
    """uvicorn serving `app` from a background thread (tests, benchmarks); port 0 picks a free port."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        self.app, self.sock = app, _bind(host, port)
        self.host, self.port = host, self.sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        self.server = _server(app, self.sock, log_level, grace_s=5.0)
        self.thread = threading.Thread(target=self.server.run, kwargs=dict(sockets=[self.sock]),
                                       name="dpara-rt-uvicorn", daemon=True)

    def start(self, timeout: float = 30.0) -> "ServerThread":
        self.thread.start()
        for _ in range(int(timeout / 0.01)):
            if self.server.started or not self.thread.is_alive():
                break
            threading.Event().wait(0.01)
        if not self.server.started:
            raise RuntimeError(f"the server did not start on {self.url}")
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        self.sock.close()

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def run(app, host: str = "127.0.0.1", port: int = 8000, grace_s: float = 30.0, log_level: str = "info",
        on_listen=None) -> int:
    """Serve `app` until SIGTERM / SIGINT, then drain: no new requests, running ones get `grace_s` seconds to
    finish, the rest are cancelled. Returns 0 (the signal is handled, not re-raised). A second SIGINT exits at
    once. The caller closes the scheduler afterwards."""
    import uvicorn

    state: ServerState = app.state.server
    timer: list[threading.Timer] = []

    class _Server(uvicorn.Server):
        def handle_exit(self, sig, frame):  # uvicorn would re-raise the signal after shutdown (exit 143)
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
            self.should_exit = True
            if not state.draining:
                state.draining = True
                t = threading.Timer(grace_s, state.cancel_all)
                t.daemon = True
                t.start()
                timer.append(t)

    sock = _bind(host, port)
    server = _server(app, sock, log_level, grace_s=grace_s + 10.0, cls=_Server)
    if on_listen is not None:
        on_listen(sock.getsockname())
    try:
        server.run(sockets=[sock])
    finally:
        for t in timer:
            t.cancel()
        sock.close()
    return 0


__all__ = ["APIError", "Generation", "ServerState", "ServerThread", "create_app", "run"]
