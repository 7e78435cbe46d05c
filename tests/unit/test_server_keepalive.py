"""The router's gRPC server keepalive (kvserve/router/api/keepalive.py) on a real server (``build_server``)
and a real worker WorkerLink over loopback TCP, through a proxy that can go silent: the worker's
peer vanishes without a FIN or RST (as a host that lost power, or a partition, looks), and the
router must notice its link is gone by itself (pings unanswered), not wait forever."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from typing import Any

from kvserve.router.api.keepalive import server_keepalive_options
from kvserve.router.api.server import build_server
from kvserve.router.config import RouterConfig
from kvserve.router.gate.bounds import Bounds
from kvserve.router.gate.worker_auth import WorkerLinkGate
from kvserve.router.requests.router import Router
from kvserve.workers.core.identity import WorkerIdentity
from kvserve.workers.core.worker_credential import issue_worker_credential, new_worker_key
from kvserve.workers.transport.outbox import Outbox
from kvserve.workers.transport.worker_link import WorkerLinkClient

KEEPALIVE_S = 0.5
NOTICE_TIMEOUT_S = 10.0  # keepalive + timeout is 1 s: generous for a loaded box


class SilentProxy:
    """A loopback TCP proxy to ``upstream`` whose ``go_silent()`` stops forwarding in both
    directions while keeping every socket open: each side's kernel still acknowledges what it
    is sent, so neither side sees an error, only silence (no FIN, no RST)."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.silent = threading.Event()
        self.closed = threading.Event()
        self.sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closed.is_set():
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            self.sockets += [client, server]
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        src.settimeout(0.05)
        while not self.closed.is_set():
            if self.silent.is_set():
                self.closed.wait(0.05)  # read nothing, forward nothing, close nothing
                continue
            try:
                data = src.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            if not data or self.silent.is_set():
                if not data:
                    return
                continue  # NOTE: a chunk read as it went silent is dropped, as a partition would
            try:
                dst.sendall(data)
            except OSError:
                return

    def go_silent(self) -> None:
        self.silent.set()

    def close(self) -> None:
        self.closed.set()
        self.listener.close()
        for s in self.sockets:
            s.close()


class _Incarnation:
    def remote(self) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        fut.set_result("inc-1")  # the same process: only its link is in question
        return fut


class FakeWorkerHandle:
    incarnation = _Incarnation()


def test_the_server_applies_its_keepalive_options() -> None:
    options = dict(server_keepalive_options(RouterConfig(port=0, keepalive_s=7, keepalive_timeout_s=3)))
    assert options["grpc.keepalive_time_ms"] == 7000 and options["grpc.keepalive_timeout_ms"] == 3000
    assert options["grpc.keepalive_permit_without_calls"] == 1


def test_a_worker_link_whose_peer_goes_silent_is_noticed_by_keepalive() -> None:
    async def test() -> float:
        config = RouterConfig(port=0, keepalive_s=KEEPALIVE_S, keepalive_timeout_s=KEEPALIVE_S, link_grace_s=60)
        router = Router(config)
        key = new_worker_key()
        gate = WorkerLinkGate(router.link, key)
        gate.expect(["w"])
        identity = WorkerIdentity("w", "m", block_size=16, total_blocks=32, max_model_len=256, vocab_size=100)
        router.add_worker("w", FakeWorkerHandle(), identity)
        server, port = build_server(router, config, gate, Bounds(router))
        await server.start()
        proxy = SilentProxy(("127.0.0.1", port))
        noop: Any = lambda *a: None  # noqa: E731
        client = WorkerLinkClient(
            f"127.0.0.1:{proxy.port}", Outbox(), hello=lambda: identity.to_hello("inc-1"), on_connect=noop,
            on_command=noop, credential=issue_worker_credential(key, "w"),
        )  # fmt: skip
        client.start()
        try:
            deadline = time.monotonic() + NOTICE_TIMEOUT_S
            while not router.link.connected("w"):
                assert time.monotonic() < deadline, "the worker's WorkerLink never connected"
                await asyncio.sleep(0.05)
            proxy.go_silent()
            t0 = time.monotonic()
            while router.link.connected("w"):
                assert time.monotonic() - t0 < NOTICE_TIMEOUT_S, (
                    f"the router still thinks the silent worker's link is up after {NOTICE_TIMEOUT_S}s"
                )
                await asyncio.sleep(0.05)
            noticed = time.monotonic() - t0
            assert router.table["w"].link_lost_at is not None  # the liveness rule's grace clock runs
            return noticed
        finally:
            client.stop()
            proxy.close()
            await server.stop(0)

    noticed = asyncio.run(test())
    print(f"\nFIGURES keepalive: a silent WorkerLink peer noticed {noticed:.2f}s after it went silent "
          f"(keepalive {KEEPALIVE_S}s + timeout {KEEPALIVE_S}s)")  # fmt: skip
