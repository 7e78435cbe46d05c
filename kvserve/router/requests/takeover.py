"""Moving an owned request to another frontend: its client resumes there after its frontend died
(docs/architecture.md section 2a, "Resuming through another frontend").

Contract:

* ``grant``: the owning frontend sent a ``ResumeGrant`` (a 128-bit token it gave its client) with the
  request; the router binds it to the request, the stream's tenant and the end client it names.
* ``take_over``: another frontend (the frontend credential is checked by the caller) asks to own the request
  for its client. It is moved only if the token, the client's request id, the tenant and the end client all
  match a live, placed request not waiting for a replay; otherwise the asker gets one NOT_FOUND (the same
  answer whatever did not match: a caller learns nothing about other requests) and nothing changes. A match
  re-binds the request to the new owner at once (so a later cancel or grace of the old owner cannot end it)
  and sends its worker a ``Reown`` on the WorkerLink; the new owner hears ``placed`` on that command's
  ack, or NOT_FOUND if the worker no longer has it.
* ``finished_unread``: a request that finishes while its owner's router stream is gone (kept, section 2a)
  may not have reached its client; its grant stays valid for ``grace_s`` (the worker keeps the finished
  output as long: ``orphan_timeout_s``), so its client can still fetch the tail. One take-over uses it up.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import grpc

from kvserve.protos.kvserve.v1 import serving_pb2 as spb
from kvserve.protos.kvserve.v1 import worker_pb2 as pb
from kvserve.router.requests.mux import StreamMux
from kvserve.router.requests.request import RouterError, RouterRequest

logger = logging.getLogger(__name__)

NOT_RESUMABLE = "no resumable stream with that request_id and token for this caller"


@dataclass(frozen=True)
class ResumeGrant:
    """What a resume must match: the token, the client's own request id, the tenant, the end client."""

    token: str
    request_id: str
    tenant: str
    client: str

    def matches(self, token: str, request_id: str, tenant: str, client: str) -> bool:
        # NOTE: compare_digest: no timing signal about how much of a guessed token was right
        same = secrets.compare_digest(self.token.encode(), token.encode())
        return same and (self.request_id, self.tenant, self.client) == (request_id, tenant, client)


@dataclass(frozen=True)
class _Finished:
    grant: ResumeGrant
    worker_id: str
    worker_rid: str
    expires: float


class Owners(Protocol):
    """What ``TakeOvers`` uses of ``kvserve/router/requests/owned.py`` ``OwnedRequests``."""

    by_key: dict[str, RouterRequest]

    def movable(self, r: RouterRequest) -> bool: ...

    def move(self, r: RouterRequest, address: str, key: str, mux: StreamMux) -> None: ...


