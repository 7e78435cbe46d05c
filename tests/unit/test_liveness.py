"""The liveness rule on fake workers (no Ray, no gRPC; time passed in explicitly): a stalled
worker with work is down, its requests replayed and its actor killed; an idle or stepping one is
never stalled; a link blip within the grace period resumes with no replay, a longer one is a
death; a dead engine thread is a death; a hung add_request is bounded; the crash-loop retirement
really kills with no_restart."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import ray

from kvserve.protos.kvserve.v1 import worker_pb2 as pb
from kvserve.router.config import RouterConfig
from kvserve.router.requests.request import WORKER_DOWN, WORKER_RETIRED, WORKER_UP
from kvserve.router.requests.router import Router
from kvserve.router.table.liveness import LivenessInputs, down_reason
from kvserve.workers.core.liveness import EngineDeadError
from tests.unit.test_router_failover import FakeWorker, _commands, _connect, _identity, _out, _req, _settle

STALL_S = 5.0
GRACE_S = 2.0


class _Worker(FakeWorker):
    """A fake worker whose ``incarnation`` and ``check_health`` answer as told, and whose
    ``add_request`` can hang (a SIGSTOPped process)."""

    def __init__(self, incarnation: str = "inc-1") -> None:
        super().__init__()
        self.incarnation_value = incarnation
        self.health_error: BaseException | None = None
        self.health_future: asyncio.Future | None = None  # check_health answers when this does
        self.hang_add_request = False
        self.pending_adds: list[asyncio.Future] = []

    def __getattr__(self, name: str) -> Any:
        method = super().__getattr__(name)
        outer = self

        class _M:
            def remote(self, *args: Any, **kwargs: Any) -> asyncio.Future:
                fut = method.remote(*args, **kwargs)
                if name == "incarnation":
                    fut = asyncio.get_running_loop().create_future()
                    fut.set_result(outer.incarnation_value)
                elif name == "check_health" and outer.health_future is not None:
                    fut = outer.health_future
                elif name == "check_health" and outer.health_error is not None:
                    fut = asyncio.get_running_loop().create_future()
                    fut.set_exception(outer.health_error)
                elif name in ("add_request", "add_requests") and outer.hang_add_request:
                    fut = asyncio.get_running_loop().create_future()  # completes only if the test says so
                    outer.pending_adds.append(fut)
                return fut

        return _M()


@pytest.fixture
def kills(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, bool]]:
    """Every ``ray.kill`` the router makes: (handle, no_restart)."""
    calls: list[tuple[Any, bool]] = []
    monkeypatch.setattr(ray, "kill", lambda handle, no_restart=True: calls.append((handle, no_restart)))
    return calls


def _router(**config: Any) -> tuple[Router, dict[str, _Worker]]:
    router = Router(RouterConfig(**{"port": 0, "stall_timeout_s": STALL_S, "link_grace_s": GRACE_S, **config}))
    workers = {w: _Worker() for w in ("a", "b")}
    for w, handle in workers.items():
        router.add_worker(w, handle, _identity(w))
        _connect(router, w, "inc-1")
    return router, workers


def _router_with_adds_hung(**config: Any) -> tuple[Router, dict[str, _Worker]]:
    """``_router`` whose workers' ``add_request`` calls hang until a test completes them."""
    router, workers = _router(**config)
    for w in workers.values():
        w.hang_add_request = True
    return router, workers


def _disconnect(router: Router, worker_id: str) -> None:
    """What WorkerLinkService.Connect does when a stream ends (without the stream)."""
    router.link.sessions[worker_id].queue = None
    router.on_disconnect(worker_id)


def _stall(router: Router, worker_id: str, seconds: float) -> None:
    """As if the router last saw ``worker_id`` step ``seconds`` ago."""
    router.table[worker_id].progress_time -= seconds


def _report(worker_id: str, seq: int, steps: int, running: int = 1, step_ms: float = 1.0) -> pb.WorkerMessage:
    return pb.WorkerMessage(step=pb.StepMessages(pressure=pb.PressureReport(
        worker_id=worker_id, seq=seq, total_blocks=32, free_blocks=30, used_blocks=2, num_running=running,
        decode_steps=steps, step_latency_ms=step_ms,
    )))  # fmt: skip


