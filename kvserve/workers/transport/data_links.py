"""A worker's data links: one WorkerLink per owner (a frontend's data service), docs/architecture.md section 2a.

An owned request's outputs (tokens, text, logprobs) go to its owner directly, not through the router. Each
owner address gets its own ``Outbox`` (ordered, resent after a reconnect, bounded) and ``WorkerLinkClient``
(reconnects with backoff), created on the first request for that owner and kept until ``stop()``.

Threading contract (as ``kvserve/workers/transport/worker.py``): ``outbox_for``, ``disconnected_for``,
``stale`` and ``close`` run on any thread (the dict is locked); commands from an owner only enqueue into the engine's
inbox (``submit``), and the abort and its ``CommandAck`` run there.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Any

from kvserve.protos.kvserve.v1 import worker_pb2 as pb
from kvserve.workers.core.tls import channel_credentials
from kvserve.workers.transport.options import WorkerOptions
from kvserve.workers.transport.outbox import Outbox
from kvserve.workers.transport.worker_link import WorkerLinkClient

logger = logging.getLogger(__name__)


# NOTE: an owned request's progress reaches the router at least this often besides its first output, finish,
# preemptions and swaps: O(1) messages per request per second on the router's loop, never one per token.
PROGRESS_INTERVAL_S = 1.0


def owner_request_id(owner_key: str, worker_rid: str) -> str:
    """An owned request's id on its data link: ``<owner_key>#<tag>``, the tag being the part of the
    worker's id after its last ``#`` (the router's dispatch number; "" for an id without one)."""
    _, sep, tag = worker_rid.rpartition("#")
    return f"{owner_key}#{tag if sep else ''}"


class DataLinks:
    """The data links of one worker, by owner address.

    Args:
        options: the worker's options: ``data_credential`` (sent as ``kvserve-worker-credential``; data
            links carry no nonce proof) and the WorkerLink's TLS files.
        hello: the worker's Hello (the router link's own function: an owner learns who streams to it).
        submit: enqueue a closure into the engine's inbox (``WorkerCore._submit``).
        abort: on the engine thread, ``abort(address, key)`` aborts the request the owner at ``address``
            knows as ``key``; False when there is none (then this owner's abort is acked ``ok=False``).
    """

    def __init__(
        self,
        options: WorkerOptions,
        hello: Callable[[], pb.Hello],
        submit: Callable[[Callable[[], Any]], Future],
        abort: Callable[[str, str], bool],
    ) -> None:
        self._options = options
        self._hello = hello
        self._submit = submit
        self._abort = abort
        self._lock = threading.Lock()
        self._links: dict[str, WorkerLinkClient] = {}
        self._stopped = False

    def outbox_for(self, address: str) -> Outbox:
        """The outbox of ``address``'s data link, dialled now if this is its first request."""
        return self._link(address).outbox

    def disconnected_for(self, address: str) -> float:
        """Seconds ``address``'s data link has been down (0.0 while connected or never created).

        NOTE: counted from the link's creation before its first connect, so an owner that never answers
        orphans its requests after ``orphan_timeout_s`` like one that went away."""
        with self._lock:
            link = self._links.get(address)
        return link.disconnected_for() if link is not None else 0.0

    def stale(self, timeout_s: float) -> set[str]:
        """The owner addresses whose data link has been down for more than ``timeout_s``."""
        with self._lock:
            links = list(self._links.values())
        return {link.address for link in links if link.disconnected_for() > timeout_s}

    def addresses(self) -> list[str]:
        with self._lock:
            return list(self._links)

    def stop(self) -> None:
        """Stop every data link (their unsent outputs are dropped with the worker)."""
        with self._lock:
            self._stopped = True
            links, self._links = list(self._links.values()), {}
        _stop_all(links)

    def close(self, addresses: Iterable[str]) -> None:
        """Stop and forget the links of ``addresses`` (a later request for one of them dials it afresh); their
        unsent messages are dropped. Any thread, without waiting: the links stop on a thread of their own.

        NOTE: for owners gone for good (a frontend restarted on another port): each link is a thread and a
        channel redialling every few seconds, for as long as the worker lives, unless closed."""
        with self._lock:
            links = [link for a in set(addresses) if (link := self._links.pop(a, None)) is not None]
        if links:
            logger.info("data links to %s closed", sorted(link.address for link in links))
            threading.Thread(target=_stop_all, args=(links,), name="data-link-close", daemon=True).start()

    def _link(self, address: str) -> WorkerLinkClient:
        with self._lock:
            link = self._links.get(address)
            if link is not None:
                return link
            link = self._new_link(address)
            self._links[address] = link
            # NOTE: a worker stopping takes no new links; the outbox still takes (and drops) outputs.
            if not self._stopped:
                link.start()
            return link

    def _new_link(self, address: str) -> WorkerLinkClient:
        o = self._options
        link = WorkerLinkClient(
            address,
            Outbox(),
            hello=self._hello,
            on_connect=lambda: None,  # NOTE: an owner keeps no block index; the outbox resends what it lacks
            on_command=lambda cmd: self._on_command(address, cmd),
            credential=o.data_credential,
            credentials=channel_credentials(o.tls_ca, o.tls_cert, o.tls_key),
        )
        logger.info("data link to owner %s opened", address)
        return link

    def _on_command(self, address: str, cmd: pb.RouterCommand) -> None:
        """A command from the owner at ``address`` (its link thread): applied on the engine thread."""
        self._submit(lambda: self._apply(address, cmd))

    def _apply(self, address: str, cmd: pb.RouterCommand) -> None:
        """Engine thread: an owner may only abort its own requests (by its key); any other command is
        refused (``ok=False``): preemption and snapshots are the router's."""
        kind = cmd.WhichOneof("command")
        key = cmd.abort.request_id if kind == "abort" else ""
        ok = kind == "abort" and self._abort(address, key)
        if not ok:
            logger.info("owner %s: %s of %r ignored (unknown, not its own, or not an owner's)", address, kind, key)
        self.outbox_for(address).put(pb.WorkerMessage(ack=pb.CommandAck(command_seq=cmd.seq, request_id=key, ok=ok)))


def _stop_all(links: list[WorkerLinkClient]) -> None:
    """Stop ``links``, returning when all have stopped.

    NOTE: in parallel: a link dialling an unreachable owner notices the stop only when its connect attempt times
    out (seconds), so one at a time would take that long per dead owner."""
    stoppers = [threading.Thread(target=link.stop, name="data-link-stop", daemon=True) for link in links]
    for t in stoppers:
        t.start()
    for t in stoppers:
        t.join()
