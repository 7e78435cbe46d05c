"""Router failure handling on fake workers (no Ray, no gRPC): failover replay, the migration
limit, per-dispatch worker ids, crash-loop retirement, the slow-consumer bound, orphans of a
previous router, and deadline expiry in the queue."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import grpc
from prometheus_client import REGISTRY

from kvserve.protos.kvserve.v1 import serving_pb2 as spb
from kvserve.protos.kvserve.v1 import worker_pb2 as pb
from kvserve.router.config import RouterConfig
from kvserve.router.requests.request import RouterError
from kvserve.router.requests.router import WORKER_DOWN, WORKER_RETIRED, WORKER_UP, Router
from kvserve.router.table.worker_link import _Session
from kvserve.workers.core.identity import WorkerIdentity


class _Method:
    def __init__(self, calls: list, name: str) -> None:
        self.calls, self.name = calls, name

    def remote(self, *args: Any, **kwargs: Any) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        if self.name == "add_requests":  # the router's batched dispatch: recorded as one add_request each
            self.calls.extend(("add_request", (request,), {}) for request in args[0])
            fut.set_result([None] * len(args[0]))
            return fut
        self.calls.append((self.name, args, kwargs))
        fut.set_result(None)
        return fut


class FakeWorker:
    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple, dict]] = []

    def __getattr__(self, name: str) -> _Method:
        return _Method(self.calls, name)

    def added(self) -> list[tuple[tuple, dict]]:
        return [(a, k) for n, a, k in self.calls if n == "add_request"]


def _identity(worker_id: str) -> WorkerIdentity:
    return WorkerIdentity(worker_id, "m", block_size=16, total_blocks=32, max_model_len=256, vocab_size=100)


def _router(**config: Any) -> tuple[Router, dict[str, FakeWorker]]:
    router = Router(RouterConfig(port=0, **config))
    workers = {w: FakeWorker() for w in ("a", "b")}
    for w, handle in workers.items():
        router.add_worker(w, handle, _identity(w))
        _connect(router, w, "inc-1")
    return router, workers


def _connect(router: Router, worker_id: str, incarnation: str) -> None:
    """What WorkerLinkService.Connect does on a Hello (without the stream)."""
    s = router.link.sessions.setdefault(worker_id, _Session())
    restarted = bool(s.incarnation) and s.incarnation != incarnation
    s.incarnation = incarnation
    s.queue = asyncio.Queue()
    router.on_hello(worker_id, pb.Hello(worker_id=worker_id, total_blocks=32, incarnation=incarnation), restarted)


def _worker_up(worker_id: str) -> float:
    return REGISTRY.get_sample_value("kvserve:worker_up", {"worker": worker_id})


def _out(rid: str, tokens: list[int], total: int, finish: str = "") -> pb.RequestOutput:
    return pb.RequestOutput(request_id=rid, new_token_ids=tokens, num_output_tokens=total, finish_reason=finish)


def _req(request_id: str = "r1", max_tokens: int = 8) -> spb.GenerateRequest:
    return spb.GenerateRequest(
        request_id=request_id,
        token_ids=spb.TokenIds(ids=[1, 2, 3, 4]),
        sampling=spb.SamplingParams(max_tokens=max_tokens, temperature=0.7, seed=5),
    )


def _run(test: Callable[[], Any]) -> None:
    asyncio.run(test())


async def _settle() -> None:
    # NOTE: enough loop turns for a dispatch under asyncio.wait_for, and a link-loss check, to finish.
    for _ in range(20):
        await asyncio.sleep(0)


def _drain(q: asyncio.Queue) -> list:
    out = []
    while not q.empty():
        out.append(q.get_nowait())
    return out


def _commands(router: Router, worker_id: str) -> list[pb.RouterCommand]:
    return list(router.link.sessions[worker_id].unapplied.values())


def test_replay_continues_on_another_worker_after_the_streamed_tokens() -> None:
    async def test() -> None:
        router, workers = _router()
        r = router.submit(_req())
        await _settle()
        src = r.worker_id
        assert src is not None
        dst = "b" if src == "a" else "a"
        first_rid = r.worker_rid
        router._on_output(src, _out(first_rid, [10, 11], 2))
        router.on_disconnect(src)
        await _settle()
        assert router.table[src].state == WORKER_DOWN
        assert _worker_up(src) == 0.0
        ((added,), _), = workers[dst].added()
        assert added.request_id != first_rid and added.request_id.startswith("r1#")
        assert added.resume_output_ids == (10, 11)
        assert added.params.max_tokens == 8 and added.params.seed == 5  # the same params: the whole budget
        assert r.worker_id == dst
        router._on_output(src, _out(first_rid, [12], 3))  # the dead dispatch's late output: dropped
        router._on_output(dst, _out(r.worker_rid, [12], 3))
        router._on_output(dst, _out(r.worker_rid, [13], 4, finish="length"))
        got = _drain(r.responses)
        assert [t for resp in got for t in resp.token_ids] == [10, 11, 12, 13]
        assert got[-1].num_replays == 1 and got[-1].num_migrations == 1
        assert router.replays_total == 1 and "r1" not in router.requests
        # The old dispatch is aborted on its worker, should it ever come back with that process.
        assert any(c.abort.request_id == first_rid for c in _commands(router, src))
        _connect(router, src, "inc-2")  # its new incarnation says Hello: up again
        assert router.table[src].state == WORKER_UP and _worker_up(src) == 1.0
        assert router.cluster_status().router.replays_total == 1

    _run(test)


def test_beyond_the_migration_limit_the_client_gets_unavailable() -> None:
    async def test() -> None:
        router, _ = _router(migration_limit=1)
        r = router.submit(_req())
        await _settle()
        first = r.worker_id
        router.on_disconnect(first)
        await _settle()
        second = r.worker_id
        assert second not in (None, first)
        router.on_disconnect(second)
        await _settle()  # the link-loss check finds its process replaced (the fake says no incarnation)
        (err,) = _drain(r.responses)
        assert isinstance(err, RouterError) and err.code == grpc.StatusCode.UNAVAILABLE
        assert "migration limit 1" in err.message

    _run(test)


def test_a_finished_or_cancelled_id_is_reusable_at_once_and_its_late_outputs_are_dropped() -> None:
    async def test() -> None:
        router, _ = _router()
        r = router.submit(_req("same"))
        await _settle()
        old_rid, wid = r.worker_rid, r.worker_id
        router.lifecycle.cancel(r)
        assert any(c.abort.request_id == old_rid for c in _commands(router, wid))
        r2 = router.submit(_req("same"))
        await _settle()
        assert r2.worker_rid != old_rid
        router._on_output(wid, _out(old_rid, [1], 1, finish="abort"))  # the echo of the first abort
        assert r2.responses.empty() and not r2.finished

    _run(test)


def test_a_crash_looping_worker_is_retired(monkeypatch) -> None:  # noqa: ANN001
    import ray

    kills: list[tuple[Any, bool]] = []
    monkeypatch.setattr(ray, "kill", lambda handle, no_restart=True: kills.append((handle, no_restart)))

    async def test() -> None:
        router, workers = _router(worker_restart_limit=1, worker_restart_window_s=600)
        _connect(router, "a", "inc-2")
        assert router.table["a"].state == WORKER_UP and router.table["a"].restarts_total == 1
        _connect(router, "a", "inc-3")
        assert router.table["a"].state == WORKER_RETIRED
        assert kills == [(workers["a"], True)], "a retired worker must be killed for good (no_restart)"
        st = router.cluster_status()
        a = next(w for w in st.workers if w.worker_id == "a")
        assert (a.state, a.healthy, a.restarts_total) == ("retired", False, 2)
        _connect(router, "a", "inc-4")  # a Hello from it still does not bring it back
        assert router.table["a"].state == WORKER_RETIRED

    _run(test)


def test_a_client_that_stops_reading_is_aborted_resource_exhausted() -> None:
    async def test() -> None:
        router, _ = _router(max_buffered_responses=2)
        r = router.submit(_req(max_tokens=20))
        await _settle()
        for i in range(3):
            router._on_output(r.worker_id, _out(r.worker_rid, [i], i + 1))
        (err,) = _drain(r.responses)  # the unread responses are dropped: memory stays bounded
        assert isinstance(err, RouterError) and err.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert r.finished and any(c.abort.request_id == r.worker_rid for c in _commands(router, r.worker_id))

    _run(test)


def test_outputs_of_a_previous_routers_requests_are_aborted() -> None:
    async def test() -> None:
        router, _ = _router()
        router._on_output("a", _out("old#deadbeef.7", [1], 1))
        router._on_output("a", _out("old#deadbeef.7", [2], 2))  # the next step's: no second abort
        assert [c.abort.request_id for c in _commands(router, "a")] == ["old#deadbeef.7"]

    _run(test)


def test_a_queued_request_past_its_deadline_leaves_the_queue_deadline_exceeded() -> None:
    remaining = 0.05

    async def test() -> None:
        router, workers = _router()
        for w in ("a", "b"):  # both pools full: the request queues
            router.table[w].report = pb.PressureReport(seq=1, total_blocks=32, free_blocks=0, used_blocks=32)
        r = router.submit(_req(), time_remaining_s=remaining)
        assert len(router.queue) == 1
        err = await asyncio.wait_for(r.responses.get(), timeout=5)
        assert isinstance(err, RouterError) and err.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert len(router.queue) == 0 and not any(w.added() for w in workers.values())

    _run(test)


def test_outputs_count_only_from_the_worker_the_dispatch_is_on(caplog) -> None:
    """A worker (a compromised one, or one confused about its requests) cannot write into a stream
    placed on another: its outputs for that dispatch are dropped, logged once per worker."""

    async def test() -> None:
        router, _ = _router()
        r = router.submit(_req(max_tokens=3))
        await _settle()
        on, other = r.worker_id, ("b" if r.worker_id == "a" else "a")
        assert on is not None and r.dispatch_workers == {on}
        with caplog.at_level("WARNING", logger="kvserve.router.requests.dispatch"):
            router._on_output(other, _out(r.worker_rid, [66, 66], 2))
            router._on_output(other, _out(r.worker_rid, [66, 66, 66], 3, finish="length"))
        assert _drain(r.responses) == [] and not r.finished
        assert sum("sent output for" in m for m in caplog.messages) == 1
        router._on_output(on, _out(r.worker_rid, [10, 11], 2))
        router._on_output(on, _out(r.worker_rid, [12], 3, finish="length"))
        got = _drain(r.responses)
        assert [t for resp in got for t in resp.token_ids] == [10, 11, 12]
        assert {resp.worker_id for resp in got} == {on}

    _run(test)


def test_a_report_names_the_sending_worker_whatever_it_claims() -> None:
    """Metric labels come from the authenticated link, not from the worker's own words."""

    async def test() -> None:
        router, _ = _router()
        claimed = "b" * 200
        router.on_message("a", pb.WorkerMessage(seq=1, step=pb.StepMessages(pressure=pb.PressureReport(
            worker_id=claimed, seq=1, total_blocks=32, free_blocks=7, used_blocks=25))))  # fmt: skip
        assert router.table["a"].report.worker_id == "a"
        assert REGISTRY.get_sample_value("kvserve:kv_blocks_free", {"worker": "a"}) == 7
        assert REGISTRY.get_sample_value("kvserve:kv_blocks_free", {"worker": claimed}) is None

    _run(test)