def test_the_rule_itself() -> None:
    base = LivenessInputs(now=100.0, busy=True, progress_time=96.0, slowest_step_s=0.1, stall_timeout_s=5.0,
                          link_lost_at=None, link_grace_s=2.0)  # fmt: skip
    assert down_reason(base) is None
    assert "no engine step" in down_reason(LivenessInputs(**{**base.__dict__, "progress_time": 94.0}))
    assert down_reason(LivenessInputs(**{**base.__dict__, "progress_time": 0.0, "busy": False})) is None
    # A slow deployment: 3 s steps raise the threshold to 12 s.
    assert down_reason(LivenessInputs(**{**base.__dict__, "progress_time": 90.0, "slowest_step_s": 3.0})) is None
    assert "WorkerLink" in down_reason(LivenessInputs(**{**base.__dict__, "link_lost_at": 97.5}))
    assert down_reason(LivenessInputs(**{**base.__dict__, "link_lost_at": 98.5})) is None


def test_a_stalled_worker_with_work_is_down_replayed_elsewhere_and_killed(kills: list) -> None:
    async def test() -> None:
        router, workers = _router()
        r = router.submit(_req(max_tokens=20))
        await _settle()
        src = r.worker_id
        dst = "b" if src == "a" else "a"
        router._on_output(src, _out(r.worker_rid, [7, 8], 2))
        _stall(router, src, STALL_S / 2)
        router.table.check_liveness(time.monotonic())
        assert router.table[src].state == WORKER_UP  # not yet
        _stall(router, src, STALL_S / 2 + 1)
        router.table.check_liveness(time.monotonic())
        await _settle()
        assert router.table[src].state == WORKER_DOWN and router.table[dst].state == WORKER_UP
        assert r.worker_id == dst and r.replays == 1
        ((added,), _), = workers[dst].added()
        assert added.resume_output_ids == (7, 8)
        assert kills == [(workers[src], False)]  # killed so that Ray restarts it

    asyncio.run(test())


def test_an_idle_or_stepping_worker_is_never_stalled(kills: list) -> None:
    async def test() -> None:
        router, _ = _router()
        router.table.check_liveness(time.monotonic() + 1000)  # idle: no work at all
        r = router.submit(_req(max_tokens=20))
        await _settle()
        w = r.worker_id
        t0 = time.monotonic()
        for i in range(1, 5):  # it steps: each report shows progress
            router.on_message(w, _report(w, i, steps=i))
            router.table.check_liveness(t0 + 0.1)
        assert router.table[w].state == WORKER_UP and not kills
        # Slow steps (3 s each) raise its threshold to 12 s: 8 s without a step is not a stall.
        router.on_message(w, _report(w, 5, steps=5, step_ms=3000))
        _stall(router, w, 8)
        router.table.check_liveness(time.monotonic())
        assert router.table[w].state == WORKER_UP and not kills

    asyncio.run(test())


def test_a_long_step_that_computes_is_not_a_stall_and_silence_after_it_is(kills: list) -> None:
    async def test() -> None:
        router, _ = _router()
        r = router.submit(_req(max_tokens=20))
        await _settle()
        w = r.worker_id
        for _ in range(3):  # a first prefill step computing for 3 x (STALL_S - 1) seconds: heartbeats
            _stall(router, w, STALL_S - 1)
            router.on_message(w, pb.WorkerMessage(heartbeat=pb.StepHeartbeat(step_elapsed_s=1.0, step_cpu_s=0.9)))
            router.table.check_liveness(time.monotonic())
            assert router.table[w].state == WORKER_UP and not kills
        _stall(router, w, STALL_S + 1)  # then nothing: hung after all
        router.table.check_liveness(time.monotonic())
        await _settle()
        assert router.table[w].state == WORKER_DOWN and len(kills) == 1

    asyncio.run(test())


