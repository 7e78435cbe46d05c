"""A restarted router's commands reach a worker that applied a previous router's (kvserve/router/table/worker_link.py).

A worker drops a command whose seq is not above the highest it applied (a resend after a reconnect). A new
router process, or a restarted frontend's data service, must therefore number its commands above what the
worker saw from the previous one: otherwise its first Aborts (a client's cancel), Preempts and Reowns (a
resume through another frontend) vanish without an error. Real gRPC on loopback, the real link on both ends.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import grpc

from kvserve.protos.kvserve.v1 import worker_pb2 as pb
from kvserve.protos.kvserve.v1 import worker_pb2_grpc
from kvserve.router.table.worker_link import WorkerLinkHandler, WorkerLinkService
from kvserve.workers.core.identity import WorkerIdentity
from kvserve.workers.transport.outbox import Outbox
from kvserve.workers.transport.worker_link import WorkerLinkClient

TIMEOUT_S = 20.0


class _Hellos(WorkerLinkHandler):
    def __init__(self) -> None:
        self.hellos = 0

    def on_hello(self, worker_id: str, hello: pb.Hello, restarted: bool) -> None:
        self.hellos += 1


async def _serve(port: int) -> tuple[grpc.aio.Server, WorkerLinkService, _Hellos, int]:
    """A router's WorkerLink (a new process each call: nothing shared with an earlier one) on ``port`` (0: any)."""
    handler = _Hellos()
    service = WorkerLinkService(handler)
    server = grpc.aio.server()
    worker_pb2_grpc.add_WorkerLinkServicer_to_server(service, server)
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, service, handler, port


async def _until(ok: Any, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not ok():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


def test_a_new_routers_first_commands_are_applied_by_a_worker_that_applied_the_old_ones() -> None:
    """The worker's Hello tells the new router the last seq it applied; the new router numbers after it. (A
    command queued before a new process's Hello is moot and dropped, by design: section 4.)"""

    async def test() -> list[str]:
        applied: list[str] = []
        lock = threading.Lock()

        def on_command(cmd: pb.RouterCommand) -> None:
            with lock:
                applied.append(cmd.abort.request_id)

        identity = WorkerIdentity("w", "m", block_size=16, total_blocks=32, max_model_len=256, vocab_size=100)
        noop: Any = lambda *a: None  # noqa: E731
        old, old_link, _, port = await _serve(0)
        client = WorkerLinkClient(f"127.0.0.1:{port}", Outbox(), hello=lambda: identity.to_hello("inc-1"),
                                  on_connect=noop, on_command=on_command, first_backoff_s=0.05)  # fmt: skip
        client.start()
        try:
            await _until(lambda: old_link.connected("w"), "the link to the first router")
            for i in range(3):
                old_link.abort("w", f"old-{i}")
            await _until(lambda: len(applied) == 3, "the first router's commands")
            await old.stop(0)  # the router process dies; a new one serves the same address
            new, new_link, hellos, _ = await _serve(port)
            try:
                await _until(lambda: new_link.connected("w") and hellos.hellos, "the link to the new router")
                new_link.abort("w", "new-0")
                await _until(lambda: len(applied) == 4, "the new router's first command (dropped as a resend?)")
            finally:
                await new.stop(0)
        finally:
            client.stop()
        return applied

    assert asyncio.run(test()) == ["old-0", "old-1", "old-2", "new-0"]
