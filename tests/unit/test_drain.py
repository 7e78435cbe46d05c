"""Graceful drain (kvserve/router/requests/drain.py) on fake workers (no Ray, no gRPC): out of placement at once,
started requests migrated live, unstarted ones handed off (not counted as replays), the worker
killed with restarts allowed and taken back on its new incarnation's Hello without that restart
counting toward retirement; the refusals; and SIGTERM's ``drain_me`` message."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest
import ray

from kvserve.protos.kvserve.v1 import worker_pb2 as pb
from kvserve.router.config import RouterConfig
from kvserve.router.requests.drain import DONE, FAILED, MOVING, RESTARTING
from kvserve.router.requests.request import WORKER_DOWN, WORKER_RETIRED, WORKER_UP, RouterError
from kvserve.router.requests.router import Router
from tests.unit.test_migration_faults import _Worker
from tests.unit.test_router_failover import _connect, _identity, _out, _req, _settle


@pytest.fixture(autouse=True)
def kills(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, bool]]:
    calls: list[tuple[Any, bool]] = []
    monkeypatch.setattr(ray, "kill", lambda handle, no_restart=True: calls.append((handle, no_restart)))
    return calls


def _setup(**config: Any) -> tuple[Router, dict[str, _Worker]]:
    # NOTE: worker_restart_limit 0: any restart counted toward retirement retires the worker at once.
    config = {"worker_restart_limit": 0, **config}
    router = Router(RouterConfig(port=0, **config))
    workers = {w: _Worker() for w in ("a", "b")}
    for w, handle in workers.items():
        router.add_worker(w, handle, _identity(w))
        _connect(router, w, "inc-1")
    return router, workers


async def _until(cond: Any, what: str, timeout: float = 5.0) -> None:
    async def wait() -> None:
        while not cond():
            await asyncio.sleep(0.01)

    try:
        await asyncio.wait_for(wait(), timeout)
    except TimeoutError:
        raise AssertionError(f"not within {timeout}s: {what}") from None


def test_a_drain_migrates_started_requests_hands_off_the_rest_restarts_and_takes_the_worker_back(
    kills: list,
) -> None:
    async def test() -> None:
        router, workers = _setup()
        started = router.submit(_req("started", max_tokens=50))
        fresh = router.submit(_req("fresh", max_tokens=50))
        await _settle()
        # Both on one worker: put them there by placing the second where the first went.
        src = started.worker_id
        assert src is not None
        if fresh.worker_id != src:
            assert await router.mover.migrate(fresh.request_id, src)
        router._on_output(src, _out(started.worker_rid, [10, 11], 2))  # it has streamed
        dst = "b" if src == "a" else "a"
        drain = router.drainer.start(src, 5.0)
        seen: list[str] = []

        async def follow() -> None:
            async for p in router.drainer.follow(drain):
                seen.append(p.phase)

        follower = asyncio.get_running_loop().create_task(follow())
        # Out of placement at once: a new request goes to the other worker.
        assert not router.table.serving(router.table[src])
        assert router.cluster_status().workers[[w.worker_id for w in router.cluster_status().workers].index(src)
                                               ].state == "draining"  # fmt: skip
        newcomer = router.submit(_req("new", max_tokens=8))
        await _settle()
        assert newcomer.worker_id == dst
        await _until(lambda: kills, "the drained worker killed")
        assert kills == [(workers[src], False)], "a drain restarts the process (Ray restarts it)"
        assert started.worker_id == dst and workers[src].calls_of("export_for_migration"), "started: migrated live"
        assert fresh.worker_id == dst and fresh.replays == 0, "not started: handed off, not counted as a replay"
        assert router.table[src].state == WORKER_DOWN and router.replays_total == 0
        _connect(router, src, "inc-2")  # the fresh process says Hello
        await asyncio.wait_for(drain.done.wait(), 5)
        await asyncio.wait_for(follower, 5)
        entry = router.table[src]
        assert entry.state == WORKER_UP and entry.restarts_total == 1 and not entry.restart_times
        assert router.table.serving(entry), "taken back into placement"
        assert drain.progress.phase == DONE and drain.progress.requests_migrated == 1
        assert drain.progress.requests_handed_off == 1 and drain.progress.new_incarnation == "inc-2"
        assert seen[0] == MOVING and RESTARTING in seen and seen[-1] == DONE
        # A crash restart afterwards still counts (limit 0: retired).
        _connect(router, src, "inc-3")
        assert router.table[src].state == WORKER_RETIRED

    asyncio.run(test())


def test_refusals_unknown_down_retired_and_the_last_serving_worker() -> None:
    async def test() -> None:
        router, _ = _setup()
        with pytest.raises(RouterError) as e:
            router.drainer.start("nope")
        assert e.value.code == grpc.StatusCode.NOT_FOUND
        router.table.down(router.table["b"], "test")
        with pytest.raises(RouterError) as e:
            router.drainer.start("b")
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION and "down" in e.value.message
        with pytest.raises(RouterError) as e:
            router.drainer.start("a")
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION and "last serving" in e.value.message
        router.table.retire(router.table["b"])
        with pytest.raises(RouterError) as e:
            router.drainer.start("b")
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION and "retired" in e.value.message
        assert router.table.serving(router.table["a"]), "a refused drain changes nothing"

    asyncio.run(test())


def test_a_second_drain_of_a_draining_worker_follows_the_first_and_the_other_is_then_the_last() -> None:
    async def test() -> None:
        router, _ = _setup()
        first = router.drainer.start("a")
        assert router.drainer.start("a") is first
        with pytest.raises(RouterError) as e:
            router.drainer.start("b")
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION

    asyncio.run(test())


def test_a_worker_not_back_in_time_fails_the_drain_and_leaves_placement_to_its_hello() -> None:
    async def test() -> None:
        router, _ = _setup(drain_restart_timeout_s=0.2)
        drain = router.drainer.start("a")
        await asyncio.wait_for(drain.done.wait(), 5)
        assert drain.progress.phase == FAILED and "not back" in drain.progress.reason
        assert router.table["a"].drain is None and router.table["a"].state == WORKER_DOWN
        _connect(router, "a", "inc-2")  # later: a crash-free restart, but no drain awaits it any more
        assert router.table["a"].state == WORKER_RETIRED  # limit 0: counted like any restart

    asyncio.run(test())


def test_with_no_migration_every_request_is_handed_off() -> None:
    async def test() -> None:
        router, workers = _setup(enable_migration=False)
        r = router.submit(_req("started", max_tokens=50))
        await _settle()
        src = r.worker_id
        assert src is not None
        router._on_output(src, _out(r.worker_rid, [10, 11], 2))
        drain = router.drainer.start(src, 5.0)
        await _until(lambda: drain.progress.phase == RESTARTING, "moved and restarting")
        assert r.worker_id != src and not workers[src].calls_of("export_for_migration")
        assert drain.progress.requests_handed_off == 1 and drain.progress.requests_migrated == 0

    asyncio.run(test())


def test_sigterm_drain_me_starts_a_drain_and_refusal_is_only_logged(caplog: pytest.LogCaptureFixture) -> None:
    async def test() -> None:
        router, _ = _setup()
        router.on_message("a", pb.WorkerMessage(seq=1, drain_me=pb.DrainMe(reason="SIGTERM")))
        drain = router.drainer.drains["a"]
        assert drain.reason == "SIGTERM" and not router.table.serving(router.table["a"])
        router.on_message("b", pb.WorkerMessage(seq=1, drain_me=pb.DrainMe(reason="SIGTERM")))
        assert "b" not in router.drainer.drains and "last serving" in caplog.text

    asyncio.run(test())