def test_a_link_blip_within_the_grace_resumes_without_replay(kills: list) -> None:
    async def test() -> None:
        router, workers = _router()
        r = router.submit(_req(max_tokens=20))
        await _settle()
        w, rid = r.worker_id, r.worker_rid
        _disconnect(router, w)
        await _settle()  # the process check: same incarnation, so it waits for the grace
        assert router.table[w].state == WORKER_UP and not router.table.serving(router.table[w])
        router.table[w].link_lost_at -= GRACE_S / 2
        router.table.check_liveness(time.monotonic())
        _connect(router, w, "inc-1")  # back, same process
        router.table.check_liveness(time.monotonic())
        assert router.table[w].state == WORKER_UP and router.table.serving(router.table[w])
        assert r.worker_id == w and r.worker_rid == rid and r.replays == 0 and not kills
        assert len(workers["a"].added()) + len(workers["b"].added()) == 1

    asyncio.run(test())


def test_a_link_down_past_the_grace_is_a_death(kills: list) -> None:
    async def test() -> None:
        router, workers = _router()
        r = router.submit(_req(max_tokens=20))
        await _settle()
        w = r.worker_id
        _disconnect(router, w)
        await _settle()
        router.table[w].link_lost_at -= GRACE_S + 0.5
        router.table.check_liveness(time.monotonic())
        await _settle()
        assert router.table[w].state == WORKER_DOWN and r.worker_id not in (None, w) and r.replays == 1
        assert kills == [(workers[w], False)]

    asyncio.run(test())


def test_a_broken_link_to_a_replaced_process_is_a_death_at_once(kills: list) -> None:
    async def test() -> None:
        router, workers = _router()
        r = router.submit(_req(max_tokens=20))
        await _settle()
        w = r.worker_id
        workers[w].incarnation_value = "inc-2"  # SIGKILL: Ray already started another process
        _disconnect(router, w)
        await _settle()
        assert router.table[w].state == WORKER_DOWN and r.replays == 1 and not kills

    asyncio.run(test())


def test_a_dead_engine_thread_is_a_death(kills: list) -> None:
    async def test() -> None:
        router, workers = _router()
        workers["a"].health_error = EngineDeadError("worker a: engine thread is dead")
        await router.table.probe(router.table["a"])
        await router.table.probe(router.table["b"])
        assert router.table["a"].state == WORKER_DOWN and router.table["b"].state == WORKER_UP
        assert kills == [(workers["a"], False)]

    asyncio.run(test())


def test_a_hung_add_request_is_bounded_by_the_stall_threshold(kills: list) -> None:
    async def test() -> None:
        router, workers = _router_with_adds_hung(stall_timeout_s=0.2)
        r = router.submit(_req(max_tokens=20))
        first = r.target
        workers["b" if first == "a" else "a"].hang_add_request = False
        await asyncio.wait_for(_until(lambda: r.worker_id not in (None, first)), timeout=10)
        assert router.table[first].state == WORKER_DOWN and kills == [(workers[first], False)]

    asyncio.run(test())


def test_an_add_request_slower_than_the_threshold_while_the_worker_computes_is_waited_for(kills: list) -> None:
    async def test() -> None:
        router, workers = _router_with_adds_hung(stall_timeout_s=0.2)
        r = router.submit(_req(max_tokens=20))
        w = r.target
        for _ in range(6):  # 0.6 s, three thresholds: a long step that computes, heartbeats all along
            await asyncio.sleep(0.1)
            router.on_message(w, pb.WorkerMessage(heartbeat=pb.StepHeartbeat(step_elapsed_s=1.0, step_cpu_s=1.0)))
            router.table.check_liveness(time.monotonic())
        assert router.table[w].state == WORKER_UP and not kills
        workers[w].pending_adds[0].set_result(None)  # the step ends; the worker takes the request
        await _until(lambda: r.worker_id == w)
        assert r.replays == 0 and not kills

    asyncio.run(test())


def test_an_add_request_that_lands_after_its_request_ended_is_aborted(kills: list) -> None:
    async def test() -> None:
        router, workers = _router_with_adds_hung(stall_timeout_s=0.2)
        r = router.submit(_req(max_tokens=20))
        w, rid = r.target, r.worker_rid
        router.lifecycle.cancel(r)  # the client left while the call was in flight
        await asyncio.sleep(0.5)  # the call times out (no progress): nobody reads what it may start
        assert any(c.abort.request_id == rid for c in _commands(router, w))
        # and an output of such a dispatch, or of any dispatch no longer current, is aborted once
        router.link.sessions[w].unapplied.clear()
        for n in (1, 2):
            router.on_message(w, pb.WorkerMessage(step_outputs=pb.StepOutputs(outputs=[_out(rid, [5], n)])))
        assert [c.abort.request_id for c in _commands(router, w)] == [rid]

    asyncio.run(test())


