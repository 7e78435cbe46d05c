"""Supervision records carry restarts and retirement from one router to the next (no Ray): a
retired worker stays retired, restart history keeps counting within its window, including the
router's downtime."""

from __future__ import annotations

import asyncio
import time

from kvserve.router.config import RouterConfig
from kvserve.router.requests.request import WORKER_RETIRED, WORKER_UP
from kvserve.router.requests.router import Router
from kvserve.router.table.supervision import WorkerSupervision
from tests.unit.test_router_failover import FakeWorker, _connect, _identity


def _run(coro) -> None:  # noqa: ANN001
    asyncio.run(coro())


def test_a_retired_worker_and_restart_history_survive_a_new_router() -> None:
    async def test() -> None:
        old = Router(RouterConfig(port=0, worker_restart_limit=1, worker_restart_window_s=600))
        for w in ("a", "b"):
            old.add_worker(w, FakeWorker(), _identity(w))
            _connect(old, w, "inc-1")
        _connect(old, "a", "inc-2")
        _connect(old, "a", "inc-3")  # 2 restarts > limit 1: retired
        _connect(old, "b", "inc-2")  # 1 restart: still up
        records = old.table.supervision()
        assert records["a"].retired and records["a"].restarts_total == 2
        assert not records["b"].retired and records["b"].restarts_total == 1 and len(records["b"].restart_ages_s) == 1

        new = Router(RouterConfig(port=0, worker_restart_limit=1, worker_restart_window_s=600))
        for w in ("a", "b"):
            new.add_worker(w, FakeWorker(), _identity(w), records[w])
        assert new.table["a"].state == WORKER_RETIRED and not new.table.serving(new.table["a"])
        _connect(new, "a", "inc-3")  # its Hello (had it survived) does not bring it back
        assert new.table["a"].state == WORKER_RETIRED
        # "b" restarted once before the router died; once more now is its second within the window.
        _connect(new, "b", "inc-2")
        _connect(new, "b", "inc-3")
        assert new.table["b"].restarts_total == 2 and new.table["b"].state == WORKER_RETIRED

    _run(test)


def test_restart_ages_grow_by_the_routers_downtime_and_leave_the_window() -> None:
    async def test() -> None:
        router = Router(RouterConfig(port=0, worker_restart_limit=1, worker_restart_window_s=60))
        # One restart 10 s before a snapshot taken 100 s ago: 110 s old now, out of the 60 s window.
        record = WorkerSupervision(restarts_total=1, restart_ages_s=(10.0,), taken_at=time.time() - 100.0)
        router.add_worker("a", FakeWorker(), _identity("a"), record)
        _connect(router, "a", "inc-1")
        _connect(router, "a", "inc-2")
        assert router.table["a"].state == WORKER_UP and router.table["a"].restarts_total == 2

    _run(test)
