"""The HTTP port's socket (pagedserve.http.server.listening_socket): connections it accepts have TCP_NODELAY, so a
stream's small SSE writes go out at once on a kept-alive connection instead of waiting for the client's delayed
ACK."""
from __future__ import annotations

import socket

import pytest

from pagedserve.http.server import listening_socket


def test_accepted_connections_have_tcp_nodelay():
    server = listening_socket("127.0.0.1", 0)
    try:
        server.setblocking(True)
        client = socket.create_connection(server.getsockname()[:2], timeout=5)
        accepted, _ = server.accept()
        with client, accepted:
            assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
    finally:
        server.close()


def test_a_taken_port_is_refused_and_closed():
    first = listening_socket("127.0.0.1", 0)
    try:
        with pytest.raises(OSError):
            listening_socket("127.0.0.1", first.getsockname()[1])
    finally:
        first.close()