def test_a_dispatch_that_lands_after_its_client_left_holds_its_promise_until_the_worker_aborts_it(kills: list) -> None:
    async def test() -> None:
        router, workers = _router_with_adds_hung()
        r = router.submit(_req(max_tokens=20))
        w, rid = r.target, r.worker_rid
        router.lifecycle.cancel(r)  # the client left while the call was in flight
        # The call may still land: the cluster must not look idle (status, placement) meanwhile.
        assert router.table[w].promised_blocks > 0
        await _until(lambda: workers[w].pending_adds)
        workers[w].pending_adds[0].set_result(None)  # it lands
        await _until(lambda: any(n == "abort" for n, _, _ in workers[w].calls))
        assert [a for n, a, _ in workers[w].calls if n == "abort"] == [(rid,)]  # confirmed by the worker itself
        await _settle()
        assert router.table[w].promised_blocks == 0 and rid not in router.dispatcher.adding

    asyncio.run(test())


async def _until(ok: Any, timeout: float | None = None) -> None:
    """Poll ``ok`` until truthy; ``timeout``: fail after that many seconds (None: wait as long as the test runs)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while not ok():
        assert deadline is None or time.monotonic() < deadline, f"timed out after {timeout}s"
        await asyncio.sleep(0.01)


def test_a_crash_looping_worker_is_killed_for_good(kills: list) -> None:
    """The retirement really calls ``ray.kill(no_restart=True)`` (a swallowed failure would not do)."""

    async def test() -> None:
        router, workers = _router(worker_restart_limit=1, worker_restart_window_s=600)
        _connect(router, "a", "inc-2")
        _connect(router, "a", "inc-3")
        assert router.table["a"].state == WORKER_RETIRED
        assert kills == [(workers["a"], True)]

    asyncio.run(test())


class ActorDiedError(Exception):
    """Named as Ray's (the router recognises Ray's errors by class name)."""


def test_evidence_about_an_earlier_process_never_takes_down_a_fresh_one(kills: list) -> None:
    """A probe sent to the old process fails only after Ray's fresh process said Hello: the fresh
    one stays up (else it would sit 'down' forever with its link connected)."""

    async def test() -> None:
        router, workers = _router()
        pending = asyncio.get_running_loop().create_future()
        workers["a"].health_future = pending
        probe = asyncio.ensure_future(router.table.probe(router.table["a"]))
        await _settle()
        _connect(router, "a", "inc-2")  # the old process died; Ray's new one says Hello
        assert router.table["a"].state == WORKER_UP
        pending.set_exception(ActorDiedError("the old process is gone"))
        await probe
        assert router.table["a"].state == WORKER_UP and router.table.serving(router.table["a"]) and not kills

    asyncio.run(test())


def test_a_long_step_with_heartbeats_keeps_the_worker_healthy_and_silence_does_not(kills: list) -> None:
    """A worker reports pressure between steps only: a prefill step longer than ``stale_report_s``
    sends heartbeats instead, and the health probe must count them, else every worker in such a
    step reads unhealthy and readiness goes to 503 (seen: a 10-s burst prefill on one CPU core)."""

    async def test() -> None:
        router, _ = _router()
        for w in ("a", "b"):
            router.on_message(w, _report(w, seq=1, steps=1))
        stale = router.config.stale_report_s + 1
        entry = router.table["a"]
        entry.report_time -= stale  # the last report is old: a step has run since
        entry.heard_time -= stale
        router.on_message("a", pb.WorkerMessage(heartbeat=pb.StepHeartbeat(step_elapsed_s=stale, step_cpu_s=stale)))
        await router.table.probe(entry)
        assert entry.healthy and router.table.serving(entry)
        entry.heard_time -= stale  # then neither a report nor a heartbeat
        await router.table.probe(entry)
        assert not entry.healthy and not kills

    asyncio.run(test())
