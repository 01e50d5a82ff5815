"""Run one worker process: bind, print the address, serve until told to stop."""

from __future__ import annotations

import logging
import socket
import sys

import uvicorn

from tidegate.worker.app import create_app
from tidegate.worker.runtime import WorkerSettings

log = logging.getLogger("tidegate.worker")


def bind(host: str, port: int) -> socket.socket:
    """A listening socket; port 0 lets the OS pick a free one."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def address_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def serve_worker(settings: WorkerSettings, host: str, port: int, log_level: str = "info") -> int:
    """Serve until SIGINT/SIGTERM; exit status 1 when the engine failed to load or warm up."""
    logging.basicConfig(
        level=log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    sock = bind(host, port)
    # The first line of output is the address: the gateway and tests read it.
    print(address_of(sock), flush=True)
    server: uvicorn.Server | None = None
    failed = False

    def on_fatal() -> None:
        nonlocal failed
        failed = True
        if server is not None:
            server.should_exit = True

    app = create_app(settings, on_fatal=on_fatal)
    config = uvicorn.Config(
        app, log_level=log_level, access_log=False, lifespan="on", timeout_graceful_shutdown=10
    )
    server = uvicorn.Server(config)
    server.run(sockets=[sock])
    return 1 if failed else 0
