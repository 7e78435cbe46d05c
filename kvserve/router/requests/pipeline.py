"""``RequestPipeline``: what the dispatcher, the lifecycle, the mover and the drainer use of the router
(kvserve/router/requests/router.py implements it), so that they depend on this contract rather than on
the ``Router`` class (no file-level import cycle)."""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any, Protocol

import grpc

from kvserve.router.config import RouterConfig
from kvserve.router.gate.validation import ModelLimits
from kvserve.router.observe.metrics import RouterMetrics
from kvserve.router.policy.admission import AdmissionQueue
from kvserve.router.policy.placement import Decision
from kvserve.router.policy.prefix_index import PrefixIndex
from kvserve.router.policy.rebalance import MigrationLedger, Watermarks
from kvserve.router.requests.request import RouterRequest
from kvserve.router.table.worker_link import WorkerLinkService
from kvserve.router.table.workers import WorkerTable


# NOTE: the parts that take the pipeline themselves are seen through what their peers use of them
# (kvserve/router/requests/dispatch.py, lifecycle.py, migrations.py implement these), so no module of
# requests/ imports another that imports it back.
class Dispatching(Protocol):
    by_worker_rid: dict[str, RouterRequest]
    adding: set[str]

    def dispatch(self, r: RouterRequest, worker_id: str, promised_blocks: int) -> None:
        """Send ``r`` to ``worker_id`` under a fresh dispatch id, promising ``promised_blocks`` there."""

    def pend(self, r: RouterRequest, worker_id: str) -> None:
        """Record ``r``'s prompt blocks as about to be on ``worker_id`` (placement affinity)."""

    def forget(self, r: RouterRequest) -> None:
        """``r``'s current dispatch id maps to nothing any more."""


class Ending(Protocol):
    def finish(self, r: RouterRequest) -> None:
        """``r`` ended: forgotten everywhere, its promises released."""

    def fail(self, r: RouterRequest, code: grpc.StatusCode, message: str) -> None:
        """End ``r`` with a gRPC status."""

    def stop_on(self, r: RouterRequest, worker_id: str) -> None:
        """Abort ``r``'s dispatch on ``worker_id`` and release its promise there."""

    def hand_off(self, r: RouterRequest, why: str) -> None:
        """Continue ``r`` elsewhere (placed, or first in the queue), else end it UNAVAILABLE ``why``."""

    def continue_elsewhere(self, r: RouterRequest, why: str) -> None:
        """``hand_off`` once the tokens ``r`` continues after are known (an owned request's resume)."""


class Owning(Protocol):
    def forget(self, r: RouterRequest) -> None:
        """Owned ``r`` ended."""

    def ask_resume(self, r: RouterRequest, why: str) -> None:
        """Ask owned ``r``'s owner for its client's tokens before it continues elsewhere."""

    def placed(self, r: RouterRequest) -> None:
        """Owned ``r``'s worker took it."""


class Moving(Protocol):
    busy: set[str]

    async def migrate(self, request_id: str, dst_worker_id: str) -> bool:
        """Move a running request live to ``dst_worker_id``; True if it moved."""


class RequestPipeline(Protocol):
    config: RouterConfig
    requests: dict[str, RouterRequest]
    table: WorkerTable
    link: WorkerLinkService
    metrics: RouterMetrics
    queue: AdmissionQueue[RouterRequest]
    prefix_index: PrefixIndex
    ledger: MigrationLedger
    watermarks: Watermarks
    limits: ModelLimits | None
    block_size: int
    replays_total: int
    dispatcher: Dispatching
    lifecycle: Ending
    mover: Moving
    owned: Owning

    def decide(self, r: RouterRequest) -> Decision | None:
        """Where placement would put ``r`` now (None: nowhere has room); nothing is dispatched."""

    def place(self, r: RouterRequest) -> bool:
        """Place ``r`` now if it fits a worker (then dispatched); False: it fits nowhere now."""

    def pump(self) -> None:
        """Place queued requests that fit now."""

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run ``coro`` on the router's loop, keeping a reference until it ends."""
