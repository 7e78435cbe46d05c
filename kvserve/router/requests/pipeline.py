"""``RequestPipeline``: what the dispatcher, the lifecycle, the mover and the drainer use of the router
(kvserve/router/requests/router.py implements it), so that they depend on this contract rather than on
the ``Router`` class (no file-level import cycle)."""

from __future__ import annotations

from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, Protocol

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

if TYPE_CHECKING:  # NOTE: the parts that take the pipeline themselves; typing only
    from kvserve.router.requests.dispatch import Dispatcher
    from kvserve.router.requests.lifecycle import RequestLifecycle
    from kvserve.router.requests.migrations import Mover


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
    dispatcher: Dispatcher
    lifecycle: RequestLifecycle
    mover: Mover

    def decide(self, r: RouterRequest) -> Decision | None:
        """Where placement would put ``r`` now (None: nowhere has room); nothing is dispatched."""

    def place(self, r: RouterRequest) -> bool:
        """Place ``r`` now if it fits a worker (then dispatched); False: it fits nowhere now."""

    def pump(self) -> None:
        """Place queued requests that fit now."""

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run ``coro`` on the router's loop, keeping a reference until it ends."""
