"""Nobody but a worker the launcher started, speaking for itself, gets a WorkerLink (README "Security").

Attacks tried (issue 25, finding 1): a client holding the API token, and one holding nothing, open
``WorkerLink.Connect`` and say Hello as ``worker-0`` with fresh incarnations (before the fix: the
real worker-0 counted as restarted and, after a few, retired for good), as an id nobody launched,
and send outputs and pressure reports; a worker's credential saying Hello as another worker; a
worker credential calling the client API. Each is refused; the sessions table does not grow; the
real workers keep serving, and a stream running through the attack gets exactly the tokens of an
undisturbed run.

Attacks tried (issue 42, finding 2): a *copied* valid credential of worker-1, replayed from another
process with fresh incarnations (a "restart"), with no link proof, with a guessed one, and with the
real process's proof; the real process's own Hello and proof replayed after it connected (its nonce
is spent) and after its actor restarted (an old incarnation). Each is refused before any session:
0 sessions accepted, 0 restarts counted; the real process (which gets its nonce through Ray) connects.

The gate is tested in-process first (no Ray: a router with a known worker key, so valid, forged
and foreign credentials can be made, and a fake actor handle that receives the link nonces), then
against a real ``kvserve serve --auth-token``.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import grpc
import pytest

from kvserve.protos.kvserve.v1 import serving_pb2 as spb
from kvserve.protos.kvserve.v1 import serving_pb2_grpc
from kvserve.protos.kvserve.v1 import worker_pb2 as pb
from kvserve.router.api.server import RouterService
from kvserve.router.config import RouterConfig
from kvserve.workers.core.identity import WorkerIdentity
from kvserve.workers.core.worker_credential import (
    LINK_PROOF_HEADER,
    WORKER_CREDENTIAL_HEADER,
    issue_worker_credential,
    link_proof,
    new_link_nonce,
    new_worker_key,
)
from tests.chaos.conftest import NUM_WORKERS, serve_cluster, stop_cluster
from tests.chaos.streams import Stream, prompt, request

TOKEN = "impersonation-test-token"
BEARER = ("authorization", f"Bearer {TOKEN}")
CONNECT = "/kvserve.v1.WorkerLink/Connect"
CALL_TIMEOUT = 10.0
ATTEMPTS = 5  # before the fix, 4 fresh incarnations within the restart window retired the worker


def hello(worker_id: str, incarnation: str | None = None) -> pb.WorkerMessage:
    """A Hello as a real worker's, with a fresh incarnation (a "restart") unless one is given."""
    return pb.WorkerMessage(
        seq=1,
        hello=pb.Hello(
            worker_id=worker_id, model_id="m", block_size=16, total_blocks=64, max_model_len=2048,
            vocab_size=1000, incarnation=incarnation or uuid.uuid4().hex,
        ),
    )  # fmt: skip


class FakeActor:
    """A worker's actor handle as the router sees it: ``bind_link`` delivers a nonce to "the live
    process" (recorded here) and returns its incarnation; other calls answer None."""

    def __init__(self, incarnation: str) -> None:
        self.incarnation, self.nonces = incarnation, []

    def __getattr__(self, name: str) -> object:
        actor = self

        class Method:
            def remote(self, *args: object) -> asyncio.Future:
                fut = asyncio.get_running_loop().create_future()
                if name == "bind_link":
                    actor.nonces.append(args[0])
                fut.set_result(actor.incarnation if name == "bind_link" else None)
                return fut

        return Method()


async def _registered(service: RouterService, worker_id: str, incarnation: str) -> FakeActor:
    """Register ``worker_id`` with a fake actor; returns once the router handed it a nonce."""
    actor = FakeActor(incarnation)
    identity = WorkerIdentity(worker_id, "m", block_size=16, total_blocks=64, max_model_len=2048, vocab_size=1000)
    await service.add_worker(worker_id, actor, identity)
    for _ in range(200):
        if actor.nonces and service.gate._bound.get(worker_id):
            return actor
        await asyncio.sleep(0.01)
    raise AssertionError("the router never handed the actor a link nonce")


async def _connected(service: RouterService, worker_id: str, want: bool = True) -> None:
    for _ in range(200):
        if service.router.link.connected(worker_id) == want:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"{worker_id} connected != {want}")


