"""Carries out what kvserve/router/policy/rebalance.py plans: watermark migrations (two-phase, over Ray calls) and
priority preemptions (a Preempt command on the victim's worker, the newcomer dispatched at once).

Migration is ``export_for_migration`` on the source (it pauses the request at a step boundary and returns
the state's size and its ``MigrationState`` as two objects the router owns), ``import_request`` of that state's
reference on the destination (Ray moves the state there from the source's object store: the router never reads
the KV), then ``finish_export(ok)`` on the source (frees it, or resumes it if the import did not fit). A worker
takes part in one move at a time (``busy``).

The invariant (docs/architecture.md section 5): whatever fails, and wherever (either side dying
or hanging at any phase, the client cancelling mid-move), a move ends with exactly one live copy
of the request (or none, if it ended), no paused copy left holding blocks, and its stream
continuing. How: every call is bounded by its worker's stall threshold, and a call that times out
is a stall (``WorkerTable.give_up``: down, its requests replayed, killed); the request is
*committed* to the destination (``r.worker_id``) the moment the import succeeds, so from then on
a death of the source no longer replays it and a death of the destination does; a copy that must
not live is stopped: the source's paused copy by ``finish_export`` (resumed if the request still
lives there, freed otherwise), a destination copy nobody will read by an ``Abort`` on its link.
``fault`` is a test hook called at each phase boundary.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Awaitable, Callable, Iterator

from kvserve.protos.kvserve.v1 import worker_pb2 as pb
from kvserve.router.policy.rebalance import (
    Migration,
    RunningRequest,
    WaitingRequest,
    may_migrate_off,
    plan_migration,
    plan_preemption,
)
from kvserve.router.requests.pipeline import RequestPipeline
from kvserve.router.requests.request import WORKER_UP, RouterRequest
from kvserve.router.table.workers import WorkerState, actor_dead, object_lost
from kvserve.workers.core.sizes import blocks_for

logger = logging.getLogger(__name__)


class Mover:
    """Migrations and router preemptions of one router's requests."""

    def __init__(self, router: RequestPipeline) -> None:
        self.router = router
        self.busy: set[str] = set()  # workers in a migration now (source or destination)
        # Test hook: awaited at each phase boundary ("before_export", "before_import",
        # "after_import") with the request and the move; it may raise, hang, cancel or kill.
        self.fault: Callable[[str, RouterRequest, Migration], Awaitable[None]] | None = None

    def running(self) -> Iterator[RunningRequest]:
        """The requests on workers, as rebalancing sees them. NOTE: lazy: a pressure report (the hot
        path) builds none of them unless its worker is past the watermark (``plan_migration`` reads
        them last)."""
        limits = self.router.limits
        # NOTE: generation also stops at max_model_len, so that bounds the tokens still to come.
        max_len = limits.max_model_len if limits is not None else 0
        for r in list(self.router.requests.values()):
            if r.worker_id is None:
                continue
            remaining = max(min(r.params.max_tokens, max_len - len(r.prompt_ids)) - r.tokens_received, 0)
            tokens = len(r.prompt_ids) + r.tokens_received
            yield RunningRequest(r.request_id, r.worker_id, r.priority, r.arrival, tokens, r.tokens_received,
                                 preemptible=not r.router_preempted, remaining_tokens=remaining)  # fmt: skip

    def rebalance(self, src: WorkerState) -> None:
        """Start the migration off ``src`` that ``plan_migration`` decides, if any."""
        router = self.router
        if not router.config.enable_migration:
            return
        # NOTE: a report arrives per worker step and most find nothing to move: that is told from
        # the source's view alone, before every worker's view and the running requests are built.
        if not may_migrate_off(src.view(router.table.serving(src), router.table.ledger), router.watermarks, self.busy):
            return
        move = plan_migration(src.worker_id, router.table.views(), self.running(), router.watermarks,
                              frozenset(self.busy))  # fmt: skip
        if move is not None:
            self.busy.update((move.src, move.dst))
            router.spawn(self._migrate(router.requests[move.request_id], move))

    async def migrate(self, request_id: str, dst_worker_id: str) -> bool:
        """Operator/test entry point: move one running request to another worker (no watermark
        rule); False if the request, the worker or the pair is not eligible now."""
        router = self.router
        r = router.requests.get(request_id)
        if r is None or r.worker_id is None or router.table.get(dst_worker_id) is None or r.worker_id == dst_worker_id:
            return False
        if self.busy & {r.worker_id, dst_worker_id}:
            return False
        move = Migration(request_id, r.worker_id, dst_worker_id,
                         blocks_for(len(r.prompt_ids) + r.tokens_received, router.block_size))  # fmt: skip
        self.busy.update((move.src, move.dst))
        return await self._migrate(r, move)

    async def _migrate(self, r: RouterRequest, move: Migration) -> bool:
        """Export from ``move.src`` at a step boundary, import into ``move.dst``, then free the
        source's copy; resume on the source if the import did not happen. The caller has put both
        workers in ``busy``. Keeps the module's invariant on every path."""
        router = self.router
        src, dst = router.table[move.src], router.table[move.dst]
        rid, src_inc, dst_inc = r.worker_rid, src.incarnation, dst.incarnation
        exported = committed = False
        phase = "export"
        try:
            await self._fault("before_export", r, move)
            # NOTE: the state is never awaited here: its reference goes to the destination, which fetches the KV
            # from the source's object store. The router owns it (a return of its call: it outlives the source's
            # process) but never deserializes it; it did, on its loop, and imported torch for it (+180 MB RSS).
            num_ref, state_ref = src.handle.export_for_migration.options(num_returns=2).remote(rid)
            num_tokens = await self._call(src, src_inc, "export_for_migration", num_ref)
            if num_tokens is None:
                return False
            exported = True
            phase = "import"
            await self._fault("before_import", r, move)
            if not self._still_on(r, src.worker_id, rid):  # cancelled, finished or replayed meanwhile
                return False
            # NOTE: from the import on, the destination's outputs for this dispatch count (they may
            # arrive before this call returns); the source's keep counting (its last ones may too).
            r.dispatch_workers.add(dst.worker_id)
            try:
                ok = await self._call(dst, dst_inc, "import_request", dst.handle.import_request.remote(state_ref))
            except Exception as e:  # noqa: BLE001 - counted by dst's circuit breaker, then handled below
                # NOTE: a lost state (its node died) is the source's failure, not the destination's.
                if not isinstance(e, TimeoutError) and not actor_dead(e) and not object_lost(e):
                    router.table.dispatch_failed(dst, f"import_request: {e!r}")
                raise
            router.table.dispatch_ok(dst)
            if not ok:
                r.dispatch_workers.discard(dst.worker_id)
                return False
            phase = "commit"
            await self._fault("after_import", r, move)
            if not self._still_on(r, src.worker_id, rid) or dst.state != WORKER_UP:
                self._abort_on(dst, rid)  # nobody will read that copy
                r.dispatch_workers.discard(dst.worker_id)
                return False
            # Committed: the request lives on dst from now on (a src death no longer replays it).
            committed = True
            r.worker_id = dst.worker_id
            router.dispatcher.pend(r, dst.worker_id)
            r.migrations += 1
            src.migrations_out += 1
            # NOTE: the blocks it holds as exported (it may have grown since the decision).
            router.ledger.moved(dataclasses.replace(move, blocks=blocks_for(num_tokens, router.block_size)))
            router.metrics.migrated()
            logger.info("migrated %s from %s to %s (%d tokens)", r.request_id, src.worker_id, dst.worker_id,
                        num_tokens)  # fmt: skip
            return True
        except Exception as e:  # noqa: BLE001 - every failure ends in the invariant (finally)
            logger.warning("migration of %s from %s to %s failed at %s: %r", r.request_id, move.src, move.dst,
                           phase, e)  # fmt: skip
            if phase in ("import", "commit") and not committed:
                # NOTE: the import landed, or one that timed out still may: nobody reads that copy.
                self._abort_on(dst, rid)
                r.dispatch_workers.discard(dst.worker_id)
            return False
        finally:
            if exported:
                # Resume the source's copy if the request still lives there; free it otherwise.
                resume = not committed and self._still_on(r, src.worker_id, rid)
                await self.finish_export(src, src_inc, rid, migrated=not resume)
            self.busy.difference_update((move.src, move.dst))

    @staticmethod
    def _still_on(r: RouterRequest, worker_id: str, rid: str) -> bool:
        """``r`` is alive and still the same dispatch on ``worker_id``."""
        return not r.finished and not r.cancelled and r.worker_id == worker_id and r.worker_rid == rid

    async def _call(self, entry: WorkerState, incarnation: str, method: str, call: Awaitable[object]) -> object:
        """Await a migration ``call`` to ``entry`` while the worker makes progress
        (``WorkerTable.bounded``); no progress for its stall threshold is a stall (the worker is
        given up: its requests replayed, its actor killed) and raises TimeoutError."""
        table = self.router.table
        try:
            return await table.bounded(entry, call)
        except TimeoutError:
            threshold = table.stall_threshold_s(entry)
            table.give_up(entry, f"{method} did not return in {threshold:.1f}s with no progress", incarnation)
            raise

    async def finish_export(self, src: WorkerState, incarnation: str, rid: str, migrated: bool) -> None:
        """Free (``migrated``) or resume the copy of ``rid`` an export paused on ``src``; a failure is logged."""
        try:
            await self._call(src, incarnation, "finish_export", src.handle.finish_export.remote(rid, migrated))
        except Exception as e:  # noqa: BLE001 - a dead or hung source takes its paused copy with it
            logger.warning("finish_export(%s, migrated=%s) on %s failed: %r", rid, migrated, src.worker_id, e)

    def _abort_on(self, entry: WorkerState, rid: str) -> None:
        """Stop a copy of dispatch ``rid`` on ``entry`` (queued on its link: it lands when the
        worker reads commands again, or dies with the process)."""
        self.router.link.abort(entry.worker_id, rid)

    async def _fault(self, phase: str, r: RouterRequest, move: Migration) -> None:
        if self.fault is not None:
            await self.fault(phase, r, move)

    def preempt_for(self, waiting: RouterRequest) -> None:
        """Carry out the preemption ``plan_preemption`` decides for a queued request, if any: the
        victim's worker gets a Preempt command and the newcomer at once."""
        router = self.router
        if not router.config.enable_priority_preemption:
            return
        shape = WaitingRequest(waiting.request_id, waiting.priority, waiting.num_blocks + 1)
        decision = plan_preemption(shape, router.table.views(), self.running())
        if decision is None:
            return
        victim = router.requests[decision.victim_id]
        victim.router_preempted = True
        mode = pb.Preempt.SWAP if decision.swap else pb.Preempt.RECOMPUTE
        router.metrics.preempt_command(pb.Preempt.Mode.Name(mode).lower())
        command = pb.Preempt(request_id=victim.worker_rid, mode=mode)
        router.link.send(decision.worker_id, pb.RouterCommand(preempt=command))
        router.queue.remove(waiting.request_id)
        router.dispatcher.dispatch(waiting, decision.worker_id, decision.promised_blocks)
