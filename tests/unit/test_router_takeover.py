"""A client resuming through another frontend, the router's side (docs/architecture.md 2a "Resuming through another
frontend"; kvserve/router/requests/takeover.py) on fake workers: a take-over that matches moves the request to the
new owner and sends its worker a Reown (placed on the ack); one that does not match in any way is refused NOT_FOUND
and changes nothing; the old owner's grace and stream no longer reach a moved request; a request that finished
while its owner was gone can be taken over once."""

from __future__ import annotations

import grpc

from kvserve.protos.kvserve.v1 import serving_pb2 as spb
from kvserve.protos.kvserve.v1 import worker_pb2 as pb
from kvserve.router.api.server import KVServeServicer
from kvserve.router.gate.prompts import prompt_ids
from kvserve.router.gate.validation import ModelLimits, ValidationError
from kvserve.router.requests.mux import StreamMux
from kvserve.router.requests.request import RouterError
from kvserve.router.requests.takeover import ResumeGrant
from tests.unit.test_router_failover import _commands, _req, _run, _settle
from tests.unit.test_router_failover import _router as _failover_router
from tests.unit.test_router_owned import OWNER, _messages, _owned, _progress

TOKEN = "ab" * 16
NEW = "127.0.0.1:7001"


def _kept_request():  # noqa: ANN202
    """An owned, placed request with a grant whose owner's stream ended (it died): kept for the grace."""
    router, _ = _failover_router()
    mux = StreamMux()
    r = _owned(router, mux, rid="k1", key="k1")
    router.owned.takeovers.grant(r, ResumeGrant(TOKEN, "client-7", "alpha", "10.0.0.1"))
    return router, mux, r


def _take(router, new: StreamMux, token: str = TOKEN, rid: str = "client-7", tenant: str = "alpha",  # noqa: ANN001
          client: str = "10.0.0.1", key: str = "k2") -> None:  # fmt: skip
    msg = spb.TakeOver(request_id=rid, token=token, owner=spb.Owner(address=NEW, key=key))
    router.owned.takeovers.take_over(msg, tenant, client, new)


def _reowns(router, worker_id: str) -> list[pb.Reown]:  # noqa: ANN001
    return [c.reown for c in _commands(router, worker_id) if c.HasField("reown")]


def test_a_matching_take_over_moves_the_request_and_its_worker_streams_to_the_new_owner_on_the_ack() -> None:
    async def test() -> None:
        router, mux, r = _kept_request()
        await _settle()
        assert list(mux.take().placed) == ["k1"]
        assert router.owned.stream_ended(mux, [r]) == [], "placed and owned: kept for its owner's grace"
        new = StreamMux()
        _take(router, new)
        assert (r.owner, r.owner_key) == (NEW, "k2") and router.owned.by_key == {"k2": r}
        (reown,) = _reowns(router, r.worker_id)
        assert (reown.request_id, reown.owner.address, reown.owner.key) == (r.worker_rid, NEW, "k2")
        assert not new.take().placed, "placed only once the worker streams to the new owner"
        (seq,) = [c.seq for c in _commands(router, r.worker_id) if c.HasField("reown")]
        router.on_message(r.worker_id, pb.WorkerMessage(ack=pb.CommandAck(command_seq=seq, ok=True)))
        assert list(new.take().placed) == ["k2"]
        # the old owner's grace ending cancels what it kept, never a request taken over from it
        router.owned._grace_over(OWNER.address)
        assert not r.finished and not r.cancelled
        # its finish now is read by its new owner (alive): no second take-over
        router._on_output(r.worker_id, _progress(r.worker_rid, 9, finish="length"))
        assert r.finished
        again = StreamMux()
        _take(router, again, key="k3")
        (err,) = again.take().errors
        assert (err.request_id, err.code) == ("k3", grpc.StatusCode.NOT_FOUND.value[0])

    _run(test)


