"""Dispatch: a request's placements on workers, each under its own worker-side id, and its replay
when its worker dies.

Per-dispatch ids: the router sends each placement of a request to its worker as
``<request_id>#<router incarnation>.<n>``, so outputs of an aborted or dead dispatch never reach a
replay, a finished request's id is free at once, and outputs of a previous router's requests
(orphans after a router restart) are recognised and aborted.
"""

from __future__ import annotations

import itertools
import logging
import time
import uuid
from collections import OrderedDict

import grpc

from kvserve.protos.kvserve.v1 import worker_pb2 as pb
from kvserve.router.requests.link_adds import AddLost, LinkAdds
from kvserve.router.requests.pipeline import RequestPipeline
from kvserve.router.requests.request import WORKER_UP, RouterRequest
from kvserve.router.table.workers import WorkerState, actor_dead
from kvserve.workers.core.request import WorkerRequest

logger = logging.getLogger(__name__)

_MAX_ORPHANS = 4096


class Dispatcher:
    """Sends requests to workers (``AddRequests`` on the WorkerLink, ``link_adds.py``; the Ray call to a worker
    that does not take them) and maps worker-side ids back to requests."""

    def __init__(self, router: RequestPipeline) -> None:
        self.router = router
        self.incarnation = uuid.uuid4().hex[:8]
        self._seq = itertools.count(1)
        self.by_worker_rid: dict[str, RouterRequest] = {}  # current dispatches only
        self._orphans: OrderedDict[str, None] = OrderedDict()  # stray dispatch ids already aborted
        self._foreign_logged: set[str] = set()
        self.adding: set[str] = set()  # dispatch ids whose add_request call has not resolved yet
        # id(worker entry) -> (entry, [(request, dispatch id)]) placed there and not sent yet (``_send``)
        self._outgoing: dict[int, tuple[WorkerState, list[tuple[RouterRequest, str]]]] = {}
        self._sending: set[int] = set()  # id(worker entry) with an add call in flight
        self.link_adds = LinkAdds(router.link)

    def current(self, worker_rid: str) -> RouterRequest | None:
        return self.by_worker_rid.get(worker_rid)

    def holds_requests(self, worker_id: str) -> bool:
        """Some request runs on, or is being dispatched to, ``worker_id`` (the liveness rule's "work")."""
        return any(r.worker_id == worker_id or r.target == worker_id for r in self.router.requests.values())

    def forget(self, r: RouterRequest) -> None:
        self.by_worker_rid.pop(r.worker_rid, None)

    def pend(self, r: RouterRequest, worker_id: str) -> None:
        """Record ``r``'s prompt blocks as about to be on ``worker_id`` (placement affinity).

        NOTE: keyed by the dispatch's worker-side id: a request id is reusable as soon as its stream
        ended, and the old request's late clean-up must not drop the new one's entry.
        """
        self.router.prefix_index.drop_pending(r.worker_rid)
        self.router.prefix_index.add_pending(worker_id, r.worker_rid, r.block_hashes)

    def stop_stray(self, worker_id: str, out: pb.RequestOutput) -> None:
        """An output of no current dispatch: nobody will read it, so abort it (once per dispatch id).

        Usually it was stopped already (aborted, or its worker given up) and this is one of its last
        outputs in flight; but an ``add_request`` that timed out after its request ended (cancelled
        meanwhile) can still land, and an orphan a previous router placed has nobody at all: without
        this they would run to ``max_tokens`` holding their blocks. An abort of an id the worker no
        longer has is a no-op there."""
        if out.finish_reason or out.owned or out.request_id in self._orphans:
            # NOTE: an owned request's progress: a restarted router sees it before the worker's RequestTable
            # (kvserve/router/requests/owned.py adopts it then); its owner, not this router, reads it.
            return
        self._orphans[out.request_id] = None
        while len(self._orphans) > _MAX_ORPHANS:
            self._orphans.popitem(last=False)
        self.router.link.abort(worker_id, out.request_id)

    def foreign(self, worker_id: str, out: pb.RequestOutput, r: RouterRequest) -> None:
        """An output for a current dispatch from a worker it is not on: never delivered (a worker
        cannot write into another's streams); logged once per worker."""
        if worker_id not in self._foreign_logged and len(self._foreign_logged) < _MAX_ORPHANS:
            self._foreign_logged.add(worker_id)
            logger.warning("worker %s sent output for %s, which runs on %s: dropped (logged once per worker)",
                           worker_id, out.request_id, sorted(r.dispatch_workers))  # fmt: skip

    def dispatch(self, r: RouterRequest, worker_id: str, promised_blocks: int) -> None:
        """Send ``r`` to ``worker_id`` under a fresh dispatch id, promising ``promised_blocks`` there
        until the worker's report shows them (the one dispatch path: placement, pump, preemption)."""
        router = self.router
        self.forget(r)
        r.worker_rid = f"{r.request_id}#{self.incarnation}.{next(self._seq)}"
        r.dispatch_workers = {worker_id}
        self.by_worker_rid[r.worker_rid] = r
        entry = router.table[worker_id]
        entry.placed(r.worker_rid, promised_blocks)
        self.adding.add(r.worker_rid)
        self.pend(r, worker_id)
        r.target = worker_id
        if r.started_at is None:
            r.started_at = time.monotonic()  # service time (kvserve/router/policy/service_times.py) counts from here
        self._send(r, entry)

    def _send(self, r: RouterRequest, entry: WorkerState) -> None:
        """Queue ``r``'s dispatch for ``entry``. At most one add call per worker is in flight; what is placed
        there meanwhile goes in the next call, all together (``_send_all``). The worker takes requests only
        between two steps and its actor answers calls one at a time, so a queued request waits no longer
        than a call of its own would, and a burst of N arrivals costs the router a few actor calls per
        worker, not N (issue 41: router CPU per request; a Ray call is a third of it)."""
        key = id(entry)
        self._outgoing.setdefault(key, (entry, []))[1].append((r, r.worker_rid))
        if key not in self._sending:
            self._sending.add(key)
            self.router.spawn(self._send_all(key))

    async def _send_all(self, key: int) -> None:
        """Send ``key``'s queued dispatches, one call at a time, until none is left."""
        try:
            while key in self._outgoing:
                entry, items = self._outgoing.pop(key)
                if entry.state != WORKER_UP:  # it went down while they waited: continue them elsewhere
                    for r, worker_rid in items:
                        self._not_sent(r, entry, worker_rid)
                    continue
                try:
                    await self._add_requests(entry, items)
                except Exception:  # noqa: BLE001 - a bug here must not leave these requests waiting forever
                    logger.exception("dispatching %d request(s) to %s failed", len(items), entry.worker_id)
                    for r, worker_rid in items:
                        if r.worker_rid == worker_rid and not r.finished and r.worker_id is None:
                            self._release(entry, worker_rid)
                            self.router.lifecycle.fail(r, grpc.StatusCode.INTERNAL, "dispatch failed (router bug)")
        finally:
            self._sending.discard(key)

    def _not_sent(self, r: RouterRequest, entry: WorkerState, worker_rid: str) -> None:
        self._release(entry, worker_rid)
        if r.worker_rid != worker_rid or r.finished:
            return
        r.target, r.worker_id = None, entry.worker_id
        self.replay(r, entry.worker_id)

    def _worker_request(self, r: RouterRequest, worker_rid: str) -> WorkerRequest:
        # NOTE: the stream handler binds a resume grant right after submit, in the same turn of the loop,
        # so it is set by the time the dispatch task builds this (a queued request's later still)
        g = r.resume
        grant = (g.token, g.request_id, g.tenant, g.client) if g is not None else ()
        return WorkerRequest(worker_rid, tuple(r.prompt_ids), r.params, r.priority, r.tenant or None,
                             tuple(r.output_ids), owner=r.owner, owner_key=r.owner_key, resume_grant=grant)  # fmt: skip

    async def _add_requests(self, entry: WorkerState, items: list[tuple[RouterRequest, str]]) -> None:
        """Add ``items`` on ``entry`` and apply each outcome as that request's own: an ``AddRequests`` on its
        link (``entry.takes_adds``: what real workers say), else the Ray call, ``add_request`` for one (the call
        every test double answers) or ``add_requests`` for several. Either answers None when all were queued,
        else per request None or why the worker refused it. NOTE: the worker takes requests between two
        steps, so an answer slower than its stall threshold means it is stalled
        (kvserve/router/table/liveness.py): never wait longer."""
        router = self.router
        now = time.monotonic()
        for r, _ in items:
            router.metrics.dispatched(now - r.arrival)
        requests = [self._worker_request(r, worker_rid) for r, worker_rid in items]
        incarnation = entry.incarnation  # evidence from this call concerns this process only
        try:
            if entry.takes_adds:
                refusals = await router.table.bounded(entry, self.link_adds.add(entry.worker_id, requests))
            elif len(requests) == 1:
                await router.table.bounded(entry, entry.handle.add_request.remote(requests[0]))
                refusals: list[tuple[str, str] | None] | None = None
            else:
                refusals = await router.table.bounded(entry, entry.handle.add_requests.remote(requests))
        except Exception as e:  # noqa: BLE001 - Ray wraps the worker's exception; each request meets it
            for r, worker_rid in items:
                self._not_added(r, entry, worker_rid, e, incarnation)
            return
        for (r, worker_rid), refusal in zip(items, refusals or [None] * len(items), strict=True):
            if refusal is None:
                self._added(r, entry, worker_rid)
            else:
                kind, message = refusal
                self._not_added(r, entry, worker_rid, ValueError(message) if kind == "invalid" else
                                RuntimeError(message), incarnation)  # fmt: skip

    def _not_added(self, r: RouterRequest, entry: WorkerState, worker_rid: str, e: BaseException,
                   incarnation: str | None) -> None:  # fmt: skip
        """``r``'s add on ``entry`` failed with ``e``: a stalled worker is given up, a dead one is down (``r``
        continues elsewhere either way), a refusal ends ``r`` (INVALID_ARGUMENT for bad input)."""
        router = self.router
        self._release(entry, worker_rid)
        if isinstance(e, AddLost):  # NOTE: the worker is down already (``replay_all`` failed its adds)
            if r.worker_rid == worker_rid and not r.finished:
                r.target, r.worker_id = None, entry.worker_id
                self.replay(r, entry.worker_id)
            return
        if isinstance(e, TimeoutError):
            if r.worker_rid != worker_rid or r.finished:
                # NOTE: the call may still land: stop that copy (an abort of an unknown id is a no-op)
                router.link.abort(entry.worker_id, worker_rid)
                return
            threshold = router.table.stall_threshold_s(entry)
            r.target, r.worker_id = None, entry.worker_id
            router.table.give_up(entry, f"add_request did not return in {threshold:.1f}s", incarnation)
            if r.worker_id == entry.worker_id:  # NOTE: give_up replays it unless it did not apply
                self.replay(r, entry.worker_id)
            return
        if r.worker_rid != worker_rid or r.finished:
            return  # superseded meanwhile (its worker died and it was replayed, or it ended)
        r.target = None
        cause = getattr(e, "cause", e)
        if isinstance(cause, ValueError):
            router.lifecycle.fail(r, grpc.StatusCode.INVALID_ARGUMENT, str(cause))
        elif actor_dead(e):
            r.worker_id = entry.worker_id
            router.table.down(entry, f"a call found its actor dead ({type(e).__name__})", incarnation)
            if r.worker_id == entry.worker_id:  # a later process of it lives: continue elsewhere
                self.replay(r, entry.worker_id)
        else:
            logger.warning("dispatch of %s to %s failed: %r", r.request_id, entry.worker_id, e)
            router.table.dispatch_failed(entry, repr(cause))  # its circuit breaker (router/table/breaker.py)
            router.lifecycle.fail(r, grpc.StatusCode.UNAVAILABLE, f"worker {entry.worker_id} failed: {cause}")

    def _added(self, r: RouterRequest, entry: WorkerState, worker_rid: str) -> None:
        """``r`` is on ``entry`` now (or, superseded or ended meanwhile, its copy there is stopped)."""
        router = self.router
        router.table.dispatch_ok(entry)
        if r.worker_rid != worker_rid or r.finished:
            # Superseded, or ended (the client left), while the call was in flight: this copy
            # landed and holds blocks on the worker, so stop it before releasing its promise.
            router.spawn(self._abort_landed(entry, worker_rid))
            return
        self.adding.discard(worker_rid)
        r.target = None
        r.worker_id = entry.worker_id
        if r.owner_key:
            router.owned.placed(r)
        if entry.state != WORKER_UP:  # it died while the call was in flight
            self.replay(r, entry.worker_id)

    async def _abort_landed(self, entry: WorkerState, worker_rid: str) -> None:
        """Abort a dispatch nobody reads any more whose ``add_request`` returned; its promised
        blocks stay counted (placement, status) until the worker confirms, so the cluster never
        looks idle while the copy still runs."""
        try:
            await self.router.table.bounded(entry, entry.handle.abort.remote(worker_rid))
        except Exception:  # noqa: BLE001 - stalled or dead: the link's abort (or the process's end) stops it
            self.router.link.abort(entry.worker_id, worker_rid)
        finally:
            self._release(entry, worker_rid)

    def _release(self, entry: WorkerState, worker_rid: str) -> None:
        """The dispatch's call resolved and no copy of it runs on ``entry``: its promise goes."""
        self.adding.discard(worker_rid)
        entry.released(worker_rid)

    def replay_all(self, entry: WorkerState) -> None:
        """``entry`` went down: continue each of its requests elsewhere (those being added there too, as
        their adds fail: ``_not_added``)."""
        self.link_adds.lost(entry.worker_id)
        for r in [r for r in self.router.requests.values() if r.worker_id == entry.worker_id]:
            self.replay(r, entry.worker_id)

    def replay(self, r: RouterRequest, dead_worker_id: str) -> None:
        """Continue ``r`` (its worker died) on a healthy worker after the tokens already streamed (the
        worker fast-forwards text state and the seeded RNG), or end it UNAVAILABLE beyond
        ``migration_limit`` replays."""
        router = self.router
        if r.finished:
            return
        # NOTE: if the worker only lost its link (same process), the abort stops the old dispatch
        # when it reconnects; a new incarnation never gets it.
        router.lifecycle.stop_on(r, dead_worker_id)
        if r.cancelled:
            router.lifecycle.finish(r)
            return
        limit = router.config.migration_limit
        if r.replays >= limit:
            router.lifecycle.fail(r, grpc.StatusCode.UNAVAILABLE, f"worker {dead_worker_id} died; request "
                                  f"{r.request_id} was already replayed {r.replays} times (migration limit {limit})")
            return
        r.replays += 1
        r.migrations += 1
        router.replays_total += 1
        router.metrics.replayed()
        # NOTE: an owned request's tokens are its owner's: the router knows their count only (its progress)
        done = max(len(r.output_ids), r.tokens_received)
        logger.info("replaying %s after %d tokens (worker %s died)", r.request_id, done, dead_worker_id)
        router.lifecycle.hand_off(r, f"worker {dead_worker_id} died and no worker can take over")
