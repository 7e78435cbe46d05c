"""Graceful drain of one worker (``kvserve drain``, ``kvserve rollout``, SIGTERM to a worker):
its requests move away without a failure, then its process restarts and it is taken back.

A drain, as ``Drainer.start`` runs it:

1. **out of placement at once**: ``WorkerState.drain`` is set, so ``WorkerTable.serving`` is False
   (no new request, no migration or preemption lands there); status shows it *draining*.
2. **moving** (bounded by the drain's deadline): each request on it that has streamed a token is
   migrated live (``Mover.migrate``: its KV copied, token-identical); one that has not (nothing to
   copy yet), one whose add_request is still in flight, one whose migration failed twice, every
   one left at the deadline, and all of them with ``--no-migration``, is *handed off*: aborted
   there and re-placed (or queued first in line) with the tokens already streamed, as a failover
   replay does, token-identical too, but not counted as a replay (no worker failed).
3. **restarting**: the worker is marked down (so neither the liveness rule nor a probe kills it
   again) and its actor killed with restarts allowed; Ray starts a fresh process.
4. **done** when the fresh process's Hello arrives (``WorkerTable.hello``: up again, empty pool;
   the restart is not counted toward crash-loop retirement), or **failed** if it is not back
   within ``drain_restart_timeout_s`` (the worker then rejoins whenever it says Hello).

Refused (``RouterError``): an unknown worker (NOT_FOUND), a worker down or retired, or the last
serving worker (FAILED_PRECONDITION: nothing could take its requests; a cluster of one worker is
restarted with ``kvserve serve`` instead). Asking to drain a worker already draining follows
that drain. Progress goes to every follower as ``DrainProgress`` messages.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from kvserve.protos.kvserve.v1 import serving_pb2 as spb
from kvserve.router.requests.pipeline import RequestPipeline
from kvserve.router.requests.request import WORKER_RETIRED, WORKER_UP, RouterError, RouterRequest
from kvserve.router.table.workers import DrainMark, WorkerState

logger = logging.getLogger(__name__)

MOVING, RESTARTING, DONE, FAILED = "moving", "restarting", "done", "failed"
MIGRATION_TRIES = 2  # live migrations tried per request before it is handed off instead
POLL_S = 0.05  # how often the moving phase looks again (pure table reads)


@dataclass
class Drain:
    """One drain in progress and what its followers have been told."""

    worker_id: str
    deadline_s: float
    reason: str
    started: float = field(default_factory=time.monotonic)
    progress: spb.DrainProgress = field(default_factory=spb.DrainProgress)
    followers: list[asyncio.Queue[spb.DrainProgress]] = field(default_factory=list)
    done: asyncio.Event = field(default_factory=asyncio.Event)

    def publish(self, **fields: object) -> None:
        """Update the progress and tell the followers, if anything but the elapsed time changed."""
        before = self.progress.SerializeToString()
        for name, value in fields.items():
            setattr(self.progress, name, value)
        if self.progress.SerializeToString() == before:
            return
        self.progress.elapsed_s = time.monotonic() - self.started
        for q in self.followers:
            q.put_nowait(spb.DrainProgress.FromString(self.progress.SerializeToString()))


class Drainer:
    """The drains of one router (see the module docstring)."""

    def __init__(self, router: RequestPipeline) -> None:
        self.router = router
        self.drains: dict[str, Drain] = {}

    def start(self, worker_id: str, deadline_s: float | None = None, reason: str = "admin") -> Drain:
        """Begin draining ``worker_id`` (or return the drain already running there).

        Raises:
            RouterError: NOT_FOUND (no such worker) or FAILED_PRECONDITION (down, retired, or the
                last serving worker).
        """
        running = self.drains.get(worker_id)
        if running is not None:
            return running
        table = self.router.table
        entry = table.get(worker_id)
        if entry is None:
            raise RouterError(grpc.StatusCode.NOT_FOUND, f"no worker {worker_id!r} (workers: {sorted(table.entries)})")
        if entry.state == WORKER_RETIRED:
            raise RouterError(grpc.StatusCode.FAILED_PRECONDITION,
                              f"worker {worker_id} is retired (crash loop); restart serve to get it back")  # fmt: skip
        if entry.state != WORKER_UP:
            raise RouterError(grpc.StatusCode.FAILED_PRECONDITION,
                              f"worker {worker_id} is down (it restarts by itself); nothing to drain")  # fmt: skip
        if not any(table.serving(e) for e in table.entries.values() if e is not entry):
            raise RouterError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"worker {worker_id} is the last serving worker: no other could take its requests "
                "(drain refused; wait for the others to be back, or restart serve)",
            )
        deadline_s = self.router.config.drain_deadline_s if not deadline_s or deadline_s <= 0 else deadline_s
        drain = self.drains[worker_id] = Drain(worker_id, deadline_s, reason)
        entry.drain = DrainMark()
        table.metrics.worker_up(worker_id, False)
        drain.progress.worker_id, drain.progress.reason, drain.progress.phase = worker_id, reason, MOVING
        drain.progress.old_incarnation = entry.incarnation
        drain.progress.requests_left = len(self._on_worker(worker_id))
        logger.warning("draining worker %s (%s, deadline %.1fs)", worker_id, reason, deadline_s)
        self.router.spawn(self._run(drain, entry))
        return drain

    async def follow(self, drain: Drain) -> AsyncIterator[spb.DrainProgress]:
        """The drain's progress from now on, ending with its "done" or "failed" message."""
        q: asyncio.Queue[spb.DrainProgress] = asyncio.Queue()
        q.put_nowait(spb.DrainProgress.FromString(drain.progress.SerializeToString()))
        drain.followers.append(q)
        try:
            while True:
                msg = await q.get()
                yield msg
                if msg.phase in (DONE, FAILED):
                    return
        finally:
            drain.followers.remove(q)

    # ---- the drain ---------------------------------------------------------------------------------
    async def _run(self, drain: Drain, entry: WorkerState) -> None:
        try:
            outcome = await self._drain(drain, entry)
        except Exception as e:  # noqa: BLE001 - a bug must not leave the worker out of placement
            logger.exception("drain of %s failed", drain.worker_id)
            outcome = f"internal error: {e!r}"
        finally:
            entry.drain = None
            self.drains.pop(drain.worker_id, None)
            drain.done.set()
        if outcome is None:
            logger.warning("worker %s drained and back in %.1fs (%d migrated, %d handed off)", drain.worker_id,
                           time.monotonic() - drain.started, drain.progress.requests_migrated,
                           drain.progress.requests_handed_off)  # fmt: skip
            drain.publish(phase=DONE, requests_left=0)
        else:
            logger.error("drain of %s failed: %s", drain.worker_id, outcome)
            drain.publish(phase=FAILED, reason=outcome)
        self.router.table.metrics.worker_up(entry.worker_id, self.router.table.serving(entry))
        self.router.pump()

    async def _drain(self, drain: Drain, entry: WorkerState) -> str | None:
        """Move, restart, wait for the fresh process; None on success, else why it failed."""
        mark = entry.drain
        assert mark is not None
        if not await self._move_all(drain, entry):
            return "the worker went down during the drain (it restarts by itself)"
        # Restart: down first, so that neither the liveness rule nor a probe kills the fresh
        # process again; its requests are all gone from it (a late one is replayed by ``down``).
        mark.killed_incarnation = entry.incarnation
        drain.publish(phase=RESTARTING, requests_left=0)
        self.router.table.down(entry, f"drained ({drain.reason}); restarting its process")
        try:
            import ray

            ray.kill(entry.handle, no_restart=False)
        except Exception as e:  # noqa: BLE001 - not a Ray actor (tests) or already gone
            logger.debug("killing drained worker %s: %r", entry.worker_id, e)
        try:
            await asyncio.wait_for(mark.back.wait(), self.router.config.drain_restart_timeout_s)
        except TimeoutError:
            return f"not back within {self.router.config.drain_restart_timeout_s:.0f}s of its restart"
        drain.progress.new_incarnation = mark.new_incarnation
        return None

    def _on_worker(self, worker_id: str) -> list[RouterRequest]:
        return [r for r in self.router.requests.values()
                if not r.finished and (r.worker_id == worker_id or r.target == worker_id)]  # fmt: skip

    async def _move_all(self, drain: Drain, entry: WorkerState) -> bool:
        """Move every request off ``entry`` (see the module docstring); False if it went down meanwhile."""
        wid = entry.worker_id
        deadline = drain.started + drain.deadline_s
        tries: dict[str, int] = {}
        drain.publish(phase=MOVING, requests_left=len(self._on_worker(wid)))
        while True:
            if entry.state != WORKER_UP:
                return False
            left = self._on_worker(wid)
            drain.publish(requests_left=len(left))
            if not left:
                return True
            past_deadline = time.monotonic() >= deadline
            for r in left:
                # NOTE: nothing streamed yet means no KV worth copying: re-placing it costs only
                # the prefill it may have begun.
                stuck = not self.router.config.enable_migration or tries.get(r.worker_rid, 0) >= MIGRATION_TRIES
                if past_deadline or r.target == wid or r.tokens_received == 0 or stuck:
                    self._hand_off(r, wid)
                    drain.publish(requests_handed_off=drain.progress.requests_handed_off + 1)
            if await self._migrate_one(entry, tries):
                drain.publish(requests_migrated=drain.progress.requests_migrated + 1)
            else:
                await asyncio.sleep(POLL_S)

    async def _migrate_one(self, entry: WorkerState, tries: dict[str, int]) -> bool:
        """Migrate one started request off ``entry`` to where placement would put it; True if moved."""
        router, wid = self.router, entry.worker_id
        for r in self._on_worker(wid):
            if r.worker_id != wid or r.tokens_received == 0:
                continue
            decision = router.decide(r)
            if decision is None or router.mover.busy & {wid, decision.worker_id}:
                continue  # no room now, or a move already runs there: next round
            tries[r.worker_rid] = tries.get(r.worker_rid, 0) + 1
            return await router.mover.migrate(r.request_id, decision.worker_id)
        return False

    def _hand_off(self, r: RouterRequest, worker_id: str) -> None:
        """Continue ``r`` elsewhere after the tokens already streamed (as a replay does, but no
        worker failed, so not counted as one): its dispatch on ``worker_id`` is aborted."""
        router = self.router
        router.lifecycle.stop_on(r, worker_id)
        r.target = None
        r.migrations += 1
        logger.info("drain: handing %s off after %d tokens (worker %s drains)", r.request_id,
                    len(r.output_ids), worker_id)  # fmt: skip
        router.lifecycle.hand_off(r, f"worker {worker_id} drains and no worker can take over")