def test_a_take_over_that_does_not_match_is_refused_and_changes_nothing() -> None:
    async def test() -> None:
        router, mux, r = _kept_request()
        await _settle()
        router.owned.stream_ended(mux, [r])
        wrong = {"token": "cd" * 16, "rid": "client-8", "tenant": "beta", "client": "10.0.0.2"}
        for field, value in wrong.items():
            new = StreamMux()
            _take(router, new, **{field: value}, key=f"x-{field}")  # type: ignore[arg-type]
            (err,) = new.take().errors
            assert (err.request_id, err.code) == (f"x-{field}", grpc.StatusCode.NOT_FOUND.value[0]), field
            assert "token" in err.message and TOKEN not in err.message
        assert (r.owner, r.owner_key) == (OWNER.address, "k1") and router.owned.by_key == {"k1": r}
        assert not _reowns(router, r.worker_id), "nothing reached the worker"
        assert router.owned.takeovers.refused == 4 and router.owned.takeovers.moved == 0
        # and the owner's grace still applies to it (nothing was moved)
        router.owned._grace_over(OWNER.address)
        assert r.cancelled

    _run(test)


def test_a_request_that_finished_while_its_owner_was_gone_can_be_taken_over_once() -> None:
    async def test() -> None:
        router, mux, r = _kept_request()
        await _settle()
        router.owned.stream_ended(mux, [r])
        worker_id, worker_rid = r.worker_id, r.worker_rid
        router._on_output(worker_id, _progress(worker_rid, 9, finish="length"))
        assert r.finished and not router.owned.by_key
        _take(router, StreamMux(), tenant="beta")  # NOTE: its grant still binds it
        assert not _reowns(router, worker_id)
        new = StreamMux()
        _take(router, new)
        (reown,) = _reowns(router, worker_id)
        assert (reown.request_id, reown.owner.key) == (worker_rid, "k2")
        (seq,) = [c.seq for c in _commands(router, worker_id) if c.HasField("reown")]
        router.on_message(worker_id, pb.WorkerMessage(ack=pb.CommandAck(command_seq=seq, ok=False)))
        (err,) = new.take().errors
        assert err.code == grpc.StatusCode.NOT_FOUND.value[0], "the worker no longer had it: NOT_FOUND, no hang"
        again = StreamMux()
        _take(router, again, key="k3")
        assert again.take().errors[0].code == grpc.StatusCode.NOT_FOUND.value[0], "one take-over uses it up"

    _run(test)


def test_a_request_not_placed_or_waiting_for_a_replay_is_not_moved() -> None:
    async def test() -> None:
        router, mux, r = _kept_request()
        await _settle()
        router.owned.ask_resume(r, "its worker died")
        new = StreamMux()
        _take(router, new)
        (err,) = new.take().errors
        assert err.code == grpc.StatusCode.UNAVAILABLE.value[0]
        assert r.owner_key == "k1" and not _reowns(router, r.worker_id)

    _run(test)


def test_a_request_taken_over_is_kept_when_its_new_owner_dies_too_and_can_be_taken_over_again() -> None:
    async def test() -> None:
        router, mux, r = _kept_request()
        await _settle()
        router.owned.stream_ended(mux, [r])
        new = StreamMux()
        router.owned.announce(NEW, new)  # NOTE: a frontend names its owner address on every stream it opens
        _take(router, new)
        assert not router.owned.owner_gone(r)
        assert router.owned.stream_ended(new, []) == [] and router.owned.owner_gone(r), "kept for its new owner"
        third = StreamMux()
        msg = spb.TakeOver(request_id="client-7", token=TOKEN, owner=spb.Owner(address="127.0.0.1:7002", key="k3"))
        router.owned.takeovers.take_over(msg, "alpha", "10.0.0.1", third)
        assert r.owner_key == "k3" and not router.owned.owner_gone(r)
        assert [x.owner.key for x in _reowns(router, r.worker_id)] == ["k2", "k3"]

    _run(test)