def forged_traffic(worker_id: str, request_ids: list[str]) -> list[pb.WorkerMessage]:
    """What an impersonator sends after its Hello: tokens for others' requests and a fake report."""
    outputs = [pb.RequestOutput(request_id=rid, new_token_ids=[7, 7, 7], num_output_tokens=3) for rid in request_ids]
    return [
        pb.WorkerMessage(seq=2, step_outputs=pb.StepOutputs(decode_step=1, outputs=outputs)),
        pb.WorkerMessage(seq=3, step=pb.StepMessages(
            pressure=pb.PressureReport(worker_id=worker_id, seq=1 << 40, total_blocks=64))),
    ]


# ---- in-process: the gate itself ------------------------------------------------------------------
def run(test: Callable[[RouterService, grpc.aio.Channel, str], Awaitable[None]]) -> None:
    key = new_worker_key()

    async def main() -> None:
        service = RouterService(RouterConfig(port=0, auth_token=TOKEN), ready_timeout_s=0.2, worker_key=key)
        await service.start()
        await service.expect_workers(["worker-0", "worker-1"])
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{service.port}") as channel:
                await test(service, channel, key)
        finally:
            await service.stop(grace=0)

    asyncio.run(main())


def _connect(channel: grpc.aio.Channel, metadata: tuple, messages: list[pb.WorkerMessage]) -> grpc.aio.StreamStreamCall:
    async def requests() -> AsyncIterator[pb.WorkerMessage]:
        for m in messages:
            yield m
        await asyncio.Event().wait()  # keep the stream open, as a worker does

    return channel.stream_stream(
        CONNECT,
        request_serializer=pb.WorkerMessage.SerializeToString,
        response_deserializer=pb.RouterCommand.FromString,
    )(requests(), metadata=metadata, timeout=CALL_TIMEOUT)


async def _refused(channel: grpc.aio.Channel, metadata: tuple, messages: list[pb.WorkerMessage]) -> grpc.StatusCode:
    """The status a Connect with ``messages`` ends with.

    NOTE: the refused stream must have nothing more to write when refused (an aio client still
    writing to a call the server ended reports INTERNAL on its side, not the server's status).
    """
    call = _connect(channel, metadata, messages)
    try:
        async for _ in call:
            pass
    except grpc.aio.AioRpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def _credential_header(credential: str) -> tuple[str, str]:
    return (WORKER_CREDENTIAL_HEADER, credential)


def test_client_token_or_no_credential_cannot_open_worker_link(caplog: pytest.LogCaptureFixture) -> None:
    async def test(service: RouterService, channel: grpc.aio.Channel, key: str) -> None:
        real_mac = issue_worker_credential(key, "worker-0").rpartition(":")[2]
        attempts = {
            "nothing": (),
            "client token": (BEARER,),
            "client token as credential": (BEARER, _credential_header(TOKEN)),
            "forged MAC": (_credential_header("worker-0:" + "0" * 64),),
            "another cluster's key": (_credential_header(issue_worker_credential(new_worker_key(), "worker-0")),),
            "worker-0's MAC for worker-1": (_credential_header("worker-1:" + real_mac),),
        }
        with caplog.at_level(logging.WARNING, logger="kvserve.router.gate.worker_auth"):
            for name, metadata in attempts.items():
                for _ in range(ATTEMPTS):
                    # NOTE: nothing written: refused on its metadata alone, before any message is read
                    # (the real cluster's test below sends Hellos and outputs as well).
                    assert await _refused(channel, metadata, []) == grpc.StatusCode.UNAUTHENTICATED, name
        assert service.router.link.sessions == {}, "a refused WorkerLink must leave no session"
        assert service.gate.refusals_total == ATTEMPTS * len(attempts)
        refusals = [r for r in caplog.records if "WorkerLink from" in r.getMessage()]
        # Logged once per (peer, reason), not once per attempt.
        assert 1 <= len(refusals) <= 3, [r.getMessage() for r in refusals]

    run(test)


def test_a_credential_speaks_for_its_own_worker_only() -> None:
    async def test(service: RouterService, channel: grpc.aio.Channel, key: str) -> None:
        as_worker_1 = (_credential_header(issue_worker_credential(key, "worker-1")),)
        code = await _refused(channel, as_worker_1, [hello("worker-0")])
        assert code == grpc.StatusCode.PERMISSION_DENIED
        # A valid MAC for an id the launcher never started (only the key's holder could make it).
        unknown = (_credential_header(issue_worker_credential(key, "worker-99")),)
        assert await _refused(channel, unknown, [hello("worker-99")]) == grpc.StatusCode.PERMISSION_DENIED
        # The right credential, but no Hello first.
        own = (_credential_header(issue_worker_credential(key, "worker-0")),)
        assert await _refused(channel, own, forged_traffic("worker-0", [])[1:]) == grpc.StatusCode.INVALID_ARGUMENT
        assert service.router.link.sessions == {}

    run(test)


