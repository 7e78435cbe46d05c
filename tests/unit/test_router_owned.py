"""The router's side of owned requests (docs/architecture.md 2a; kvserve/router/requests/owned.py) on fake
workers (no Ray, no gRPC): progress ends a request without a response, unknown owned progress is not
aborted, a replay asks the owner and continues after its Resume (or fails without one), and a restarted
router adopts a worker's RequestTable."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from kvserve.protos.kvserve.v1 import serving_pb2 as spb
from kvserve.protos.kvserve.v1 import worker_pb2 as pb
from kvserve.router.api.grpc_surface import read_generate_stream
from kvserve.router.api.server import KVServeServicer
from kvserve.router.gate.auth import FRONTEND_CREDENTIAL_HEADER
from kvserve.router.observe import metrics
from kvserve.router.requests.mux import StreamMux
from kvserve.router.requests.request import RouterError
from tests.unit.test_router_failover import _commands, _req, _router, _run, _settle

OWNER = spb.Owner(address="127.0.0.1:7000", key="k1")


def _progress(rid: str, total: int, finish: str = "") -> pb.RequestOutput:
    return pb.RequestOutput(request_id=rid, owned=True, num_output_tokens=total, finish_reason=finish,
                            num_prompt_tokens=4)  # fmt: skip


def _owned(router, mux: StreamMux, rid: str = "r1", key: str = "k1"):  # noqa: ANN001, ANN202
    return router.submit(_req(rid), None, mux, spb.Owner(address=OWNER.address, key=key))


def test_progress_ends_an_owned_request_with_no_response_and_its_promise_released() -> None:
    async def test() -> None:
        router, workers = _router()
        mux = StreamMux()
        r = _owned(router, mux)
        await _settle()
        ((added,), _), = [a for w in workers.values() for a in w.added()]
        assert (added.owner, added.owner_key) == (OWNER.address, "k1")
        assert list(mux.take().placed) == ["k1"], "the owner hears that its request is placed"
        entry = router.table[r.worker_id]
        assert r.worker_rid in entry.in_flight
        ttft, e2e, tokens = sum(metrics.TTFT._counts), sum(metrics.E2E._counts), metrics.GENERATION_TOKENS._value
        router._on_output(r.worker_id, _progress(r.worker_rid, 1))
        assert r.first_token_time is not None and r.tokens_received == 1
        assert sum(metrics.TTFT._counts) == ttft + 1, "its first progress is its first token (TTFT)"
        preempted = _progress(r.worker_rid, 3)
        preempted.num_preemptions, preempted.num_swaps = 1, 2
        router._on_output(r.worker_id, preempted)
        assert (r.tokens_received, r.preemptions, r.swaps) == (3, 1, 2)
        router._on_output(r.worker_id, _progress(r.worker_rid, 8, finish="length"))
        assert r.finished and "r1" not in router.requests and "k1" not in router.owned.by_key
        assert sum(metrics.TTFT._counts) == ttft + 1 and sum(metrics.E2E._counts) == e2e + 1
        assert metrics.GENERATION_TOKENS._value == tokens + 8
        batch = mux.take()
        assert not batch.responses and not batch.errors and not batch.columns.request_ids
        assert mux.ended_silently == ["r1"], "the stream's live request must end too"
        assert r.worker_rid not in entry.in_flight

    _run(test)


def test_an_owned_progress_for_an_unknown_id_is_ignored_a_router_owned_output_aborted() -> None:
    async def test() -> None:
        router, _ = _router()
        router._on_output("a", _progress("gone#x.1", 3))
        assert not any(c.HasField("abort") for c in _commands(router, "a"))
        router._on_output("a", pb.RequestOutput(request_id="gone#x.2", new_token_ids=[5], num_output_tokens=1))
        assert [c.abort.request_id for c in _commands(router, "a")] == ["gone#x.2"]

    _run(test)


def test_a_replay_asks_the_owner_and_continues_after_its_resume() -> None:
    async def test() -> None:
        router, workers = _router()
        mux = StreamMux()
        r = _owned(router, mux)
        await _settle()
        mux.take()
        src = r.worker_id
        dst = "b" if src == "a" else "a"
        router._on_output(src, _progress(r.worker_rid, 1))
        router.on_disconnect(src)
        await _settle()
        assert list(mux.take().replays) == ["k1"] and not workers[dst].added(), "no replay before the Resume"
        assert router.owned.resume("k1", [10, 11, 12])
        await _settle()
        ((added,), _), = workers[dst].added()
        assert added.resume_output_ids == (10, 11, 12) and added.owner_key == "k1"
        assert r.tokens_received == 3 and r.replays == 1
        assert not router.owned.resume("k1", [10]), "a second answer continues nothing"

    _run(test)


def test_without_a_resume_the_request_fails_unavailable() -> None:
    async def test() -> None:
        router, _ = _router()
        router.owned.resume_timeout_s = 0.0  # NOTE: fires on the next loop turn: no sleep to wait for it
        mux = StreamMux()
        r = _owned(router, mux)
        await _settle()
        router.on_disconnect(r.worker_id)
        await _settle()
        errors = list(mux.take().errors)
        assert [(e.request_id, e.code) for e in errors] == [("r1", grpc.StatusCode.UNAVAILABLE.value[0])]
        assert r.finished and "k1" not in router.owned.by_key

    _run(test)


def test_a_restarted_router_adopts_a_workers_owned_requests() -> None:
    async def test() -> None:
        router, workers = _router()
        sampling = spb.SamplingParams(max_tokens=8, temperature=0.7, seed=5)
        table = pb.RequestTable(requests=[pb.OwnedRequest(
            request_id="old#dead.3", owner=OWNER.address, owner_key="k9", prompt_ids=[1, 2, 3, 4], sampling=sampling,
            num_output_tokens=2)])  # fmt: skip
        router._on_output("a", _progress("old#dead.3", 2))  # before the table: ignored, not aborted
        router.on_message("a", pb.WorkerMessage(request_table=table))
        r = router.requests["old"]
        assert (r.worker_id, r.worker_rid, r.owner_key, r.tokens_received) == ("a", "old#dead.3", "k9", 2)
        assert r.params.max_tokens == 8 and r.params.seed == 5
        router.on_message("a", pb.WorkerMessage(request_table=table))  # a second connect: adopted once
        assert len(router.owned.by_key) == 1
        router._on_output("a", _progress("old#dead.3", 8, finish="length"))
        assert r.finished and "old" not in router.requests
        assert not any(c.HasField("abort") for c in _commands(router, "a"))
        assert not workers["a"].added() and not workers["b"].added()

    _run(test)


def _table(key: str = "k9", total: int = 2) -> pb.RequestTable:
    sampling = spb.SamplingParams(max_tokens=8, temperature=0.7, seed=5)
    return pb.RequestTable(requests=[pb.OwnedRequest(
        request_id="old#dead.3", owner=OWNER.address, owner_key=key, prompt_ids=[1, 2, 3, 4], sampling=sampling,
        num_output_tokens=total)])  # fmt: skip


def test_an_adopted_request_counts_on_its_worker_and_its_notices_go_to_its_owners_latest_stream() -> None:
    async def test() -> None:
        router, workers = _router()
        router.owned.resume_timeout_s = 0.0
        router.on_message("a", pb.WorkerMessage(request_table=_table()))
        r = router.requests["old"]
        entry = router.table["a"]
        assert entry.in_flight.get("old#dead.3") == 0 and "old#dead.3" in entry.started, "a dispatch there, started"
        first, latest = StreamMux(), StreamMux()
        router.owned.announce(OWNER.address, first)
        router.owned.announce(OWNER.address, latest)  # NOTE: the frontend re-opened its stream: the latest counts
        router.on_disconnect("a")
        await _settle()  # NOTE: the owner does not answer (the timeout fires within): it fails there, under its key
        batch = latest.take()
        assert list(batch.replays) == ["k9"] and not first.take().replays
        assert [(e.request_id, e.code) for e in batch.errors] == [("k9", grpc.StatusCode.UNAVAILABLE.value[0])]
        assert not workers["b"].added(), "no replay without the Resume"
        assert r.finished and "old" not in router.requests and not router.owned.by_key

    _run(test)


def test_an_adopted_request_resumed_by_its_owner_continues_on_another_worker() -> None:
    async def test() -> None:
        router, workers = _router()
        router.on_message("a", pb.WorkerMessage(request_table=_table()))
        mux = StreamMux()
        router.owned.announce(OWNER.address, mux)
        r = router.requests["old"]
        router.on_disconnect("a")
        await _settle()
        assert list(mux.take().replays) == ["k9"]
        assert router.owned.resume("k9", [7, 8])
        await _settle()
        ((added,), _), = workers["b"].added()
        assert added.request_id.startswith("old#") and added.request_id != "old#dead.3"
        assert added.resume_output_ids == (7, 8) and (added.owner, added.owner_key) == (OWNER.address, "k9")
        assert list(mux.take().placed) == ["k9"], "placed again: told on the owner's stream"
        router._on_output("b", _progress(added.request_id, 8, finish="stop"))
        assert r.finished and "old" not in router.requests

    _run(test)


async def _messages(*msgs: spb.GenerateStreamRequest):  # noqa: ANN202
    for m in msgs:
        yield m


def test_the_stream_handler_honours_owner_and_resume_only_on_a_frontend_stream() -> None:
    async def test() -> None:
        router, workers = _router()
        servicer = KVServeServicer(router)
        untrusted = StreamMux()
        owned = spb.GenerateStreamRequest(generate=_req("o1"), owner=OWNER)
        await servicer._read_requests(_messages(owned, spb.GenerateStreamRequest(generate=_req("plain"))), untrusted,
                                      {}, ("peer", None, False))  # fmt: skip
        await _settle()
        errors = list(untrusted.take().errors)
        assert [(e.request_id, e.code) for e in errors] == [("o1", grpc.StatusCode.PERMISSION_DENIED.value[0])]
        assert "plain" in router.requests, "the stream goes on"
        assert [a.owner for w in workers.values() for (a,), _ in w.added()] == [""]
        resume = spb.GenerateStreamRequest(resume=spb.Resume(owner_key="k1", output_ids=[1]))
        try:
            await servicer._read_requests(_messages(resume), StreamMux(), {}, ("peer", None, False))
            raise AssertionError("a resume on a client's stream was taken")
        except RouterError as e:
            assert e.code == grpc.StatusCode.PERMISSION_DENIED

        trusted = StreamMux()
        live: dict = {}
        await servicer._read_requests(_messages(owned), trusted, live, ("peer", None, True))
        await _settle()
        r = live["o1"]
        assert (r.owner, r.owner_key) == (OWNER.address, "k1") and router.owned.owners[OWNER.address] is trusted
        src = r.worker_id
        router.on_disconnect(src)
        await _settle()
        assert list(trusted.take().replays) == ["k1"]
        again = StreamMux()  # NOTE: its re-opened stream names its owner, then answers the replay there
        hello = spb.GenerateStreamRequest(owner=spb.Owner(address=OWNER.address))
        resume = spb.GenerateStreamRequest(resume=spb.Resume(owner_key="k1", output_ids=[9, 9]))
        await servicer._read_requests(_messages(hello, resume), again, {}, ("peer", None, True))
        await _settle()
        assert router.owned.owners[OWNER.address] is again
        (added,) = [a for (a,), _ in workers["b" if src == "a" else "a"].added() if a.owner_key == "k1"]
        assert added.resume_output_ids == (9, 9) and r.worker_rid == added.request_id

    _run(test)


def test_a_frontends_own_clients_may_not_send_resume_or_owner() -> None:
    async def test() -> None:
        async def submit(rid: str, msg: spb.GenerateStreamRequest) -> None:
            raise AssertionError("not a request")

        for msg in (spb.GenerateStreamRequest(resume=spb.Resume(owner_key="k", output_ids=[1])),
                    spb.GenerateStreamRequest(owner=spb.Owner(address="10.0.0.1:1"))):  # fmt: skip
            try:
                await read_generate_stream(_messages(msg), StreamMux(), {}, submit, lambda r: None, columns=False)
                raise AssertionError(f"{msg} was taken")
            except RouterError as e:
                assert e.code == grpc.StatusCode.INVALID_ARGUMENT

    _run(test)


def test_a_replay_notice_waits_for_its_owners_stream_and_is_dropped_once_its_request_ended() -> None:
    async def test() -> None:
        router, _ = _router()
        router.on_message("a", pb.WorkerMessage(request_table=_table("k9")))
        router.on_message("b", pb.WorkerMessage(request_table=pb.RequestTable(requests=[pb.OwnedRequest(
            request_id="new#dead.4", owner=OWNER.address, owner_key="k8", prompt_ids=[1, 2, 3, 4],
            sampling=spb.SamplingParams(max_tokens=8), num_output_tokens=1)])))  # fmt: skip
        router.on_disconnect("a")  # NOTE: no stream of its owner yet (a restarted router before it re-opened)
        router.on_disconnect("b")
        await _settle()
        router.lifecycle.cancel(router.requests["new"])  # NOTE: ended while its notice waited
        mux = StreamMux()
        router.owned.announce(OWNER.address, mux)
        assert list(mux.take().replays) == ["k9"], "only the live request's notice, once its owner's stream is here"

    _run(test)


def test_a_frontend_cancels_an_adopted_request_by_its_key_on_its_own_stream_only() -> None:
    async def test() -> None:
        router, _ = _router()
        servicer = KVServeServicer(router)
        router.on_message("a", pb.WorkerMessage(request_table=_table("k9")))
        r = router.requests["old"]
        cancel = spb.GenerateStreamRequest(cancel_request_id="k9")
        await servicer._read_requests(_messages(cancel), StreamMux(), {}, ("peer", None, False))  # a client's
        other = spb.GenerateStreamRequest(owner=spb.Owner(address="127.0.0.1:7001"))  # another frontend's stream
        await servicer._read_requests(_messages(other, cancel), StreamMux(), {}, ("peer", None, True))
        assert not r.finished and not any(c.HasField("abort") for c in _commands(router, "a"))
        mine = StreamMux()
        hello = spb.GenerateStreamRequest(owner=spb.Owner(address=OWNER.address))
        await servicer._read_requests(_messages(hello, cancel), mine, {}, ("peer", None, True))
        assert r.finished and "old" not in router.requests and not router.owned.by_key
        assert [c.abort.request_id for c in _commands(router, "a") if c.HasField("abort")] == ["old#dead.3"]
        assert [(e.request_id, e.code) for e in mine.take().errors] == [("k9", grpc.StatusCode.CANCELLED.value[0])]

    _run(test)


def test_cold_capacity_counts_an_owned_requests_progress_as_generated() -> None:
    async def test() -> None:
        router, _ = _router()
        seen: list[tuple[int, ...]] = []
        router.table.cold_capacity = lambda remaining: seen.append(remaining)  # type: ignore[method-assign]
        r = _owned(router, StreamMux())
        await _settle()
        router._on_output(r.worker_id, _progress(r.worker_rid, 6))
        router.queue.cold_capacity()
        assert seen == [(2,)], "8 max tokens, 6 generated (its client's tokens never pass the router)"

    _run(test)


def test_a_resume_counts_only_on_the_requests_own_stream_or_its_owners_latest() -> None:
    async def test() -> None:
        router, workers = _router()
        servicer = KVServeServicer(router)
        mux = StreamMux()
        r = _owned(router, mux)
        await _settle()
        src = r.worker_id
        router.on_disconnect(src)
        await _settle()
        assert list(mux.take().replays) == ["k1"]
        resume = spb.GenerateStreamRequest(resume=spb.Resume(owner_key="k1", output_ids=[5]))
        other = spb.GenerateStreamRequest(owner=spb.Owner(address="127.0.0.1:7001"))  # another frontend's stream
        await servicer._read_requests(_messages(other, resume), StreamMux(), {}, ("peer", None, True))
        await _settle()
        assert not [a for w in workers.values() for (a,), _ in w.added() if a.resume_output_ids], "not its owner"
        await servicer._read_requests(_messages(resume), mux, {}, ("peer", None, True))  # NOTE: its own stream
        await _settle()
        (added,) = [a for w in workers.values() for (a,), _ in w.added() if a.resume_output_ids]
        assert added.resume_output_ids == (5,) and r.worker_rid == added.request_id

    _run(test)


def test_an_owner_without_an_address_is_refused() -> None:
    async def test() -> None:
        router, workers = _router()
        mux = StreamMux()
        keyless = spb.GenerateStreamRequest(generate=_req("o1"), owner=spb.Owner(key="k1"))
        await KVServeServicer(router)._read_requests(_messages(keyless), mux, {}, ("peer", None, True))
        await _settle()
        errors = [(e.request_id, e.code) for e in mux.take().errors]
        assert errors == [("o1", grpc.StatusCode.INVALID_ARGUMENT.value[0])]
        assert not any(w.added() for w in workers.values())

    _run(test)


class _Context:
    """What GenerateStream reads of its ``grpc.aio.ServicerContext``."""

    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self.metadata = metadata

    def time_remaining(self) -> None:
        return None

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self.metadata

    def peer(self) -> str:
        return "ipv4:10.0.0.9:5000"

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise AssertionError(f"aborted {code}: {details}")


async def _queued(q: asyncio.Queue) -> AsyncIterator[spb.GenerateStreamRequest]:
    while (msg := await q.get()) is not None:
        yield msg


async def _placed_pair(router, sent: asyncio.Queue, stream):  # noqa: ANN001, ANN202
    """Send k1 and k2 (owned by OWNER) and read until both are placed."""
    sent.put_nowait(spb.GenerateStreamRequest(generate=_req("k1"), owner=OWNER))
    sent.put_nowait(spb.GenerateStreamRequest(generate=_req("k2"), owner=spb.Owner(address=OWNER.address,
                                                                                     key="k2")))  # fmt: skip
    placed: list[str] = []
    while len(placed) < 2:  # NOTE: a batch carrying only placed is sent (no response, no error in it)
        batch = await asyncio.wait_for(stream.__anext__(), 10)  # NOTE: a bound, so a lost batch fails, not hangs
        assert not batch.responses and not batch.errors
        placed.extend(batch.placed)
    assert sorted(placed) == ["k1", "k2"]
    return router.requests["k1"], router.requests["k2"]


def _aborts(router, r) -> list[str]:  # noqa: ANN001
    return [c.abort.request_id for c in _commands(router, r.worker_id) if c.HasField("abort")]


def test_the_real_stream_handler_answers_placed_ends_an_owned_request_silently_and_its_end_cancels_after_a_grace(
) -> None:  # fmt: skip
    async def test() -> None:
        router, _ = _router()
        router.owned.owner_grace_s = 0.2
        servicer = KVServeServicer(router, frontend_key="fk")
        sent: asyncio.Queue = asyncio.Queue()
        stream = servicer.GenerateStream(_queued(sent), _Context(((FRONTEND_CREDENTIAL_HEADER, "fk"),)))
        one, two = await _placed_pair(router, sent, stream)
        router._on_output(one.worker_id, _progress(one.worker_rid, 8, finish="stop"))
        assert one.finished and not two.finished
        await stream.aclose()  # NOTE: the frontend's stream ended and it never comes back
        assert not two.finished and _aborts(router, two) == [], "a placed owned request outlives its stream"
        for _ in range(300):
            if two.finished:
                break
            await asyncio.sleep(0.01)
        assert two.finished and two.cancelled and "k2" not in router.owned.by_key, "the grace ended: cancelled"
        assert _aborts(router, two) == [two.worker_rid], "its worker stops it (one abort: the finished one needs none)"

    _run(test)


def test_an_owner_that_reopens_its_stream_within_the_grace_keeps_its_requests_and_may_cancel_them() -> None:
    async def test() -> None:
        router, _ = _router()
        router.owned.owner_grace_s = 0.2
        servicer = KVServeServicer(router, frontend_key="fk")
        sent: asyncio.Queue = asyncio.Queue()
        md = ((FRONTEND_CREDENTIAL_HEADER, "fk"),)
        stream = servicer.GenerateStream(_queued(sent), _Context(md))
        one, two = await _placed_pair(router, sent, stream)
        await stream.aclose()  # NOTE: the stream broke; the frontend re-opens it at once and announces itself
        again: asyncio.Queue = asyncio.Queue()
        reopened = servicer.GenerateStream(_queued(again), _Context(md))
        again.put_nowait(spb.GenerateStreamRequest(owner=spb.Owner(address=OWNER.address)))
        nxt = asyncio.ensure_future(reopened.__anext__())
        for _ in range(100):
            if router.owned.owners.get(OWNER.address) is not None:
                break
            await asyncio.sleep(0.01)
        assert router.owned.owners.get(OWNER.address) is not None, "the announce was not read"
        await asyncio.sleep(0.4)  # NOTE: past the grace on purpose: nothing may end them now
        assert not one.finished and not two.finished and _aborts(router, one) == _aborts(router, two) == []
        router._on_output(one.worker_id, _progress(one.worker_rid, 8, finish="length"))
        assert one.finished and not one.cancelled, "its progress still ends it"
        again.put_nowait(spb.GenerateStreamRequest(cancel_request_id="k2"))  # NOTE: its client's cancel
        batch = await asyncio.wait_for(nxt, 10)
        assert [(e.request_id, e.code) for e in batch.errors] == [("k2", grpc.StatusCode.CANCELLED.value[0])]
        assert two.finished and two.cancelled and _aborts(router, two) == [two.worker_rid]
        again.put_nowait(None)
        await reopened.aclose()

    _run(test)
