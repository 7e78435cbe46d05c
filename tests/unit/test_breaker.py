"""Per-worker circuit breaking (kvserve/router/table/breaker.py): the pure state machine, and the router on fake
workers: repeated failed dispatches take a worker out of placement for an exponential, capped
backoff (no flapping with the health probes), and one success closes the breaker."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kvserve.router.config import RouterConfig
from kvserve.router.requests.router import Router
from kvserve.router.table.breaker import CLOSED, HALF_OPEN, OPEN, CircuitBreaker
from tests.unit.test_router_failover import FakeWorker, _connect, _identity, _req, _settle


def test_opens_after_threshold_failures_backs_off_exponentially_capped_and_closes_on_success() -> None:
    b = CircuitBreaker(threshold=3, base_s=1.0, max_s=3.0)
    assert b.failure(0.0) is None and b.failure(0.0) is None and b.state(0.0) == CLOSED
    assert b.failure(0.0) == 1.0 and b.state(0.5) == OPEN and not b.allows(0.5)
    assert b.failure(0.5) is None, "a failure of a call placed before it opened does not extend it"
    assert b.state(1.0) == HALF_OPEN and b.allows(1.0)
    assert b.failure(1.0) == 2.0, "half-open: one failure reopens it, for twice as long"
    assert b.failure(3.0) == 3.0, "capped"
    assert b.failure(6.0) == 3.0
    assert b.success() and b.state(6.0) == CLOSED and b.failures == 0
    assert b.failure(7.0) is None, "a success resets the count and the backoff"
    assert not b.success(), "closing a closed breaker changes nothing"
    with pytest.raises(ValueError):
        CircuitBreaker(threshold=0)


class _FailingWorker(FakeWorker):
    """``add_request`` raises (a live worker that refuses work) while ``failing``."""

    def __init__(self) -> None:
        super().__init__()
        self.failing = False

    def __getattr__(self, name: str) -> Any:
        method = super().__getattr__(name)
        outer = self

        class _M:
            def remote(self, *args: Any, **kwargs: Any) -> asyncio.Future:
                answer = method.remote(*args, **kwargs)
                fut = asyncio.get_running_loop().create_future()
                if name in ("add_request", "add_requests") and outer.failing:
                    fut.set_exception(RuntimeError("engine refused the request"))
                else:
                    fut.set_result(answer.result())
                return fut

        return _M()


def test_a_worker_whose_dispatches_keep_failing_leaves_placement_for_the_backoff_then_a_success_closes_it() -> None:
    async def test() -> None:
        router = Router(RouterConfig(port=0, breaker_failures=2, breaker_backoff_s=0.3, breaker_max_backoff_s=5))
        workers = {w: _FailingWorker() for w in ("a", "b")}
        for w, handle in workers.items():
            router.add_worker(w, handle, _identity(w))
            _connect(router, w, "inc-1")
        workers["a"].failing = True
        placed: list[str | None] = []
        for i in range(6):
            r = router.submit(_req(f"r{i}"))
            placed.append(r.target or r.worker_id)
            await _settle()
        a = router.table["a"]
        failures = len(workers["a"].added())
        assert failures == 2, f"a took {failures} dispatches; the breaker should open after 2"
        assert placed[failures:] == ["b"] * (6 - failures), placed
        assert not router.table.serving(a) and router.table.serving(router.table["b"])
        # A health probe that passes does not put it back (no flapping): the breaker decides.
        await router.table.probe(a)
        assert a.healthy and not router.table.serving(a)
        # After the backoff it is half-open: placement may try it; a success closes the breaker.
        workers["a"].failing = False
        await asyncio.sleep(0.35)
        assert router.table.serving(a)
        for i in range(4):
            router.submit(_req(f"s{i}"))
            await _settle()
        assert len(workers["a"].added()) > failures, "half-open: a got a dispatch again"
        assert a.breaker.state(0) == "closed" and a.breaker.failures == 0

    asyncio.run(test())


def test_reopening_without_a_success_doubles_the_time_out_of_placement() -> None:
    async def test() -> None:
        router = Router(RouterConfig(port=0, breaker_failures=1, breaker_backoff_s=0.2, breaker_max_backoff_s=5))
        w = _FailingWorker()
        w.failing = True
        router.add_worker("a", w, _identity("a"))
        router.add_worker("b", FakeWorker(), _identity("b"))
        _connect(router, "a", "inc-1")
        _connect(router, "b", "inc-1")
        a = router.table["a"]
        router.table.dispatch_failed(a, "test")
        first = a.breaker.open_until
        await asyncio.sleep(0.21)
        assert router.table.serving(a)
        router.table.dispatch_failed(a, "test")  # the half-open trial failed
        assert a.breaker.open_until is not None and first is not None
        # NOTE: it reopened after ``first`` (the half-open trial came later), for 0.4 s from then.
        assert a.breaker.open_until - first >= 0.4, "the second backoff is twice the first"
        assert not router.table.serving(a)

    asyncio.run(test())


class ObjectLostError(Exception):
    """Named as Ray's (the router recognises Ray's errors by class name)."""


class OwnerDiedError(ObjectLostError):
    """As Ray's: an ``ObjectLostError`` (the object's owner died)."""


class _RefusingImports(_FailingWorker):
    """Exports fine; ``import_request`` raises ``error`` (a live worker that refuses migrations)."""

    error: Exception

    def __getattr__(self, name: str) -> Any:
        if name not in ("import_request", "export_for_migration"):
            return super().__getattr__(name)
        outer = self

        class _M:
            def options(self, **options: Any) -> _M:
                return self

            def remote(self, *args: Any, **kwargs: Any) -> Any:
                fut = asyncio.get_running_loop().create_future()
                if name == "import_request":
                    fut.set_exception(outer.error)
                    return fut
                fut.set_result(8)
                return fut, "state-ref"  # export_for_migration's two returns

        return _M()


async def _refused_migration_setup(error: Exception) -> tuple[Router, Any, str, str]:
    """Two workers whose imports raise ``error``, one request placed: (router, request, its worker, the other)."""
    router = Router(RouterConfig(port=0, breaker_failures=2, breaker_backoff_s=5, enable_migration=False))
    workers = {"a": _RefusingImports(), "b": _RefusingImports()}
    for w, handle in workers.items():
        handle.error = error
        router.add_worker(w, handle, _identity(w))
        _connect(router, w, "inc-1")
    r = router.submit(_req("m0"))
    await _settle()
    src = r.worker_id
    assert src is not None
    return router, r, src, "b" if src == "a" else "a"


def test_failed_migration_imports_count_toward_the_destinations_breaker() -> None:
    async def test() -> None:
        router, r, src, dst = await _refused_migration_setup(RuntimeError("import refused"))
        assert not await router.mover.migrate(r.request_id, dst)
        assert router.table.serving(router.table[dst]), "one failure: still closed"
        assert not await router.mover.migrate(r.request_id, dst)
        assert not router.table.serving(router.table[dst]), "two failed imports must open dst's breaker"
        assert r.worker_id == src and router.table.serving(router.table[src])

    asyncio.run(test())


def test_an_import_whose_state_was_lost_does_not_count_against_the_destinations_breaker() -> None:
    """The exported state is gone (Ray's ``ObjectLostError``, e.g. ``OwnerDiedError``): not the destination's fault."""

    async def test() -> None:
        router, r, src, dst = await _refused_migration_setup(OwnerDiedError("the exported state's owner died"))
        for _ in range(3):
            assert not await router.mover.migrate(r.request_id, dst)
        assert router.table.serving(router.table[dst]), "a lost state opened the destination's breaker"
        assert r.worker_id == src

    asyncio.run(test())
