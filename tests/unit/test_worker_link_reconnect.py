"""A worker's WorkerLink gets back to a new router at once (kvserve/workers/transport/worker_link.py).

A restarted router refuses a worker's connects (FAILED_PRECONDITION) until it has registered the worker and
handed its actor a link nonce through Ray; meanwhile the link's backoff grows. The nonce's arrival
(``bind``) must end the backoff wait, so the link connects then, not a backoff later (README "Failure
behaviour": a router restart is back in seconds). Real gRPC on loopback, the router's real gate.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from kvserve.router.api.server import build_server
from kvserve.router.config import RouterConfig
from kvserve.router.gate.bounds import Bounds
from kvserve.router.gate.worker_auth import WorkerLinkGate
from kvserve.router.requests.router import Router
from kvserve.workers.core.identity import WorkerIdentity
from kvserve.workers.core.worker_credential import issue_worker_credential, new_worker_key
from kvserve.workers.transport.outbox import Outbox
from kvserve.workers.transport.worker_link import WorkerLinkClient

LONG_BACKOFF_S = 60.0  # the wait after a refusal: a link that sat it out would miss every deadline below
CONNECT_TIMEOUT_S = 20.0  # generous for a loaded box, and far below LONG_BACKOFF_S


class _Incarnation:
    def remote(self) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        fut.set_result("inc-1")
        return fut


class FakeWorkerHandle:
    incarnation = _Incarnation()


def test_a_nonce_from_the_router_ends_the_backoff_and_the_link_connects_at_once() -> None:
    async def test() -> tuple[int, float]:
        router = Router(RouterConfig(port=0, link_grace_s=60))
        nonces: list[str] = []

        async def bind(worker_id: str, nonce: str) -> str:
            nonces.append(nonce)  # NOTE: held back: the test hands it to the link when the link is backing off
            return "inc-1"

        key = new_worker_key()
        gate = WorkerLinkGate(router.link, key, bind=bind)
        gate.expect(["w"])
        identity = WorkerIdentity("w", "m", block_size=16, total_blocks=32, max_model_len=256, vocab_size=100)
        router.add_worker("w", FakeWorkerHandle(), identity)
        server, port = build_server(router, RouterConfig(port=0), gate, Bounds(router))
        await server.start()
        noop: Any = lambda *a: None  # noqa: E731
        client = WorkerLinkClient(
            f"127.0.0.1:{port}", Outbox(), hello=lambda: identity.to_hello("inc-1"), on_connect=noop,
            on_command=noop, credential=issue_worker_credential(key, "w"), max_backoff_s=LONG_BACKOFF_S,
            first_backoff_s=LONG_BACKOFF_S,
        )  # fmt: skip
        client.start()
        try:
            deadline = time.monotonic() + CONNECT_TIMEOUT_S
            while not nonces:  # refused (no nonce yet): the gate asked "Ray" to hand the actor one
                assert time.monotonic() < deadline, "the gate never refused the unbound link"
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.2)  # NOTE: not needed for the outcome: only lets the link enter its backoff wait
            assert not router.link.connected("w")
            bound_at = time.monotonic()
            client.bind(nonces[-1])
            while not router.link.connected("w"):
                assert time.monotonic() - bound_at < CONNECT_TIMEOUT_S, "the link sat out its backoff after bind"
                await asyncio.sleep(0.02)
            return client.num_connects, time.monotonic() - bound_at
        finally:
            client.stop()
            await server.stop(0)

    connects, after = asyncio.run(test())
    assert connects >= 2, "the first connect (refused) and the one after bind"
    print(f"\nFIGURES the link connected {after:.2f}s after the nonce came (backoff {LONG_BACKOFF_S:.0f}s)")

