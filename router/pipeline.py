"""``RequestPipeline``: what the dispatcher and the mover use of the router (router/router.py
implements it), so that they depend on this contract rather than on the ``Router`` class."""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any, Protocol

import grpc

from router.admission import AdmissionQueue
from router.config import RouterConfig
from router.metrics import RouterMetrics
from router.rebalance import MigrationLedger, Watermarks
from router.request import RouterRequest
from router.validation import ModelLimits
from router.worker_link import WorkerLinkService
from router.workers import WorkerTable


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
        """Send ``r`` to ``worker_id`` under a new dispatch id (router/dispatch.py)."""

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
