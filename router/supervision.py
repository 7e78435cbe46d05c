"""Supervision state that outlives a router: each worker's restarts and whether it is retired.

The router decides retirement (README "Failure behaviour": more than ``worker_restart_limit``
restarts within ``worker_restart_window_s``), but it holds no durable state: a router that dies
would forget a retired worker (and take it back) and every worker's restart history. So
``kvserve serve`` keeps the latest ``WorkerSupervision`` of every worker (it reads them from the
router on each liveness poll, ``RouterService.supervision`` -> ``WorkerTable.supervision``) and
hands them to the next router with each worker's registration (``RouterService.add_worker`` ->
``WorkerTable.register``).

Restart times travel as ages (seconds before the snapshot), not as clock readings, so the record
means the same to a router on another clock.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from router.request import WORKER_RETIRED

if TYPE_CHECKING:
    from router.workers import WorkerState


@dataclass(frozen=True)
class WorkerSupervision:
    """One worker's supervision record (plain data: it crosses processes through Ray).

    Attributes:
        restarts_total: restarts the routers have seen, over the cluster's life.
        restart_ages_s: how long before ``taken_at`` each restart still inside the restart window
            happened (oldest first).
        retired: the worker was retired (killed for good); it must stay down.
        taken_at: ``time.time()`` of the snapshot (wall clock: comparable across processes).
    """

    restarts_total: int = 0
    restart_ages_s: tuple[float, ...] = ()
    retired: bool = False
    taken_at: float = 0.0


def snapshot(entry: WorkerState) -> WorkerSupervision:
    """The record of one router table row, now."""
    now = time.monotonic()
    return WorkerSupervision(
        restarts_total=entry.restarts_total,
        restart_ages_s=tuple(max(now - t, 0.0) for t in entry.restart_times),
        retired=entry.state == WORKER_RETIRED,
        taken_at=time.time(),
    )


def restore(entry: WorkerState, record: WorkerSupervision) -> None:
    """Carry ``record`` into a new router's table row (its restart history and retirement).

    NOTE: the ages grow by the time since the snapshot (the router's downtime), so a restart
    storm that straddles a router restart still counts within its window.
    """
    elapsed = max(time.time() - record.taken_at, 0.0) if record.taken_at else 0.0
    now = time.monotonic()
    entry.restarts_total = max(entry.restarts_total, record.restarts_total)
    entry.restart_times.clear()
    entry.restart_times.extend(now - age - elapsed for age in record.restart_ages_s)
    if record.retired:
        entry.state = WORKER_RETIRED
        entry.healthy = False
