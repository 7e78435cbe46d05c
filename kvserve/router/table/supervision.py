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
from collections.abc import Iterable
from dataclasses import dataclass


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

    @classmethod
    def now(cls, restarts_total: int, restart_times: Iterable[float], retired: bool) -> WorkerSupervision:
        """The record of a router's row now (``restart_times``: ``time.monotonic()`` readings)."""
        now = time.monotonic()
        ages = tuple(max(now - t, 0.0) for t in restart_times)
        return cls(restarts_total, ages, retired, time.time())

    def restart_times(self) -> list[float]:
        """The restarts as this process's ``time.monotonic()`` readings.

        NOTE: the ages grow by the time since the snapshot (the router's downtime), so a restart
        storm that straddles a router restart still counts within its window.
        """
        elapsed = max(time.time() - self.taken_at, 0.0) if self.taken_at else 0.0
        now = time.monotonic()
        return [now - age - elapsed for age in self.restart_ages_s]
