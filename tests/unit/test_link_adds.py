"""Requests added on the WorkerLink (``AddRequests``, issue 41: the router's dispatch without a Ray call).

* The wire form is exact: what the worker reads back equals what the router resolved (sampling as doubles).
* The router sends a worker that takes adds an ``AddRequests`` command, never the Ray call; the ack places the
  requests, its refusals end only their own requests, and a worker that goes down before acking has its
  requests replayed elsewhere, its unacked adds withdrawn from the link's resend log.
* A real ``WorkerCore`` over real gRPC queues them, acks before their first output, and runs them as the Ray
  call's path does (seeded sampling: the same tokens).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvserve.protos.kvserve.v1 import worker_pb2 as pb
from kvserve.router.config import RouterConfig
from kvserve.router.requests.router import Router
from kvserve.router.table.worker_link import _Session
from kvserve.workers.core.add_command import (
    MAX_COMMAND_TOKENS,
    add_commands,
    request_from_proto,
    request_proto,
)
from kvserve.workers.core.request import WorkerRequest
from kvserve.workers.core.sampling_params import SamplingParams
from kvserve.workers.engine.config import EngineConfig
from kvserve.workers.transport.options import WorkerOptions
from kvserve.workers.transport.worker import WorkerCore
from tests.integration.worker_harness import RecordingRouter
from tests.unit.test_liveness import _until
from tests.unit.test_router_failover import FakeWorker, _connect, _identity, _req
from tests.unit.test_worker_data_links import _wait

# ---- the wire form ------------------------------------------------------------------------------------------

REQUESTS = [
    WorkerRequest("a#r.1", (1, 2, 3), SamplingParams()),
    WorkerRequest(
        "b#r.2",
        tuple(range(300)),
        SamplingParams(max_tokens=7, temperature=0.7, top_k=40, top_p=0.9, seed=2**64 - 1, stop=("x", "\n\n"),
                       stop_token_ids=(2, 5), ignore_eos=True, logprobs=0),  # fmt: skip
        priority=-3,
        cache_salt="",
        resume_output_ids=(9, 8),
        owner="10.0.0.1:7000",
        owner_key="k",
        resume_grant=("tok", "b", "tenant", "client"),
    ),
    WorkerRequest("c#r.3", (4,), SamplingParams(temperature=1.3, logprobs=20), priority=5, cache_salt="tenant-a"),
]


def test_a_request_reads_back_equal_field_for_field() -> None:
    for r in REQUESTS:
        wire = pb.AddRequest.FromString(request_proto(r).SerializeToString())
        assert request_from_proto(wire) == r
    # NOTE: float32 (serving.proto's SamplingParams) would read 0.7 back as 0.699999988...
    assert request_from_proto(request_proto(REQUESTS[1])).params.temperature == 0.7


def test_no_salt_and_an_empty_salt_stay_apart() -> None:
    assert request_from_proto(request_proto(REQUESTS[0])).cache_salt is None
    assert request_from_proto(request_proto(REQUESTS[1])).cache_salt == ""


def test_a_burst_of_long_prompts_is_split_in_order() -> None:
    long = [WorkerRequest(f"r{i}", (1,) * (MAX_COMMAND_TOKENS // 3), SamplingParams()) for i in range(7)]
    commands = add_commands(long)
    assert [len(c.requests) for c in commands] == [3, 3, 1]
    assert [m.request_id for c in commands for m in c.requests] == [r.request_id for r in long]
    assert len(add_commands(REQUESTS)) == 1 and add_commands([]) == []


def test_a_text_prompt_is_not_sent() -> None:
    with pytest.raises(TypeError):
        request_proto(WorkerRequest("t", "hello", SamplingParams()))


# ---- the router's side ----------------------------------------------------------------------------------------


def _connect_taking_adds(router: Router, worker_id: str, incarnation: str) -> None:
    """``_connect`` for a worker whose Hello says it takes adds on the link (every real worker's)."""
    s = router.link.sessions.setdefault(worker_id, _Session())
    restarted = bool(s.incarnation) and s.incarnation != incarnation
    if restarted:  # as WorkerLinkService.serve: commands for the old process are moot
        s.unapplied.clear()
    s.incarnation = incarnation
    s.queue = asyncio.Queue()
    blocks = router.table[worker_id].identity.total_blocks
    hello = pb.Hello(worker_id=worker_id, total_blocks=blocks, incarnation=incarnation, takes_adds=True)
    router.on_hello(worker_id, hello, restarted)


def _adds(router: Router, worker_id: str) -> list[pb.RouterCommand]:
    """The add commands sent to ``worker_id`` and not acked yet."""
    s = router.link.sessions[worker_id]
    return [c for c in s.unapplied.values() if c.WhichOneof("command") == "add_requests"]


def _ack(router: Router, worker_id: str, cmd: pb.RouterCommand, refusals: tuple[pb.AddRefusal, ...] = ()) -> None:
    ack = pb.CommandAck(command_seq=cmd.seq, ok=True, refusals=refusals)
    router.link.sessions[worker_id].unapplied.pop(cmd.seq, None)  # as WorkerLinkService._read on an ack
    router.on_message(worker_id, pb.WorkerMessage(ack=ack))


def test_a_worker_that_takes_adds_gets_a_link_command_not_a_ray_call() -> None:
    async def test() -> None:
        router = Router(RouterConfig(port=0))
        worker = FakeWorker()
        router.add_worker("a", worker, _identity("a"))
        _connect_taking_adds(router, "a", "inc-1")
        first = router.submit(_req("r0", max_tokens=4))
        await _until(lambda: _adds(router, "a"), 30)
        (cmd,) = _adds(router, "a")
        assert [m.request_id for m in cmd.add_requests.requests] == [first.worker_rid]
        assert request_from_proto(cmd.add_requests.requests[0]).params == first.params
        burst = [router.submit(_req(f"r{i}", max_tokens=4)) for i in range(1, 5)]
        await asyncio.sleep(0.05)
        assert len(_adds(router, "a")) == 1  # at most one add in flight per worker: the burst waits for it
        assert first.worker_id is None and first.worker_rid in router.dispatcher.adding
        _ack(router, "a", cmd)
        await _until(lambda: len(_adds(router, "a")) == 1 and first.worker_id == "a", 30)
        (second,) = _adds(router, "a")
        assert [m.request_id for m in second.add_requests.requests] == [r.worker_rid for r in burst]
        refusal = pb.AddRefusal(request_id=burst[1].worker_rid, kind="invalid", message="prompt too long here")
        _ack(router, "a", second, (refusal,))
        await _until(lambda: burst[1].finished, 30)
        assert all(r.worker_id == "a" and not r.finished for r in (burst[0], *burst[2:]))
        assert not router.dispatcher.adding and router.dispatcher.link_adds.in_flight("a") == 0
        assert not [c for c in worker.calls if c[0].startswith("add_request")]  # never the Ray call

    asyncio.run(test())


@pytest.mark.parametrize("how", ["down", "restarted"])
def test_adds_unacked_when_the_worker_goes_down_replay_elsewhere_and_are_withdrawn(how: str) -> None:
    async def test() -> None:
        router = Router(RouterConfig(port=0))
        router.add_worker("a", FakeWorker(), _identity("a"))
        _connect_taking_adds(router, "a", "inc-1")
        r = router.submit(_req("r0", max_tokens=4))
        await _until(lambda: _adds(router, "a"), 30)
        (cmd,) = _adds(router, "a")
        b = FakeWorker()  # NOTE: a worker without adds on its link: the Ray call's path
        router.add_worker("b", b, _identity("b"))
        _connect(router, "b", "inc-1")
        if how == "down":
            router.table.down(router.table["a"], "test: its process is gone")
        else:
            _connect_taking_adds(router, "a", "inc-2")  # a new process said Hello: the old one's adds are moot
        await _until(lambda: r.worker_id == "b", 30)
        assert [a[0].request_id for a, _ in b.added()] == [r.worker_rid]
        assert cmd.seq not in router.link.sessions["a"].unapplied  # a link that comes back does not resend it
        assert router.dispatcher.link_adds.in_flight("a") == 0 and not r.finished
        _ack(router, "a", cmd)  # a late ack of the withdrawn add changes nothing
        assert r.worker_id == "b"

    asyncio.run(test())


# ---- the worker's side ---------------------------------------------------------------------------------------


@pytest.fixture
def recording_router() -> Iterator[RecordingRouter]:
    r = RecordingRouter().start()
    yield r
    r.close()


def _tokens(router: RecordingRouter, rid: str) -> list[int]:
    with router.handler.cond:
        return [t for _, o in router.handler.outputs.get(rid, ()) for t in o.new_token_ids]


def _finished(router: RecordingRouter, rid: str) -> bool:
    with router.handler.cond:
        return any(o.finish_reason for _, o in router.handler.outputs.get(rid, ()))


def test_a_worker_queues_link_adds_acks_before_their_first_token_and_runs_them_as_the_ray_call(
    tiny_llama_dir: Path, recording_router: RecordingRouter
) -> None:
    router = recording_router
    core = WorkerCore("w", EngineConfig(model=str(tiny_llama_dir), num_gpu_blocks=256),
                      WorkerOptions(router_address=router.address))  # fmt: skip
    core.start()
    try:
        _wait(lambda: router.handler.hellos, what="the Hello")
        assert router.handler.hellos[-1].hello.takes_adds
        params = SamplingParams(max_tokens=12, temperature=0.7, seed=11, ignore_eos=True)
        by_call = WorkerRequest("by-call", (5, 6, 7, 8), params)
        by_link = WorkerRequest("by-link", (5, 6, 7, 8), params)
        bad = WorkerRequest("bad", (5, 10**6), params)  # a token id past the vocabulary
        core.add_request(by_call)
        (command,) = add_commands([bad, by_link])
        seq = router.send("w", pb.RouterCommand(add_requests=command))
        _wait(lambda: _finished(router, "by-link") and _finished(router, "by-call"), 60, "both requests to finish")
        with router.handler.cond:
            messages = [m for _, m in router.handler.workers["w"].messages]
        kinds = [(m.WhichOneof("body"), m) for m in messages]
        acks = [i for i, (k, m) in enumerate(kinds) if k == "ack" and m.ack.command_seq == seq]
        firsts = [i for i, (k, m) in enumerate(kinds) if k == "step_outputs" and _names(m, "by-link")]
        assert acks and firsts and acks[0] < firsts[0], "the ack must precede the request's first output"
        (refusal,) = kinds[acks[0]][1].ack.refusals
        assert (refusal.request_id, refusal.kind) == ("bad", "invalid")
        assert _tokens(router, "by-link") == _tokens(router, "by-call") and len(_tokens(router, "by-link")) == 12
        assert not router.unapplied("w")  # applied once, acked
    finally:
        core.stop()


def _names(msg: pb.WorkerMessage, rid: str) -> bool:
    out = msg.step_outputs
    return rid in out.columns.request_ids or any(o.request_id == rid for o in out.outputs)