def test_a_replay_that_meets_a_full_queue_waits_at_the_head_of_its_class() -> None:
    """The queue's bounds refuse newcomers, not a stream the cluster accepted: a replay whose
    worker died while every other pool is full and the queue is at its bound queues first in its
    priority class (not UNAVAILABLE), and is the first placed when blocks free."""

    async def test() -> None:
        router, workers = _router(max_queue_requests=1)
        r1 = router.submit(_req("r1"))
        await _settle()
        src = r1.worker_id
        assert src is not None
        dst = "b" if src == "a" else "a"
        router._on_output(src, _out(r1.worker_rid, [10, 11], 2))
        router.table[dst].report = pb.PressureReport(seq=1, total_blocks=32, free_blocks=0, used_blocks=32)
        router.table[src].report = pb.PressureReport(seq=1, total_blocks=32, free_blocks=0, used_blocks=32)
        r2 = router.submit(_req("r2"))
        assert [q.request_id for q in router.queue] == ["r2"]  # the queue is at its bound now
        router.on_disconnect(src)
        await _settle()
        assert router.table[src].state == WORKER_DOWN
        got = _drain(r1.responses)
        assert not any(isinstance(g, RouterError) for g in got) and not r1.finished, f"replay refused: {got}"
        assert [t for g in got for t in g.token_ids] == [10, 11]
        assert [q.request_id for q in router.queue] == ["r1", "r2"]
        router.on_message(dst, pb.WorkerMessage(step=pb.StepMessages(pressure=pb.PressureReport(
            seq=2, total_blocks=32, free_blocks=32, used_blocks=0))))  # fmt: skip
        await _settle()
        ((added, *_), _) = workers[dst].added()[0]
        assert added.request_id.startswith("r1#") and added.resume_output_ids == (10, 11)
        assert r1.worker_id == dst and r1.replays == 1 and not r2.finished

    _run(test)