def test_own_credential_opens_the_link() -> None:
    """The positive control: without it the refusals above could be a link that admits no one. The
    real process proves the nonce its actor got through Ray."""

    async def test(service: RouterService, channel: grpc.aio.Channel, key: str) -> None:
        actor = await _registered(service, "worker-1", "real-1")
        credential = issue_worker_credential(key, "worker-1")
        own = (_credential_header(credential), (LINK_PROOF_HEADER, link_proof(credential, "real-1", actor.nonces[-1])))
        call = _connect(channel, own, [hello("worker-1", "real-1")])
        try:
            await _connected(service, "worker-1")
            assert list(service.router.link.sessions) == ["worker-1"]
        finally:
            call.cancel()

    run(test)


def test_a_copied_credential_is_worthless_outside_its_process() -> None:
    async def test(service: RouterService, channel: grpc.aio.Channel, key: str) -> None:
        actor = await _registered(service, "worker-1", "real-1")
        credential = issue_worker_credential(key, "worker-1")  # the copy: byte for byte the real one
        copied = _credential_header(credential)
        real_proof = link_proof(credential, "real-1", actor.nonces[-1])
        attempts = [
            (copied,),  # no proof
            (copied, (LINK_PROOF_HEADER, link_proof(credential, "fresh", new_link_nonce()))),  # a guessed nonce
            (copied, (LINK_PROOF_HEADER, real_proof)),  # the real process's proof, another incarnation
        ]
        for metadata in attempts:
            for _ in range(ATTEMPTS):
                code = await _refused(channel, metadata, [hello("worker-1")])  # a fresh incarnation: a "restart"
                assert code == grpc.StatusCode.FAILED_PRECONDITION, code
        assert service.router.link.sessions == {}, "a copied credential got a session"
        # The real process gets in with its own proof (its first session: no restart) ...
        real = _connect(channel, (copied, (LINK_PROOF_HEADER, real_proof)), [hello("worker-1", "real-1")])
        await _connected(service, "worker-1")
        real.cancel()
        await _connected(service, "worker-1", want=False)
        # ... and its Hello and proof, replayed, do not: the nonce is spent (then: its actor restarted).
        code = await _refused(channel, (copied, (LINK_PROOF_HEADER, real_proof)), [hello("worker-1", "real-1")])
        assert code == grpc.StatusCode.FAILED_PRECONDITION
        actor.incarnation = "real-2"  # Ray restarted it
        service.gate.bind_interval_s = 0.0  # NOTE: the next refusal re-binds at once (no throttle to wait out)
        code = await _refused(channel, (copied, (LINK_PROOF_HEADER, real_proof)), [hello("worker-1", "real-1")])
        assert code == grpc.StatusCode.FAILED_PRECONDITION
        for _ in range(100):
            if service.gate._bound.get("worker-1", ("",))[0] == "real-2":
                break
            await asyncio.sleep(0.02)
        old = link_proof(credential, "real-1", service.gate._bound["worker-1"][1])  # even with the new nonce
        code = await _refused(channel, (copied, (LINK_PROOF_HEADER, old)), [hello("worker-1", "real-1")])
        assert code == grpc.StatusCode.FAILED_PRECONDITION
        supervision = service.router.table.supervision()["worker-1"]
        assert supervision.restarts_total == 0 and not supervision.retired, supervision

    run(test)


def test_worker_credential_cannot_call_the_client_api() -> None:
    async def test(service: RouterService, channel: grpc.aio.Channel, key: str) -> None:
        stub = serving_pb2_grpc.KVServeStub(channel)
        credential = _credential_header(issue_worker_credential(key, "worker-0"))
        for metadata in ((credential,), (credential, BEARER)):
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.GetClusterStatus(spb.ClusterStatusRequest(), metadata=metadata, timeout=CALL_TIMEOUT)
            assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
            with pytest.raises(grpc.aio.AioRpcError) as e:
                async for _ in stub.Generate(request([1, 2, 3], 2), metadata=metadata, timeout=CALL_TIMEOUT):
                    pass
            assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
        # ... while the client token alone still works.
        status = await stub.GetClusterStatus(spb.ClusterStatusRequest(), metadata=(BEARER,), timeout=CALL_TIMEOUT)
        assert len(status.workers) == 0

    run(test)