class TakeOvers:
    """Resume grants by token, the finished-unread ones, and the ``Reown`` commands awaiting their ack."""

    def __init__(self, owners: Owners, send: Callable[[str, pb.RouterCommand], int], grace_s: float) -> None:
        """``send``: queue a command on a worker's WorkerLink, returning its seq (``WorkerLinkService.send``)."""
        self.owners, self.send, self.grace_s = owners, send, grace_s
        self._live: dict[str, str] = {}  # token -> the owner key its request has now
        self._finished: OrderedDict[str, _Finished] = OrderedDict()  # in expiry order (one grace for all)
        self._pending: dict[tuple[str, int], tuple[str, StreamMux]] = {}  # (worker, command seq) -> (key, asker)
        self.moved = 0  # take-overs done (tests, logs)
        self.refused = 0

    def grant(self, r: RouterRequest, grant: ResumeGrant) -> None:
        """``r`` (owned) may be resumed with ``grant``."""
        if not grant.token:
            return
        r.resume = grant
        self._live[grant.token] = r.owner_key

    def forget(self, r: RouterRequest) -> None:
        """``r`` ended: its grant no longer names a live request."""
        g = r.resume
        if g is not None and self._live.get(g.token) == r.owner_key:
            del self._live[g.token]

    def finished_unread(self, r: RouterRequest, now: float) -> None:
        """``r`` finished while its owner is gone: keep its grant for ``grace_s``."""
        g = r.resume
        if g is None or r.worker_id is None:
            return
        self._prune(now)
        self._finished[g.token] = _Finished(g, r.worker_id, r.worker_rid, now + self.grace_s)

    def take_over(self, msg: spb.TakeOver, tenant: str, client: str, mux: StreamMux) -> None:
        """A frontend's ``TakeOver`` on ``mux`` for a caller of ``tenant`` at ``client``; answered on ``mux``
        under ``msg.owner.key`` (``placed`` after the worker's ack, or an error)."""
        key, address = msg.owner.key, msg.owner.address
        if not key or not address:
            mux.put(key, RouterError(grpc.StatusCode.INVALID_ARGUMENT, "take_over needs owner.address and owner.key"))
            return
        now = time.monotonic()
        self._prune(now)
        old = self._live.get(msg.token)
        r = self.owners.by_key.get(old) if old is not None else None
        if r is not None and not r.finished and r.resume is not None:
            if not r.resume.matches(msg.token, msg.request_id, tenant, client):
                return self._refuse(key, mux, "no match")
            if not self.owners.movable(r):
                # NOTE: between workers (a replay waits for its owner's Resume, or it is not placed yet): its
                # client retries; refusing leaves every piece of it as it was
                mux.put(key, RouterError(grpc.StatusCode.UNAVAILABLE, "the request is moving between workers; retry"))
                return
            assert r.worker_id is not None
            self.owners.move(r, address, key, mux)
            self._live[msg.token] = key
            worker_id, worker_rid = r.worker_id, r.worker_rid
        else:
            f = self._finished.get(msg.token)
            if f is None or not f.grant.matches(msg.token, msg.request_id, tenant, client):
                return self._refuse(key, mux, "unknown token" if f is None else "no match")
            del self._finished[msg.token]  # NOTE: one take-over: its output is resent once
            worker_id, worker_rid = f.worker_id, f.worker_rid
        reown = pb.Reown(request_id=worker_rid, owner=spb.Owner(address=address, key=key))
        seq = self.send(worker_id, pb.RouterCommand(reown=reown))
        self._pending[(worker_id, seq)] = (key, mux)
        self.moved += 1
        logger.info("request %s: taken over by %s (worker %s)", msg.request_id, address, worker_id)

    def on_ack(self, worker_id: str, ack: pb.CommandAck) -> None:
        """A worker's ack: a ``Reown``'s tells its asker the request streams to it now, or that it is gone."""
        pending = self._pending.pop((worker_id, ack.command_seq), None)
        if pending is None:
            return
        key, mux = pending
        if ack.ok:
            mux.placed(key)
            return
        r = self.owners.by_key.get(key)
        if r is not None and not r.finished:
            # NOTE: not on that worker though the router has it live: a live migration's export took it off the
            # engine meanwhile; once it lands, a retry reaches its new worker
            mux.put(key, RouterError(grpc.StatusCode.UNAVAILABLE, "the request is moving between workers; retry"))
        else:
            mux.put(key, RouterError(grpc.StatusCode.NOT_FOUND, f"{NOT_RESUMABLE} (it ended on its worker)"))

    def _refuse(self, key: str, mux: StreamMux, why: str) -> None:
        self.refused += 1
        logger.warning("a take-over refused (%s)", why)  # NOTE: never the token: logs are not secret
        mux.put(key, RouterError(grpc.StatusCode.NOT_FOUND, NOT_RESUMABLE))

    def _prune(self, now: float) -> None:
        while self._finished:
            token, f = next(iter(self._finished.items()))
            if f.expires > now:
                return
            del self._finished[token]


def grant_of(msg: Any, tenant: str, client: str) -> ResumeGrant | None:
    """The ``ResumeGrant`` a ``GenerateStreamRequest`` carries (None: none)."""
    if not msg.HasField("resumable") or not msg.resumable.token:
        return None
    return ResumeGrant(msg.resumable.token, msg.resumable.request_id, tenant, client)
