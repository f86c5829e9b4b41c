"""Keepalive: a client pinging every 2 s keeps a 30-second idle stream open against the server's keepalive policy
(``grpc.http2.min_ping_interval_without_data_ms`` 1 s by default); the same client against a server with gRPC's
own default policy (5 minutes) is cut off with GOAWAY "too_many_pings", which shows the pings are really sent.
Both run at once on one event loop, and need no model (the idle stream is an EmbedStream with no request yet)."""
from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from pagedserve.config import EngineConfig, ServerConfig
from pagedserve.entrypoints.app import create_server
from pagedserve_client.v1 import inference_pb2_grpc as pb_grpc

pytestmark = pytest.mark.e2e

IDLE_S = 30.0
AGGRESSIVE_CLIENT = [
    ("grpc.keepalive_time_ms", 2_000),              # ping every 2 s ...
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.http2.max_pings_without_data", 0),       # ... however long no data flows
    ("grpc.keepalive_permit_without_calls", 1),
]
GRPC_DEFAULT_POLICY_MS = 300_000


async def _idle_stream(port: int, idle_s: float) -> tuple[grpc.StatusCode, float, str]:
    """Open EmbedStream, send nothing for idle_s (or until the call ends), close the sending side, return
    (final status, seconds the call stayed open, status details)."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=AGGRESSIVE_CLIENT) as channel:
        call = pb_grpc.InferenceServiceStub(channel).EmbedStream()
        await call.wait_for_connection()
        start = time.monotonic()
        ended = asyncio.ensure_future(call.code())
        done, _ = await asyncio.wait([ended], timeout=idle_s)
        if not done:
            await call.done_writing()
            async for _ in call:
                pass
        return await ended, time.monotonic() - start, await call.details()


async def _run(config: ServerConfig, idle_s: float) -> tuple[grpc.StatusCode, float, str]:
    app, port = await create_server(config, EngineConfig())
    await app.load_models()
    try:
        return await _idle_stream(port, idle_s)
    finally:
        await app.stop(0)


@pytest.mark.slow
def test_aggressive_keepalive_pings_keep_an_idle_stream_open():
    ours = ServerConfig(host="127.0.0.1", port=0, http_port=0, embedding_model="", generation_model=False)
    strict = ServerConfig(host="127.0.0.1", port=0, http_port=0, embedding_model="", generation_model=False,
                          http2_min_ping_interval_without_data_ms=GRPC_DEFAULT_POLICY_MS)

    async def both():
        return await asyncio.gather(_run(ours, IDLE_S), _run(strict, IDLE_S))

    (code, open_s, _), (strict_code, strict_open_s, details) = asyncio.run(both())
    assert code == grpc.StatusCode.OK and open_s >= IDLE_S
    assert strict_code == grpc.StatusCode.UNAVAILABLE and "ping" in details.lower(), details
    assert strict_open_s < IDLE_S * 0.8
