"""tests/chaos/relay.py on its own (no cluster): it relays both ways, a blackhole holds one process's
bytes for its window and then delivers them, a sever resets its connections and refuses it until the
window ends."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Iterator

import pytest

from tests.chaos.relay import TcpRelay


@pytest.fixture
def echo() -> Iterator[tuple[str, int]]:
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            threading.Thread(target=_echo, args=(conn,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    yield server.getsockname()[:2]
    server.close()


def _echo(conn: socket.socket) -> None:
    with conn, contextlib.suppress(OSError):  # NOTE: the relay resets it on a sever
        while data := conn.recv(1024):
            conn.sendall(data)


def _roundtrip(sock: socket.socket, payload: bytes, timeout: float) -> bytes:
    sock.settimeout(timeout)
    sock.sendall(payload)
    got = b""
    while len(got) < len(payload):
        got += sock.recv(1024)
    return got


def test_blackhole_holds_then_delivers_and_sever_resets(echo: tuple[str, int]) -> None:
    relay = TcpRelay(echo)
    try:
        sock = socket.create_connection(("127.0.0.1", relay.port))
        assert _roundtrip(sock, b"hello", 10) == b"hello"
        assert relay.connections_of(os.getpid()) == 1

        relay.blackhole(os.getpid(), 30.0)
        with pytest.raises(TimeoutError):
            _roundtrip(sock, b"held", 0.5)  # nothing comes back while the window lasts
        relay.blackhole(os.getpid(), 0.0)  # the window ends: what was sent meanwhile arrives
        sock.settimeout(10)
        assert sock.recv(1024) == b"held"
        assert relay.late_bytes_of(os.getpid()) == 4

        relay.sever(os.getpid(), 30.0)
        sock.settimeout(10)
        with pytest.raises(OSError):  # reset (or closed) by the relay
            if not sock.recv(1024):
                raise ConnectionResetError("closed")
        again = socket.create_connection(("127.0.0.1", relay.port))
        with pytest.raises(OSError):  # refused while severed
            _roundtrip(again, b"x", 10)
            raise AssertionError("relayed while severed")
        relay.sever(os.getpid(), 0.0)
        back = socket.create_connection(("127.0.0.1", relay.port))
        assert _roundtrip(back, b"back", 10) == b"back"
        assert relay.connections_of(os.getpid()) == 2
    finally:
        relay.close()
