"""``RequestPipeline``: what the dispatcher and the mover use of the router (kvserve/router/requests/router.py
implements it), so that they depend on this contract rather than on the ``Router`` class."""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any, Protocol

import grpc

from kvserve.router.config import RouterConfig
from kvserve.router.gate.validation import ModelLimits
from kvserve.router.observe.metrics import RouterMetrics
from kvserve.router.policy.admission import AdmissionQueue
from kvserve.router.policy.rebalance import MigrationLedger, Watermarks
from kvserve.router.requests.request import RouterRequest
from kvserve.router.table.worker_link import WorkerLinkService
from kvserve.router.table.workers import WorkerTable


class RequestPipeline(Protocol):
    config: RouterConfig
    requests: dict[str, RouterRequest]
    table: WorkerTable
    link: WorkerLinkService
    metrics: RouterMetrics
    queue: AdmissionQueue[RouterRequest]
    ledger: MigrationLedger
    watermarks: Watermarks
    limits: ModelLimits | None
    block_size: int
    replays_total: int

    def place(self, r: RouterRequest) -> bool:
        """Place ``r`` now if it fits a worker (then dispatched); False: it fits nowhere now."""

    def dispatch(self, r: RouterRequest, worker_id: str, promised_blocks: int) -> None:
        """Send ``r`` to ``worker_id`` under a new dispatch id (kvserve/router/requests/dispatch.py)."""

    def pend(self, r: RouterRequest, worker_id: str) -> None:
        """Record ``r``'s prompt blocks as about to be on ``worker_id``."""

    def send_abort(self, r: RouterRequest) -> None:
        """Abort ``r``'s current dispatch on its worker."""

    def finish(self, r: RouterRequest) -> None:
        """``r`` ended: forget it everywhere."""

    def fail(self, r: RouterRequest, code: grpc.StatusCode, message: str) -> None:
        """End ``r`` with a gRPC status."""

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run ``coro`` on the router's loop, keeping a reference until it ends."""
