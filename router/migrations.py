"""Carries out what router/rebalance.py plans: watermark migrations (two-phase, over Ray calls) and
priority preemptions (a Preempt command on the victim's worker, the newcomer dispatched at once).

Migration is ``export_request`` on the source (it pauses the request at a step boundary and hands
back its ``MigrationState``), ``import_request`` on the destination, then ``finish_export(ok)`` on
the source (frees it, or resumes it if the import did not fit). A worker takes part in one move
at a time (``busy``).
"""

from __future__ import annotations

import dataclasses
import logging

from protos.kvserve.v1 import worker_pb2 as pb
from router.pipeline import RequestPipeline
from router.rebalance import Migration, RunningRequest, WaitingRequest, plan_migration, plan_preemption
from router.request import RouterRequest
from router.workers import WorkerState
from workers.core.sizes import blocks_for

logger = logging.getLogger(__name__)


class Mover:
    """Migrations and router preemptions of one router's requests."""

    def __init__(self, router: RequestPipeline) -> None:
        self.router = router
        self.busy: set[str] = set()  # workers in a migration now (source or destination)

    def running(self) -> list[RunningRequest]:
        """The requests on workers, as rebalancing sees them."""
        limits = self.router.limits
        # NOTE: generation also stops at max_model_len, so that bounds the tokens still to come.
        max_len = limits.max_model_len if limits is not None else 0
        return [
            RunningRequest(
                r.request_id,
                r.worker_id,
                r.priority,
                r.arrival,
                len(r.prompt_ids) + r.tokens_received,
                r.tokens_received,
                preemptible=not r.router_preempted,
                remaining_tokens=max(min(r.params.max_tokens, max_len - len(r.prompt_ids)) - r.tokens_received, 0),
            )  # fmt: skip
            for r in self.router.requests.values()
            if r.worker_id is not None
        ]

    def rebalance(self, src: WorkerState) -> None:
        """Start the migration off ``src`` that ``plan_migration`` decides, if any."""
        router = self.router
        if not router.config.enable_migration:
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
        """Export from ``move.src`` at a step boundary, import into ``move.dst``; resume on the
        source if it does not fit. The caller has put both workers in ``busy``."""
        router = self.router
        src, dst = router.table[move.src], router.table[move.dst]
        try:
            state = await src.handle.export_request.remote(r.worker_rid)
            if state is None:
                return False
            ok = await dst.handle.import_request.remote(state)
            await src.handle.finish_export.remote(r.worker_rid, bool(ok))
            if not ok:
                return False
            r.worker_id = dst.worker_id
            router.pend(r, dst.worker_id)
            r.migrations += 1
            src.migrations_out += 1
            # NOTE: the blocks it holds as exported (it may have grown since the decision).
            router.ledger.moved(dataclasses.replace(move, blocks=blocks_for(state.num_tokens, router.block_size)))
            router.metrics.migrated()
            logger.info("migrated %s from %s to %s (%d tokens)", r.request_id, src.worker_id, dst.worker_id,
                        state.num_tokens)  # fmt: skip
            return True
        except Exception:  # noqa: BLE001 - a failed migration leaves the request where it was
            logger.exception("migration of %s failed", r.request_id)
            return False
        finally:
            self.busy.difference_update((move.src, move.dst))

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
        router.dispatch(waiting, decision.worker_id, decision.blocks_needed)