# ---- a real cluster under attack ------------------------------------------------------------------
class Impersonator:
    """Opens a WorkerLink as ``worker_id`` and, should it get in, answers every command that names
    a request with forged tokens for it (what the attack did before the fix)."""

    def __init__(self, address: str, metadata: tuple, worker_id: str, guessed_ids: list[str]) -> None:
        self.address, self.metadata, self.worker_id = address, metadata, worker_id
        self.outbox: queue.Queue[pb.WorkerMessage | None] = queue.Queue()
        for m in [hello(worker_id), *forged_traffic(worker_id, guessed_ids)]:
            self.outbox.put(m)
        self.code: grpc.StatusCode | None = None
        self.commands: list[pb.RouterCommand] = []

    def _requests(self):
        while (m := self.outbox.get()) is not None:
            yield m

    def run(self, timeout: float = 15.0) -> Impersonator:
        from kvserve.protos.kvserve.v1 import worker_pb2_grpc

        seq = 100
        with grpc.insecure_channel(self.address) as ch:
            call = worker_pb2_grpc.WorkerLinkStub(ch).Connect(self._requests(), metadata=self.metadata, timeout=timeout)
            try:
                for cmd in call:
                    self.commands.append(cmd)
                    rid = cmd.abort.request_id or cmd.preempt.request_id
                    if rid:
                        seq += 1
                        out = pb.RequestOutput(request_id=rid, new_token_ids=[7], num_output_tokens=1)
                        self.outbox.put(pb.WorkerMessage(seq=seq, step_outputs=pb.StepOutputs(outputs=[out])))
                self.code = grpc.StatusCode.OK
            except grpc.RpcError as e:
                self.code = e.code()
            finally:
                self.outbox.put(None)
        return self


@pytest.fixture(scope="module")
def auth_cluster(tiny_llama_dir: Path):
    cluster = serve_cluster(tiny_llama_dir, "--auth-token", TOKEN)
    try:
        yield cluster
    finally:
        stop_cluster(cluster)


def _status(address: str) -> spb.ClusterStatus:
    with grpc.insecure_channel(address) as ch:
        return serving_pb2_grpc.KVServeStub(ch).GetClusterStatus(
            spb.ClusterStatusRequest(), metadata=(BEARER,), timeout=30
        )


def test_impersonators_are_refused_and_real_workers_keep_serving(auth_cluster) -> None:
    address = auth_cluster.address
    req = request(prompt(1, 24), 128, request_id="victim")
    reference = Stream(address, req, metadata=(BEARER,)).start().wait(180)
    assert reference.code == grpc.StatusCode.OK and len(reference.tokens) == 128

    victim = Stream(address, req, metadata=(BEARER,), first_tokens=2).start()
    assert victim.started.wait(120), "the victim stream never started"
    guessed = ["victim", "victim#0", *(f"victim#{i:08x}.1" for i in range(4))]
    attackers = []
    for metadata in ((BEARER,), ()):
        for worker_id in ("worker-0", "worker-1", "worker-99"):
            attackers += [Impersonator(address, metadata, worker_id, guessed) for _ in range(ATTEMPTS)]
    threads = [threading.Thread(target=a.run, daemon=True) for a in attackers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(a.code == grpc.StatusCode.UNAUTHENTICATED for a in attackers), {a.code for a in attackers}
    assert not any(a.commands for a in attackers), "an impersonator received router commands"

    victim.wait(180)
    assert victim.code == grpc.StatusCode.OK, (victim.code, victim.details)
    assert victim.tokens == reference.tokens, "the victim's stream got a token no real worker produced"
    assert set(victim.worker_ids) <= {f"worker-{i}" for i in range(NUM_WORKERS)}

    status = _status(address)
    assert sorted(w.worker_id for w in status.workers) == [f"worker-{i}" for i in range(NUM_WORKERS)]
    for w in status.workers:
        assert w.state == "up" and w.restarts_total == 0, w
    # Both real workers still serve.
    for i in range(NUM_WORKERS):
        after = Stream(address, request(prompt(10 + i), 4), metadata=(BEARER,)).start().wait(180)
        assert after.code == grpc.StatusCode.OK and len(after.tokens) == 4
