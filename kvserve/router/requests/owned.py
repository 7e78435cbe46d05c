"""The router's side of owned requests (docs/architecture.md section 2a): requests whose outputs go from
their worker straight to the frontend that owns them.

The router keeps every decision about an owned request and none of its tokens:

* ``own``: a request a frontend relayed with ``Owner{address, key}`` (only on a frontend-credentialed
  stream: kvserve/router/api/server.py) is known by its key; the latest stream of each owner address is
  where notices go (``announce``);
* ``placed``: once its worker took it, the owner hears ``GenerateBatch.placed`` (a request not yet placed
  when the router dies ends at the frontend; a placed one outlives the router);
* ``on_progress``: the worker's progress (``RequestOutput.owned``: counts, never tokens) marks it started,
  keeps its counts, observes TTFT / E2E / tokens and ends it on its finish, with no response (its owner
  built every one);
* ``ask_resume`` / ``resume``: to continue it elsewhere (its worker died, a drain's hand-off) the router
  needs the tokens its client has, which only the owner knows: ``GenerateBatch.replays = [key]``, answered
  by ``Resume(key, output_ids)``; none within ``RESUME_TIMEOUT_S`` ends it UNAVAILABLE;
* ``stream_ended``: a frontend's stream that breaks while this router lives (a network blip, a proxy's
  idle cut) cancels none of its placed requests: they are kept for their owner (``OwnerSlot``, as adopted
  ones) for ``OWNER_GRACE_S``; the frontend re-opens its stream at once and announces itself, which keeps
  them; only a grace that ends with no announce of that owner cancels them (the owner is gone);
* ``adopt``: a restarted router takes over the owned requests a worker still runs (its ``RequestTable``,
  sent after every connect), so their streams outlive the router that placed them;
* ``move`` (for ``kvserve/router/requests/takeover.py``): a client whose frontend died resumes through
  another, which becomes the request's owner; a request taken over counts as its new owner's when that
  owner's stream ends (kept for the grace again).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from typing import Any, Protocol

import grpc

from kvserve.protos.kvserve.v1 import worker_pb2 as pb
from kvserve.router.gate.validation import ValidationError, sampling_params
from kvserve.router.requests.exported import ExportedCopies
from kvserve.router.requests.mux import MuxSlot, StreamMux
from kvserve.router.requests.request import RouterError, RouterRequest
from kvserve.router.requests.takeover import ResumeGrant, TakeOvers
from kvserve.workers.core.block_hash import cache_extra, hash_blocks
from kvserve.workers.core.sizes import blocks_for

logger = logging.getLogger(__name__)

RESUME_TIMEOUT_S = 10.0  # NOTE: a frontend re-opens its stream within ~2 s of a break (kvserve/frontend/link.py)
# NOTE: the workers' ``orphan_timeout_s`` default (kvserve/workers/transport/options.py): a worker keeps an owned
# request this long without its owner's data link, so the router keeps one this long without its owner's router
# stream; a frontend re-opens that stream at once (backoff at most 2 s: kvserve/frontend/link.py), so 10 s is
# five re-open attempts on a loaded box while bounding what a frontend gone for good holds.
OWNER_GRACE_S = 10.0


class OwnedPipeline(Protocol):
    """What ``OwnedRequests`` uses of the router (kvserve/router/requests/router.py)."""

    requests: dict[str, RouterRequest]
    dispatcher: Any
    lifecycle: Any
    table: Any
    metrics: Any
    queue: Any
    limits: Any
    block_size: int
    model_id: str
    mover: Any

    def spawn(self, coro: Any) -> None: ...


def stream_mux(r: RouterRequest) -> StreamMux | None:
    """The stream ``r`` arrived on (None: its own stream, or none: adopted)."""
    return r.responses.mux if isinstance(r.responses, MuxSlot) else None


class OwnerSlot:
    """An adopted request's ``responses`` (the subset of ``asyncio.Queue`` the router uses, as ``MuxSlot``).

    It came on no stream of this router, so what the router puts for it (only ever its final error: an
    owned request gets no responses) goes to its owner's latest stream at put time, under its owner key: the
    id its frontend sent it by (``RelayedRequest.wire_id``). NOTE: not its scoped id: that stream may be one
    of its frontend's other caller credentials, whose tenant scope would not unscope it (a key has no scope)."""

    def __init__(self, owners: dict[str, StreamMux], address: str, owner_key: str) -> None:
        self.owners, self.address, self.owner_key = owners, address, owner_key

    def put_nowait(self, item: Any) -> None:
        mux = self.owners.get(self.address)
        if mux is not None:  # NOTE: none: its owner has no stream here; its worker ends it when the owner is gone
            mux.put(self.owner_key, item)

    def qsize(self) -> int:
        return 0

    def empty(self) -> bool:
        return True

    def get_nowait(self) -> None:
        """Nothing is buffered here (the slow-consumer path never applies: progress puts nothing)."""


