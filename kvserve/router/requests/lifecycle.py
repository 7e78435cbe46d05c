"""``RequestLifecycle``: the one owner of how a request leaves a worker and how it ends.

Every way a request stops running somewhere goes through here: ``finish`` (it ended: forgotten
everywhere, its promises released), ``fail`` (ended with a gRPC status), ``cancel`` (the client
left, its deadline passed), ``abort`` (the Abort RPC), ``overflow`` (its client stopped reading),
``stop_on`` (its dispatch on one worker is aborted and that worker's promise released) and
``hand_off`` (it continues elsewhere after the tokens already streamed: a failover replay or a
drain's hand-off). The Abort command itself is built in one place, ``WorkerLinkService.abort``;
a worker's promised blocks are written only by ``WorkerState.placed``/``released``.
"""

from __future__ import annotations

import logging

import grpc

from kvserve.router.requests.pipeline import RequestPipeline
from kvserve.router.requests.request import RouterError, RouterRequest

logger = logging.getLogger(__name__)


class RequestLifecycle:
    def __init__(self, router: RequestPipeline) -> None:
        self.router = router

    def finish(self, r: RouterRequest) -> None:
        """``r`` ended: its id is free at once, its placement affinity and promises go."""
        router = self.router
        r.finished = True
        if router.requests.get(r.request_id) is r:
            del router.requests[r.request_id]
        router.dispatcher.forget(r)
        if r.owner_key:
            router.owned.forget(r)
        router.prefix_index.drop_pending(r.worker_rid)
        if r.worker_rid not in router.dispatcher.adding:  # else the dispatch releases it when its call resolves
            for entry in router.table.entries.values():
                entry.released(r.worker_rid)

    def fail(self, r: RouterRequest, code: grpc.StatusCode, message: str) -> None:
        """End ``r`` with ``code``: its client's stream ends with that status."""
        if r.finished:
            return
        self.router.queue.remove(r.request_id)
        self.finish(r)
        r.responses.put_nowait(RouterError(code, message))

    def cancel(self, r: RouterRequest) -> None:
        """Client gone (cancel, deadline) or Abort: free everything the request holds. Its id is
        free at once; its worker frees the blocks at its next step boundary."""
        if r.finished:
            return
        r.cancelled = True
        self.router.queue.remove(r.request_id)
        if r.worker_id is not None:
            self.router.link.abort(r.worker_id, r.worker_rid)
        # NOTE: a dispatch still in flight sees ``cancelled`` (or a superseded id) and aborts itself.
        self.finish(r)

    def abort(self, request_id: str) -> bool:
        """The Abort RPC: end request ``request_id`` CANCELLED; False if there is no such live request."""
        r = self.router.requests.get(request_id)
        if r is None or r.finished or r.cancelled:
            return False
        self.cancel(r)
        r.responses.put_nowait(RouterError(grpc.StatusCode.CANCELLED, "aborted by Abort RPC"))
        return True

    def overflow(self, r: RouterRequest) -> None:
        """The client left ``max_buffered_responses`` unread: abort the request (its blocks are
        freed on its worker) and drop what it did not read; it ends RESOURCE_EXHAUSTED."""
        limit = self.router.config.max_buffered_responses
        logger.warning("request %s: client stopped reading (%d responses unread); aborted",
                       r.request_id, r.responses.qsize())  # fmt: skip
        if r.worker_id is not None:
            self.router.link.abort(r.worker_id, r.worker_rid)
        self.finish(r)
        while not r.responses.empty():
            r.responses.get_nowait()
        r.responses.put_nowait(RouterError(
            grpc.StatusCode.RESOURCE_EXHAUSTED, f"client did not read its stream ({limit} responses unread); aborted",
        ))  # fmt: skip

    def stop_on(self, r: RouterRequest, worker_id: str) -> None:
        """Abort ``r``'s current dispatch on ``worker_id`` and release its promise there; ``r`` runs
        nowhere afterwards (outputs of that dispatch are strays from now on)."""
        router = self.router
        router.dispatcher.forget(r)
        router.link.abort(worker_id, r.worker_rid)
        entry = router.table.get(worker_id)
        if entry is not None and r.worker_rid not in router.dispatcher.adding:
            entry.released(r.worker_rid)
        r.worker_id = None
        r.held.clear()

    def hand_off(self, r: RouterRequest, why: str) -> None:
        """Continue ``r`` (stopped on its worker: ``stop_on``) elsewhere after the tokens already streamed
        (the worker fast-forwards text state and the seeded RNG): placed now, or first in line in the
        queue, or ended UNAVAILABLE ``why`` when no worker can take it. An owned request first asks its
        owner for the tokens its client has (kvserve/router/requests/owned.py); its answer continues here."""
        if r.owner_key:
            self.router.owned.ask_resume(r, why)
            return
        self.continue_elsewhere(r, why)

    def continue_elsewhere(self, r: RouterRequest, why: str) -> None:
        """``hand_off`` once the tokens ``r`` continues after are known."""
        router = self.router
        if not router.place(r) and not router.queue.offer(r, first=True):
            self.fail(r, grpc.StatusCode.UNAVAILABLE, why)