def test_only_a_frontend_stream_may_take_over_and_the_handler_binds_the_grant_to_the_callers_client() -> None:
    async def test() -> None:
        router, _ = _failover_router()
        servicer = KVServeServicer(router)
        take = spb.GenerateStreamRequest(take_over=spb.TakeOver(request_id="c", token=TOKEN,
                                                                owner=spb.Owner(address=NEW, key="k2")))  # fmt: skip
        try:
            await servicer._read_requests(_messages(take), StreamMux(), {}, ("peer", None, False))
            raise AssertionError("a take-over on a client's stream was taken")
        except RouterError as e:
            assert e.code == grpc.StatusCode.PERMISSION_DENIED
        # a frontend's request with a grant: bound to the end client it names (its tenant: none without keys)
        owned = spb.GenerateStreamRequest(
            generate=_req("k1"),
            owner=spb.Owner(address=OWNER.address, key="k1"),
            client="10.0.0.1",
            resumable=spb.ResumeGrant(token=TOKEN, request_id="c"),
        )
        live: dict = {}
        await servicer._read_requests(_messages(owned), StreamMux(), live, ("peer", None, True))
        await _settle()
        assert live["k1"].resume == ResumeGrant(TOKEN, "c", "", "10.0.0.1")
        refused = StreamMux()
        await servicer._read_requests(_messages(take), refused, {}, ("10.0.0.9", None, True))  # NOTE: another client
        (err,) = refused.take().errors
        assert err.code == grpc.StatusCode.NOT_FOUND.value[0] and live["k1"].owner_key == "k1"

    _run(test)


def test_a_resume_sent_to_the_router_direct_is_refused_naming_the_field() -> None:
    req = spb.GenerateRequest(request_id="c", resume=spb.ResumeStream(token=TOKEN, num_tokens=3))
    try:
        prompt_ids(req, ModelLimits(vocab_size=100, max_model_len=64), None, None)
        raise AssertionError("a resume without a frontend was taken as a request")
    except ValidationError as e:
        assert e.field == "resume" and "frontend" in str(e)


def test_a_reown_its_worker_refuses_while_the_router_has_it_live_is_answered_unavailable_and_retried() -> None:
    async def test() -> None:
        router, mux, r = _kept_request()
        await _settle()
        router.owned.stream_ended(mux, [r])
        new = StreamMux()
        _take(router, new)
        (seq,) = [c.seq for c in _commands(router, r.worker_id) if c.HasField("reown")]
        router.on_message(r.worker_id, pb.WorkerMessage(ack=pb.CommandAck(command_seq=seq, ok=False)))
        (err,) = new.take().errors
        assert err.code == grpc.StatusCode.UNAVAILABLE.value[0], "a live request (a migration's export): retry"
        again = StreamMux()
        _take(router, again, key="k3")  # the client's retry: the grant still holds
        assert r.owner_key == "k3" and [x.owner.key for x in _reowns(router, r.worker_id)] == ["k2", "k3"]

    _run(test)


def test_a_grant_reaches_the_worker_and_a_restarted_router_honours_it_from_the_workers_table() -> None:
    """The grant rides the dispatch to the worker (``WorkerRequest.resume_grant``), which lists it in its
    ``RequestTable``; a router that adopts the request from that table takes a matching resume, and only that."""

    async def test() -> None:
        router, _, r = _kept_request()
        await _settle()
        worker = router.table[r.worker_id].handle
        ((request,), _) = worker.added()[-1]
        assert request.resume_grant == (TOKEN, "client-7", "alpha", "10.0.0.1")
        fresh, _ = _failover_router()  # the new router after a restart: it knows nothing yet
        table = pb.RequestTable(requests=[pb.OwnedRequest(
            request_id=r.worker_rid, owner=OWNER.address, owner_key="k1", prompt_ids=list(r.prompt_ids),
            sampling=spb.SamplingParams(max_tokens=8), num_output_tokens=2, resume_token=TOKEN,
            resume_request_id="client-7", resume_tenant="alpha", resume_client="10.0.0.1")])  # fmt: skip
        fresh.on_message(r.worker_id, pb.WorkerMessage(request_table=table))
        adopted = fresh.owned.by_key["k1"]
        wrong = StreamMux()
        _take(fresh, wrong, tenant="beta")  # another tenant: refused, nothing moved
        assert [e.code for e in wrong.take().errors] == [grpc.StatusCode.NOT_FOUND.value[0]]
        _take(fresh, StreamMux())
        assert (adopted.owner, adopted.owner_key) == (NEW, "k2")
        (reown,) = _reowns(fresh, r.worker_id)
        assert (reown.request_id, reown.owner.key) == (r.worker_rid, "k2")

    _run(test)
