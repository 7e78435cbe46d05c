"""Migration that fails safely (kvserve/router/requests/migrations.py invariant), on fake workers with fault hooks:
at every failure point (either side dying or hanging at export, import or commit, the client
cancelling mid-move) a move ends with exactly one live copy of the request (or none once it
ended), the source's paused copy resumed or freed (``finish_export``), a destination copy nobody
reads aborted, and the stream continuing."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import ray

from kvserve.router.config import RouterConfig
from kvserve.router.requests.request import WORKER_DOWN, WORKER_UP
from kvserve.router.requests.router import Router
from tests.unit.test_router_failover import FakeWorker, _connect, _identity, _req, _settle

STALL_S = 0.3  # every migration call is bounded by this (the stall threshold)


NUM_TOKENS = 8  # what a fake export says its state covers


class ActorDiedError(Exception):
    """Named as Ray's (the router recognises Ray's errors by class name)."""


class _Worker(FakeWorker):
    """Answers export/import/finish as told: ``behaviour[name]`` is "ok", "raise", "hang" or a value."""

    def __init__(self) -> None:
        super().__init__()
        self.behaviour: dict[str, Any] = {"import_request": True, "finish_export": True}

    def __getattr__(self, name: str) -> Any:
        method = super().__getattr__(name)
        outer = self

        class _M:
            def options(self, **options: Any) -> _M:
                return self

            def remote(self, *args: Any, **kwargs: Any) -> Any:
                method.remote(*args, **kwargs)  # recorded
                fut = asyncio.get_running_loop().create_future()
                how = outer.behaviour.get(name, None)
                if name == "export_for_migration" and how is None:
                    how = NUM_TOKENS
                if name == "incarnation":
                    how = "inc-1"
                if how == "raise":
                    fut.set_exception(ActorDiedError(f"{name}: the actor died"))
                elif how != "hang":
                    fut.set_result(how)
                if name == "export_for_migration":  # NOTE: two returns: the count and the state's reference
                    return fut, f"state-of-{args[0]}"
                return fut

        return _M()

    def calls_of(self, name: str) -> list[tuple]:
        return [a for n, a, _ in self.calls if n == name]


@pytest.fixture(autouse=True)
def kills(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    calls: list[Any] = []
    monkeypatch.setattr(ray, "kill", lambda handle, no_restart=True: calls.append(handle))
    return calls


def _setup() -> tuple[Router, dict[str, _Worker], None]:
    router = Router(RouterConfig(port=0, stall_timeout_s=STALL_S, enable_migration=False))
    workers = {w: _Worker() for w in ("a", "b", "c")}
    for w, handle in workers.items():
        router.add_worker(w, handle, _identity(w))
        _connect(router, w, "inc-1")
    return router, workers, None


async def _running(router: Router) -> Any:
    r = router.submit(_req(max_tokens=50))
    await _settle()
    assert r.worker_id is not None
    return r


def _aborts(router: Router, worker_id: str) -> list[str]:
    return [c.abort.request_id for c in router.link.sessions[worker_id].unapplied.values() if c.HasField("abort")]


def _dst(src: str) -> str:
    return "b" if src == "a" else "a"


def test_a_clean_move_frees_the_source_copy() -> None:
    async def test() -> None:
        router, workers, _ = _setup()
        r = await _running(router)
        src, rid = r.worker_id, r.worker_rid
        assert await router.mover.migrate(r.request_id, _dst(src))
        assert r.worker_id == _dst(src) and workers[src].calls_of("finish_export") == [(rid, True)]

    asyncio.run(test())


@pytest.mark.parametrize("how", ["raise", "hang", None])
def test_an_import_that_fails_hangs_or_does_not_fit_resumes_the_source(how: str | None, kills: list) -> None:
    async def test() -> None:
        router, workers, _ = _setup()
        r = await _running(router)
        src, rid = r.worker_id, r.worker_rid
        dst = _dst(src)
        workers[dst].behaviour["import_request"] = how
        assert not await router.mover.migrate(r.request_id, dst)
        assert r.worker_id == src and r.worker_rid == rid and not r.finished  # the one live copy: on src
        assert workers[src].calls_of("finish_export") == [(rid, False)]  # resumed, not left paused
        if how == "hang":  # a stalled destination: given up and killed; a late import is aborted
            assert router.table[dst].state == WORKER_DOWN and kills == [workers[dst]]
            assert rid in _aborts(router, dst)

    asyncio.run(test())


def test_an_export_that_hangs_gives_up_the_source_and_replays_the_request(kills: list) -> None:
    async def test() -> None:
        router, workers, _ = _setup()
        r = await _running(router)
        src, rid = r.worker_id, r.worker_rid
        workers[src].behaviour["export_for_migration"] = "hang"
        assert not await router.mover.migrate(r.request_id, _dst(src))
        await _settle()
        assert router.table[src].state == WORKER_DOWN and kills == [workers[src]]
        assert r.worker_id not in (None, src) and r.worker_rid != rid and r.replays == 1
        assert workers[src].calls_of("finish_export") == []  # nothing to resume: the process is killed

    asyncio.run(test())


def test_a_client_cancel_during_the_import_leaves_no_copy() -> None:
    async def test() -> None:
        router, workers, _ = _setup()
        r = await _running(router)
        src, rid = r.worker_id, r.worker_rid
        dst = _dst(src)

        async def cancel_after_import(phase: str, req: Any, move: Any) -> None:
            if phase == "after_import":
                router.lifecycle.cancel(req)

        router.mover.fault = cancel_after_import
        assert not await router.mover.migrate(r.request_id, dst)
        assert r.finished and rid in _aborts(router, dst)  # the imported copy is stopped
        assert workers[src].calls_of("finish_export") == [(rid, True)]  # the paused one freed

    asyncio.run(test())


def test_a_source_death_during_the_import_keeps_only_the_replay() -> None:
    async def test() -> None:
        router, workers, _ = _setup()
        r = await _running(router)
        src, rid = r.worker_id, r.worker_rid
        dst = _dst(src)

        async def src_dies(phase: str, req: Any, move: Any) -> None:
            if phase == "after_import":
                router.table.down(router.table[src], "killed by the test")  # replays it elsewhere

        router.mover.fault = src_dies
        assert not await router.mover.migrate(r.request_id, dst)
        await _settle()
        assert r.replays == 1 and r.worker_rid != rid and not r.finished  # the replay is the live copy
        assert rid in _aborts(router, dst)  # the imported copy of the old dispatch is stopped

    asyncio.run(test())


def test_a_destination_death_after_the_commit_replays_the_request() -> None:
    async def test() -> None:
        router, workers, _ = _setup()
        r = await _running(router)
        src = r.worker_id
        dst = _dst(src)
        workers[src].behaviour["finish_export"] = "raise"  # and the source dies too: its copy with it
        assert await router.mover.migrate(r.request_id, dst)
        assert r.worker_id == dst
        router.table.down(router.table[dst], "killed by the test")
        await _settle()
        assert r.worker_id not in (None, dst) and r.replays == 1 and not r.finished
        assert router.table[src].state == WORKER_UP  # a failed finish_export alone is no death

    asyncio.run(test())


@pytest.mark.parametrize("phase_to_fail", ["before_export", "before_import", "after_import"])
def test_a_fault_raised_at_any_phase_leaves_the_request_on_the_source(phase_to_fail: str) -> None:
    async def test() -> None:
        router, workers, _ = _setup()
        r = await _running(router)
        src, rid = r.worker_id, r.worker_rid

        async def fail(phase: str, req: Any, move: Any) -> None:
            if phase == phase_to_fail:
                raise RuntimeError(f"injected at {phase}")

        router.mover.fault = fail
        assert not await router.mover.migrate(r.request_id, _dst(src))
        assert r.worker_id == src and r.worker_rid == rid and not r.finished
        resumed = workers[src].calls_of("finish_export")
        assert resumed == ([] if phase_to_fail == "before_export" else [(rid, False)])
        if phase_to_fail == "after_import":
            assert rid in _aborts(router, _dst(src))  # the imported copy is stopped

    asyncio.run(test())


def test_an_import_slower_than_the_threshold_while_the_destination_computes_is_waited_for(kills: list) -> None:
    """A destination busy with a long step (it heartbeats: ``StepHeartbeat``) is slow, not hung:
    the move waits for its import instead of giving it up and replaying its requests."""
    from kvserve.protos.kvserve.v1 import worker_pb2 as pb

    async def test() -> None:
        router, workers, _ = _setup()
        r = await _running(router)
        src, dst = r.worker_id, _dst(r.worker_id)
        workers[dst].behaviour["import_request"] = "hang"
        move = asyncio.ensure_future(router.mover.migrate(r.request_id, dst))
        for _ in range(8):  # 0.8 s, well past the 0.3 s threshold, heartbeating all along
            await asyncio.sleep(0.1)
            router.on_message(dst, pb.WorkerMessage(heartbeat=pb.StepHeartbeat(step_elapsed_s=1.0, step_cpu_s=1.0)))
        assert not move.done() and router.table[dst].state == WORKER_UP and not kills
        await asyncio.sleep(STALL_S * 3)  # the heartbeats stop: now it is a stall
        assert not await move
        assert router.table[dst].state == WORKER_DOWN and kills == [workers[dst]] and r.worker_id == src

    asyncio.run(test())