class OwnedRequests:
    """Every owned request of this router, by owner key, and the latest stream of each owner."""

    def __init__(self, router: OwnedPipeline, resume_timeout_s: float = RESUME_TIMEOUT_S,
                 owner_grace_s: float = OWNER_GRACE_S) -> None:  # fmt: skip
        self.router = router
        self.resume_timeout_s = resume_timeout_s
        self.owner_grace_s = owner_grace_s
        self._placed: set[str] = set()  # keys whose owner was told ``placed`` (only those outlive its stream)
        # owner address -> (the keys kept since its stream ended, the grace's timer); an announce ends it
        self._kept: dict[str, tuple[set[str], asyncio.TimerHandle | None]] = {}
        self.by_key: dict[str, RouterRequest] = {}
        self.owners: dict[str, StreamMux] = {}  # owner address -> the latest stream that named it
        self._waiting: dict[str, tuple[str, asyncio.TimerHandle | None]] = {}  # key -> (why, its timeout)
        self._unsent: dict[str, list[str]] = {}  # owner address -> replay notices no stream took yet
        # NOTE: router.link at call time: the router builds its WorkerLink service after this object
        self.takeovers = TakeOvers(self, lambda worker_id, cmd: router.link.send(worker_id, cmd), owner_grace_s)
        self.exported = ExportedCopies(self._finish_export, self._adopt_settled)

    # ---- the owner's stream -------------------------------------------------------------------------
    def own(self, r: RouterRequest, address: str, key: str) -> None:
        """``r`` (not yet placed) is owned by the frontend at ``address`` under ``key``."""
        r.owner, r.owner_key = address, key
        self.by_key[key] = r
        mux = stream_mux(r)
        if mux is not None:
            self.announce(address, mux)

    def announce(self, address: str, mux: StreamMux) -> None:
        """``mux`` is the owner's latest stream: notices go there (those no stream took yet, at once)."""
        self.owners[address] = mux
        kept = self._kept.pop(address, None)
        if kept is not None:
            if kept[1] is not None:
                kept[1].cancel()
            logger.info("owner %s is back: its %d kept requests continue", address, len(kept[0]))
        for key in self._unsent.pop(address, ()):
            mux.replay(key)

    def forget_stream(self, mux: StreamMux) -> None:
        """``mux`` ended: it takes no notices any more."""
        for address in [a for a, m in self.owners.items() if m is mux]:
            del self.owners[address]

    def stream_ended(self, mux: StreamMux, live: Iterable[RouterRequest]) -> list[RouterRequest]:
        """``mux`` ended (closed, cancelled, broken) while this router lives; ``live``: the requests that came on
        it. Its owned requests whose owner was told ``placed`` are kept for their owner (their outputs never
        crossed ``mux``: the worker streams them to the owner, which re-opens its stream and announces itself
        within ``owner_grace_s``); returns the others, which the caller cancels (nobody keeps them: the frontend
        ends a request not placed UNAVAILABLE itself, and its client retries it).

        NOTE: a client's own cancel comes as ``cancel_request_id`` on the owner's next stream, or as an abort
        on the worker's data link (``kvserve/frontend/link.py`` ``send_cancel``), so keeping one never outlives
        its client's wish; a grace that ends with no announce cancels every request still kept."""
        # NOTE: requests taken over by this stream's owner (takeover.py) came on no stream: kept like its own
        moved = [r for r in self.by_key.values()
                 if r.resume is not None and stream_mux(r) is None and self.owners.get(r.owner) is mux]  # fmt: skip
        self.forget_stream(mux)
        others: list[RouterRequest] = []
        for r in [*(r for r in live if not r.owner_key or stream_mux(r) is mux), *moved]:
            # NOTE: a request of ``live`` whose stream is not ``mux`` was taken over by another frontend since
            if r.finished:
                continue
            if not (r.owner_key and r.owner_key in self._placed and self.by_key.get(r.owner_key) is r):
                others.append(r)
                continue
            # NOTE: from now on its error (its only possible response) goes to its owner's latest stream
            r.responses = OwnerSlot(self.owners, r.owner, r.owner_key)
            keys, timer = self._kept.get(r.owner, (set(), None))
            if timer is None:
                try:
                    timer = asyncio.get_running_loop().call_later(self.owner_grace_s, self._grace_over, r.owner)
                except RuntimeError:  # NOTE: no loop (a unit test driving the router by hand): no timeout
                    pass
            keys.add(r.owner_key)
            self._kept[r.owner] = (keys, timer)
        kept = sum(len(k) for k, _ in self._kept.values())
        if kept:
            logger.info("a frontend's router stream ended: %d placed requests kept for %.0fs for their owner",
                        kept, self.owner_grace_s)  # fmt: skip
        return others

    def _grace_over(self, address: str) -> None:
        """The owner at ``address`` did not come back within ``owner_grace_s``: cancel what was kept for it."""
        keys, _ = self._kept.pop(address, (set(), None))
        cancelled = 0
        for key in keys:
            r = self.by_key.get(key)
            if r is not None and not r.finished:
                self.router.lifecycle.cancel(r)
                cancelled += 1
        if cancelled:
            logger.warning("owner %s did not re-open its router stream within %.0fs: %d kept requests cancelled",
                           address, self.owner_grace_s, cancelled)  # fmt: skip

    def cancel(self, key: str, mux: StreamMux) -> bool:
        """A frontend's cancel, on ``mux``, of its request ``key`` that came on no stream of it (adopted): True if
        one ended. Only the owner whose latest stream ``mux`` is may cancel (never another frontend's)."""
        r = self.by_key.get(key)
        if r is None or r.finished or self.owners.get(r.owner) is not mux:
            return False
        self.router.lifecycle.cancel(r)
        mux.put(r.owner_key, RouterError(grpc.StatusCode.CANCELLED, "cancelled by the client"))  # NOTE: as OwnerSlot
        return True

    def placed(self, r: RouterRequest) -> None:
        """``r``'s worker took it: its owner may keep it past this router's death."""
        self._placed.add(r.owner_key)
        mux = stream_mux(r) or self.owners.get(r.owner)
        if mux is not None:
            mux.placed(r.owner_key)

    def forget(self, r: RouterRequest) -> None:
        """``r`` ended."""
        self.takeovers.forget(r)
        if self.by_key.get(r.owner_key) is r:
            del self.by_key[r.owner_key]
            self._placed.discard(r.owner_key)
        kept = self._kept.get(r.owner)
        if kept is not None:
            kept[0].discard(r.owner_key)
        waiting = self._waiting.pop(r.owner_key, None)
        if waiting is not None and waiting[1] is not None:
            waiting[1].cancel()
        unsent = self._unsent.get(r.owner)
        if unsent is not None and r.owner_key in unsent:  # NOTE: an ended request's notice would ask for nothing
            unsent.remove(r.owner_key)
            if not unsent:
                del self._unsent[r.owner]
        mux = stream_mux(r)
        if mux is not None:
            mux.ended(r.request_id)

    # ---- a take-over (kvserve/router/requests/takeover.py) ----------------------------------------------
    def owner_gone(self, r: RouterRequest) -> bool:
        """``r``'s owner's router stream ended and it has not come back (``r`` is kept for it)."""
        kept = self._kept.get(r.owner)
        return kept is not None and r.owner_key in kept[0]

    def movable(self, r: RouterRequest) -> bool:
        """``r`` runs on one worker (placed, not migrating), no replay waiting for its owner's ``Resume``."""
        key = r.owner_key
        one_worker = r.worker_id is not None and not r.target and len(r.dispatch_workers) <= 1
        return one_worker and key in self._placed and key not in self._waiting

    def move(self, r: RouterRequest, address: str, key: str, mux: StreamMux) -> None:
        """``r`` is owned by the frontend at ``address`` under ``key`` from now on, and ``mux`` is its stream
        (its error goes there, under ``key``); nothing of its old owner can end it any more (its cancel, its
        grace, its stream's end)."""
        old_mux = stream_mux(r)
        if old_mux is not None:
            old_mux.ended(r.request_id)  # NOTE: off its old stream's live requests: that stream's end keeps it not
        old = r.owner_key
        self.by_key.pop(old, None)
        self._placed.discard(old)
        kept = self._kept.get(r.owner)
        if kept is not None:
            kept[0].discard(old)
        r.owner, r.owner_key = address, key
        r.responses = OwnerSlot(self.owners, address, key)
        self.by_key[key] = r
        self._placed.add(key)
        self.announce(address, mux)

    # ---- progress -----------------------------------------------------------------------------------
    def on_progress(self, worker_id: str, out: pb.RequestOutput, r: RouterRequest, now: float) -> None:
        """A progress report of ``r``'s current dispatch from ``worker_id`` (a worker it runs on)."""
        router = self.router
        entry = router.table.get(worker_id)
        if entry is not None and r.worker_rid in entry.in_flight:
            entry.started.add(r.worker_rid)
        total = out.num_output_tokens
        new = max(total - r.tokens_received, 0)
        ttft = None
        if r.first_token_time is None and total > 0:
            r.first_token_time = now
            ttft = now - r.arrival
        if new:
            r.last_token_time = now
            r.tokens_received = total
        r.preemptions = max(r.preemptions, out.num_preemptions)
        r.swaps = max(r.swaps, out.num_swaps)
        finish = out.finish_reason
        router.metrics.streamed(ttft, None, new, now - r.arrival if finish else None)
        if not finish:
            return
        if self.owner_gone(r) and finish in ("length", "stop"):
            self.takeovers.finished_unread(r, now)  # NOTE: its tail may never have reached its client
        if r.started_at is not None and finish in ("length", "stop"):
            held = blocks_for(len(r.prompt_ids) + r.tokens_received, router.block_size)
            router.queue.service.observe(now - r.started_at, r.tokens_received, held, stopped=finish == "stop")
        router.lifecycle.finish(r)

    # ---- continuing elsewhere -----------------------------------------------------------------------
    def ask_resume(self, r: RouterRequest, why: str) -> None:
        """``r`` must continue elsewhere: ask its owner for the tokens its client has (``resume``)."""
        key = r.owner_key
        mux = stream_mux(r) or self.owners.get(r.owner)
        if mux is not None:
            mux.replay(key)
        else:
            self._unsent.setdefault(r.owner, []).append(key)
        timer = None
        try:
            timer = asyncio.get_running_loop().call_later(self.resume_timeout_s, self._expired, key)
        except RuntimeError:  # NOTE: no loop (a unit test driving the router by hand): no timeout
            pass
        self._waiting[key] = (why, timer)
        logger.info("%s: asked its owner %s for its client's tokens (%s)", r.request_id, r.owner, why)

    def resume(self, key: str, output_ids: list[int], mux: StreamMux | None = None) -> bool:
        """The owner's answer: continue the request after ``output_ids``; False if nothing waits for it.

        ``mux``: the stream the answer came on; it counts only if it is the request's own stream or its owner's
        latest one (another frontend's stream may not steer it). None: the caller vouches for it."""
        r = self.by_key.get(key)
        if r is None or r.finished or key not in self._waiting:
            return False
        if mux is not None and mux is not stream_mux(r) and mux is not self.owners.get(r.owner):
            logger.warning("%s: a Resume on a stream not its owner's (%s): ignored", r.request_id, r.owner)
            return False
        waiting = self._waiting.pop(key)
        why, timer = waiting
        if timer is not None:
            timer.cancel()
        r.output_ids = list(output_ids)
        r.tokens_received = len(output_ids)
        r.held.clear()
        self.router.lifecycle.continue_elsewhere(r, why)
        return True

    def _expired(self, key: str) -> None:
        waiting = self._waiting.pop(key, None)
        r = self.by_key.get(key)
        if waiting is not None and r is not None and not r.finished:
            self.router.lifecycle.fail(r, grpc.StatusCode.UNAVAILABLE,
                                       f"{waiting[0]}; its frontend did not answer the replay in time")  # fmt: skip

    # ---- a restarted router -------------------------------------------------------------------------
    def adopt(self, worker_id: str, table: pb.RequestTable) -> int:
        """Take over the owned requests ``worker_id`` runs that this router does not know; returns how many.
        A copy paused by a migration a previous router left unfinished is settled (``ExportedCopies``)."""
        router = self.router
        if router.table.get(worker_id) is None or router.limits is None:
            return 0
        adopted = 0
        for o in table.requests:
            known = router.dispatcher.current(o.request_id)
            if o.exporting:
                if worker_id not in router.mover.busy:  # NOTE: busy: this router's own migration ends it
                    elsewhere = known is not None and known.worker_id != worker_id
                    if known is None or elsewhere:
                        self.exported.paused(worker_id, o, running_elsewhere=elsewhere)
                continue
            if known is not None or not o.owner_key or o.owner_key in self.by_key:
                continue
            if self._adopt_one(worker_id, o):
                adopted += 1
                self.exported.running(worker_id, o.request_id)
        if adopted:
            logger.info("adopted %d owned requests from worker %s (a router restart)", adopted, worker_id)
        return adopted

    def _adopt_one(self, worker_id: str, o: pb.OwnedRequest) -> bool:
        """Take over ``o``, which ``worker_id`` runs; False if it cannot be (unknown worker, bad entry, id in use)."""
        router = self.router
        entry = router.table.get(worker_id)
        if entry is None or router.limits is None:
            return False
        ids = list(o.prompt_ids)
        try:
            params = sampling_params(o.sampling, len(ids), router.limits)
        except ValidationError as e:  # NOTE: a worker's table is trusted input, but never crash the loop
            logger.warning("worker %s: owned request %s not adopted: %s", worker_id, o.request_id, e)
            return False
        rid = o.request_id.rpartition("#")[0] or o.request_id
        if rid in router.requests:
            return False
        salt = o.cache_salt or None
        r = RouterRequest(rid, ids, params, o.priority, o.cache_salt,
                          tuple(hash_blocks(ids, router.block_size, cache_extra(router.model_id, salt))),
                          blocks_for(len(ids), router.block_size))  # fmt: skip
        r.owner, r.owner_key = o.owner, o.owner_key
        r.responses = OwnerSlot(self.owners, o.owner, o.owner_key)
        r.worker_id, r.worker_rid, r.dispatch_workers = worker_id, o.request_id, {worker_id}
        r.tokens_received = o.num_output_tokens
        r.started_at = r.first_token_time = time.monotonic()
        router.requests[rid] = r
        router.dispatcher.by_worker_rid[o.request_id] = r
        # NOTE: counted on its worker as a dispatch there that already started, promising nothing: the
        # worker's reports already count its blocks (the next one drops the entry, as for any start).
        entry.placed(o.request_id, 0)
        entry.started.add(o.request_id)
        self.by_key[o.owner_key] = r
        self._placed.add(o.owner_key)
        if o.resume_token:  # NOTE: its client may still resume it through another frontend
            self.takeovers.grant(r, ResumeGrant(o.resume_token, o.resume_request_id, o.resume_tenant,
                                                o.resume_client))  # fmt: skip
        return True

    def _adopt_settled(self, worker_id: str, o: pb.OwnedRequest) -> bool:
        """A paused copy no running one replaced: adopt it, unless its request is known here by now."""
        if self.router.dispatcher.current(o.request_id) is not None or o.owner_key in self.by_key:
            return False
        return self._adopt_one(worker_id, o)

    def _finish_export(self, worker_id: str, rid: str, migrated: bool) -> None:
        """Free (``migrated``) or resume a paused copy on ``worker_id`` (an ``ExportedCopies`` decision)."""
        entry = self.router.table.get(worker_id)
        if entry is not None:
            self.router.spawn(self.router.mover.finish_export(entry, entry.incarnation, rid, migrated))
