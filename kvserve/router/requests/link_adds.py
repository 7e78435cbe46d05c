"""Requests added to a worker over its WorkerLink: ``AddRequests`` commands and their acks.

A worker whose Hello says ``takes_adds`` gets its dispatches as a message on the link the router already holds,
answered by the ``CommandAck`` that names the refused requests (kvserve/workers/core/add_command.py). A Ray actor
call cost the router ~550 us of CPU per dispatch, the message ~150 (``kvserve bench call-cost``; issue 41).

Contract:
* An ack precedes every output of the requests it added (one ordered stream, docs/architecture.md "Two
  channels"), so a request is known to be on its worker before its first token arrives.
* A command not yet applied is resent after a reconnect of the same process (``WorkerLinkService``), and a
  process applies each command once (by seq).
* Once the worker is down (``lost``: its process died or restarted, its link stayed down past the grace, it
  stalled), its unacked commands fail with ``AddLost`` and are withdrawn, so their requests continue
  elsewhere and a link that comes back does not start them there too. A command already sent may still be
  applied by a process that lives on; its outputs then belong to no current dispatch and are aborted
  (``Dispatcher.stop_stray``).
"""

from __future__ import annotations

import asyncio

from kvserve.protos.kvserve.v1 import worker_pb2 as pb
from kvserve.router.table.worker_link import WorkerLinkService
from kvserve.workers.core.add_command import add_commands
from kvserve.workers.core.request import WorkerRequest


class AddLost(ConnectionError):
    """The worker went down before it acked the add: its requests were not (knowingly) added."""


class LinkAdds:
    """The add commands in flight per worker, each a future resolved by its ack."""

    def __init__(self, link: WorkerLinkService) -> None:
        self.link = link
        self._pending: dict[str, dict[int, asyncio.Future[pb.CommandAck]]] = {}

    async def add(self, worker_id: str, requests: list[WorkerRequest]) -> list[tuple[str, str] | None] | None:
        """Send ``requests`` to ``worker_id`` and await their acks: None when every one was queued, else per
        request None or why it was refused (``(kind, message)``, as ``Worker.add_requests`` answers).

        Raises:
            AddLost: the worker went down first.
        """
        acks = await asyncio.gather(*[self._send(worker_id, c) for c in add_commands(requests)])
        refused = {x.request_id: (x.kind, x.message) for ack in acks for x in ack.refusals}
        return [refused.get(r.request_id) for r in requests] if refused else None

    def _send(self, worker_id: str, command: pb.AddRequests) -> asyncio.Future[pb.CommandAck]:
        fut: asyncio.Future[pb.CommandAck] = asyncio.get_running_loop().create_future()
        seq = self.link.send(worker_id, pb.RouterCommand(add_requests=command))
        pending = self._pending.setdefault(worker_id, {})
        pending[seq] = fut
        # NOTE: a wait given up (``WorkerTable.bounded``'s stall rule cancels it) leaves no entry behind
        fut.add_done_callback(lambda _: pending.pop(seq, None))
        return fut

    def on_ack(self, worker_id: str, ack: pb.CommandAck) -> bool:
        """An ack from ``worker_id``; True if it answered an add command."""
        fut = self._pending.get(worker_id, {}).pop(ack.command_seq, None)
        if fut is None:
            return False
        if not fut.done():
            fut.set_result(ack)
        return True

    def lost(self, worker_id: str) -> None:
        """``worker_id`` is down: fail and withdraw its unacked add commands."""
        for seq, fut in self._pending.pop(worker_id, {}).items():
            self.link.withdraw(worker_id, seq)
            if not fut.done():
                fut.set_exception(AddLost(f"worker {worker_id} went down before it acked add command {seq}"))

    def in_flight(self, worker_id: str) -> int:
        """Add commands sent to ``worker_id`` and not acked yet."""
        return len(self._pending.get(worker_id, ()))
