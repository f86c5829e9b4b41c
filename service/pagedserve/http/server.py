"""uvicorn inside the server's asyncio loop, on ``--http-port`` of ``--host``.

The socket is bound here (so port 0 works and the bound port is known before serving) and uvicorn's own signal
handling is bypassed: the process's SIGTERM/SIGINT handlers belong to :func:`pagedserve.cli.serve`, which drains
both APIs through :meth:`pagedserve.entrypoints.app.App.stop`.
"""
from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl

import structlog
import uvicorn

from ..config import ServerConfig
from ..serving.auth import ApiKeys
from ..serving.calls import CallTracker
from ..serving.metrics import ServerMetrics
from ..serving.services import Services
from .app import build_app

log = structlog.get_logger(__name__)


class _Uvicorn(uvicorn.Server):
    """uvicorn without its signal handlers (the process's belong to the CLI)."""

    def capture_signals(self):
        return contextlib.nullcontext()


def listening_socket(host: str, port: int) -> socket.socket:
    """The HTTP port's socket: bound to ``host``:``port`` (0: a free one), listening, non-blocking, with TCP_NODELAY,
    which the connections it accepts inherit. Without it a stream's small SSE writes on a kept-alive connection wait
    for the client's delayed ACK (Nagle's algorithm): with vLLM's `bench serve` client on one stream the first 7-8
    chunks arrived together, 40-80 ms after the first token was made.

    Raises:
        OSError: the address cannot be bound.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


class HttpServer:
    """The HTTP API of one server process.

    Args:
        config: ``host``, ``http_port``, ``api_key``, ``max_request_body_bytes``, ``served_model_name``.
        services: the process's services (filled in once loaded).
        metrics: the Prometheus registry ``/metrics`` serves.
        api_keys: the accepted keys (shared with the gRPC port); default: from ``config``.
        tracker: the process's call tracker (shared with the gRPC port); default: one of its own.
    """

    def __init__(self, config: ServerConfig, services: Services, metrics: ServerMetrics,
                 api_keys: ApiKeys | None = None, tracker: CallTracker | None = None):
        self.config = config
        app, self.gate = build_app(config, services, metrics,
                                   api_keys or ApiKeys(config.api_key, config.api_key_file), tracker)
        tls = dict(ssl_certfile=config.ssl_certfile, ssl_keyfile=config.ssl_keyfile, ssl_ca_certs=config.ssl_ca_certs,
                   ssl_cert_reqs=ssl.CERT_REQUIRED if config.ssl_ca_certs else ssl.CERT_NONE) if config.tls else {}
        self._uvicorn = _Uvicorn(uvicorn.Config(
            self.gate, log_config=None, access_log=False, lifespan="off", timeout_keep_alive=30,
            h11_max_incomplete_event_size=64 * 1024, **tls))
        self._socket: socket.socket | None = None
        self._main: asyncio.Task | None = None
        self.app = app

    async def start(self) -> int:
        """Bind and start serving; returns the bound port. Raises OSError when it cannot be bound."""
        sock = listening_socket(self.config.host, self.config.http_port)
        self._socket = sock
        self._main = asyncio.ensure_future(self._uvicorn.serve(sockets=[sock]))
        while not self._uvicorn.started:
            if self._main.done():  # failed to start: re-raise why
                self._main.result()
                raise OSError("the HTTP server stopped while starting")
            await asyncio.sleep(0.01)
        return sock.getsockname()[1]

    async def stop(self, timeout_s: float) -> None:
        """Stop accepting, ask open connections to close, give them ``timeout_s``, then cancel what is left."""
        if self._main is None:
            return
        self._uvicorn.config.timeout_graceful_shutdown = timeout_s
        self._uvicorn.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await self._main
        self._main = None
