"""A frontend's owned requests (docs/architecture.md section 2a): its data service's gate, its data plane
(kvserve/frontend/owned.py) fed by a real worker link, and its router link's placed / break / replay rules
(kvserve/frontend/link.py) against a fake router stream.

Real gRPC on 127.0.0.1, no Ray: the fake worker is the worker's own ``WorkerLinkClient`` + ``Outbox``
(kvserve/workers/transport/) dialling the frontend's ``DataService`` with a data credential.
"""

from __future__ import annotations

import asyncio
import queue
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import grpc
import pytest

from kvserve.frontend.data_service import DataService
from kvserve.frontend.link import RelayedRequest, RouterLink
from kvserve.frontend.owned import OwnedRequests
from kvserve.protos.kvserve.v1 import serving_pb2 as spb
from kvserve.protos.kvserve.v1 import serving_pb2_grpc, worker_pb2_grpc
from kvserve.protos.kvserve.v1 import worker_pb2 as pb
from kvserve.router.requests.request import RouterError
from kvserve.workers.core.tls import channel_credentials
from kvserve.workers.core.worker_credential import (
    WORKER_CREDENTIAL_HEADER,
    issue_data_credential,
    issue_worker_credential,
    new_worker_key,
)
from kvserve.workers.transport.outbox import Outbox
from kvserve.workers.transport.worker_link import WorkerLinkClient

FRONTEND_KEY = "the-clusters-frontend-key"
DEADLINE_S = 8.0


async def until(cond: Callable[[], bool], what: str, timeout_s: float = DEADLINE_S) -> None:
    """Wait for ``cond`` (polled), failing with ``what`` after ``timeout_s``."""
    end = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


def hello(worker_id: str) -> pb.Hello:
    return pb.Hello(worker_id=worker_id, incarnation="inc-1", block_size=16, total_blocks=64)


class FakeWorker:
    """A worker's real data link (``WorkerLinkClient`` + ``Outbox``) to a frontend's data service; the
    commands it gets back land in ``commands``."""

    def __init__(self, address: str, worker_id: str = "w0", credential: str | None = None,
                 tls: grpc.ChannelCredentials | None = None) -> None:  # fmt: skip
        self.worker_id = worker_id
        self.outbox = Outbox()
        self.commands: queue.Queue[pb.RouterCommand] = queue.Queue()
        cred = credential if credential is not None else issue_data_credential(FRONTEND_KEY, worker_id)
        self.client = WorkerLinkClient(address, self.outbox, lambda: hello(worker_id), lambda: None,
                                       self.commands.put, cred, tls, max_backoff_s=0.2)  # fmt: skip
        self.client.start()

    def step(self, outputs: list[pb.RequestOutput] = (), columns: pb.DecodeColumns | None = None) -> None:
        """One engine step's outputs (its plain ones as ``columns``)."""
        self.outbox.put(pb.WorkerMessage(step=pb.StepMessages(outputs=pb.StepOutputs(outputs=outputs,
                                                                                     columns=columns))))  # fmt: skip

    async def aborts(self, n: int = 1) -> list[str]:
        """The request ids of the first ``n`` Abort commands it got."""
        got: list[str] = []
        end = time.monotonic() + DEADLINE_S
        while len(got) < n:
            try:
                cmd = self.commands.get_nowait()
            except queue.Empty:
                if time.monotonic() > end:
                    raise AssertionError(f"{len(got)} aborts, expected {n}") from None
                await asyncio.sleep(0.01)
                continue
            if cmd.WhichOneof("command") == "abort":
                got.append(cmd.abort.request_id)
        return got

    def stop(self) -> None:
        self.client.stop()


def columns(*entries: tuple[str, list[int], int]) -> pb.DecodeColumns:
    """``DecodeColumns`` of (request id, new ids, num_output_tokens) entries (text = one "t" per token)."""
    cols = pb.DecodeColumns()
    for rid, new, total in entries:
        cols.request_ids.append(rid)
        cols.counts.append(len(new))
        cols.token_ids.extend(new)
        cols.num_output_tokens.append(total)
        cols.text_deltas.append("t" * len(new))
    return cols


def output(rid: str, new: list[int], total: int, finish: str = "") -> pb.RequestOutput:
    return pb.RequestOutput(request_id=rid, new_token_ids=new, num_output_tokens=total, text_delta="t" * len(new),
                            finish_reason=finish, num_cached_tokens=16 if finish else 0)  # fmt: skip


def drain(rr: RelayedRequest) -> list[spb.GenerateResponse | RouterError]:
    """What ``rr`` got so far (taken off its queue)."""
    out = []
    while not rr.queue.empty():
        out.append(rr.queue.get_nowait())
    return out


def tokens(items: list[spb.GenerateResponse | RouterError]) -> list[int]:
    return [t for i in items if isinstance(i, spb.GenerateResponse) for t in i.token_ids]


class FakeConnection:
    """The parts of a ``MuxConnection`` a ``RelayedRequest`` calls."""

    def __init__(self) -> None:
        self.cancels: list[str] = []
        self.forgotten: list[RelayedRequest] = []

    def send_cancel(self, request_id: str) -> None:
        self.cancels.append(request_id)

    def forget(self, rr: RelayedRequest) -> None:
        self.forgotten.append(rr)


def run_data(test: Callable[[OwnedRequests, DataService], Awaitable[None]]) -> None:
    """``test`` against a frontend's data service on 127.0.0.1 (a free port)."""

    async def main() -> None:
        owned = OwnedRequests()
        data = DataService(owned, FRONTEND_KEY, "127.0.0.1", 0)
        await data.start()
        try:
            await test(owned, data)
        finally:
            await data.stop(grace=0)

    asyncio.run(main())


# ---- (a) the data service's gate ---------------------------------------------------------------------
async def refused(address: str, credential: str | None, says: str | None) -> grpc.StatusCode:
    """The status a WorkerLink with ``credential`` ends with: it sends a Hello saying ``says`` (None: nothing),
    then keeps the stream open, as a worker does.

    NOTE: the stream has nothing more to write when refused: an aio client still writing when the server ends
    the call reports INTERNAL, not the server's status (tests/chaos/test_worker_impersonation.py).
    """

    async def messages() -> AsyncIterator[pb.WorkerMessage]:
        if says is not None:
            yield pb.WorkerMessage(seq=1, hello=hello(says))
        await asyncio.Event().wait()

    md = ((WORKER_CREDENTIAL_HEADER, credential),) if credential else ()
    async with grpc.aio.insecure_channel(address) as channel:
        call = worker_pb2_grpc.WorkerLinkStub(channel).Connect(messages(), metadata=md, timeout=DEADLINE_S)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            async for _ in call:
                pass
        return e.value.code()


def test_the_data_service_admits_only_a_data_credential_saying_hello_as_itself() -> None:
    async def test(owned: OwnedRequests, data: DataService) -> None:
        router_credential = issue_worker_credential(new_worker_key(), "w0")
        # NOTE: refused before any message is read: these send none
        assert await refused(data.address, None, None) == grpc.StatusCode.UNAUTHENTICATED
        assert await refused(data.address, router_credential, None) == grpc.StatusCode.UNAUTHENTICATED
        other = issue_data_credential(FRONTEND_KEY, "w1")
        assert await refused(data.address, other, "w0") == grpc.StatusCode.PERMISSION_DENIED
        assert data.link.sessions == {}, "a refused link never reaches the WorkerLink service"
        assert data.gate.refusals_total == 3
        worker = FakeWorker(data.address, "w0")  # the right one gets in
        try:
            await until(lambda: data.link.connected("w0"), "the worker's data link")
        finally:
            worker.stop()

    run_data(test)


# ---- (b) out-of-order outputs and resends through the router's demux -----------------------------------
def test_outputs_out_of_order_and_resent_reach_the_client_in_order_once() -> None:
    async def test(owned: OwnedRequests, data: DataService) -> None:
        conn = FakeConnection()
        rr = RelayedRequest(conn, "client-id", max_buffered=100, owner_key="key1")  # type: ignore[arg-type]
        owned.register("key1", rr, list(range(10)))
        worker = FakeWorker(data.address)
        try:
            worker.step([output("key1#3", [30, 40], 4)])  # a later output first: held past the gap
            await until(lambda: worker.outbox.pending() == 0 and data.link.connected("w0"), "step 1 taken")
            assert drain(rr) == []
            worker.step(columns=columns(("key1#3", [10, 20], 2)))  # closes the gap: both go, in order
            worker.step(columns=columns(("key1#3", [10, 20], 2)))  # a resend: dropped
            worker.step([output("key1#3", [30, 40], 4), output("key1#3", [50], 5, finish="length")])
            await until(lambda: rr.finished, "the final response")
            got = drain(rr)
            assert tokens(got) == [10, 20, 30, 40, 50]
            final = got[-1]
            assert isinstance(final, spb.GenerateResponse) and final.finish_reason == "length"
            assert (final.usage.prompt_tokens, final.usage.completion_tokens, final.usage.cached_tokens) == (10, 5, 16)
            assert all(isinstance(i, spb.GenerateResponse) and i.request_id == "client-id" and i.worker_id == "w0"
                       for i in got)  # fmt: skip
            assert "key1" not in owned.states and conn.forgotten == [rr], "a final delivery forgets the key"
        finally:
            worker.stop()

    run_data(test)


# ---- (c) an unknown key --------------------------------------------------------------------------------
def test_an_output_for_a_key_not_owned_is_aborted_on_its_data_link() -> None:
    async def test(owned: OwnedRequests, data: DataService) -> None:
        worker = FakeWorker(data.address)
        try:
            worker.step(columns=columns(("stranger#7", [1], 1)))
            assert await worker.aborts() == ["stranger"]
        finally:
            worker.stop()

    run_data(test)


# ---- (d) the router link: placed, a break, a replay ----------------------------------------------------
class FakeRouter(serving_pb2_grpc.KVServeServicer):
    """A router's ``GenerateStream``: records what each stream sends (``got``), sends what ``batches`` holds
    and ends a stream UNAVAILABLE on a ``None`` there."""

    def __init__(self) -> None:
        self.got: list[spb.GenerateStreamRequest] = []
        self.streams = 0
        self.batches: asyncio.Queue[spb.GenerateBatch | None] = asyncio.Queue()

    async def GenerateStream(self, request_iterator: AsyncIterator[spb.GenerateStreamRequest],  # noqa: N802
                             context: grpc.aio.ServicerContext) -> AsyncIterator[spb.GenerateBatch]:  # fmt: skip
        self.streams += 1

        async def read() -> None:
            async for msg in request_iterator:  # NOTE: a batch's messages as if each came alone, as the router reads
                self.got.extend(msg.batch.requests if msg.WhichOneof("kind") == "batch" else [msg])

        reader = asyncio.get_running_loop().create_task(read())
        try:
            while True:
                batch = await self.batches.get()
                if batch is None:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "router going away")
                yield batch
        finally:
            reader.cancel()

    def generates(self) -> list[spb.GenerateStreamRequest]:
        return [m for m in self.got if m.WhichOneof("kind") == "generate"]


Linked = Callable[[FakeRouter, RouterLink, OwnedRequests, FakeWorker], Awaitable[None]]


def run_link(test: Linked) -> None:
    """``test`` with a fake router, a frontend's router link owning its requests, its data service and a
    fake worker on it."""

    async def main() -> None:
        router = FakeRouter()
        server = grpc.aio.server()
        serving_pb2_grpc.add_KVServeServicer_to_server(router, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        owned = OwnedRequests()
        data = DataService(owned, FRONTEND_KEY, "127.0.0.1", 0)
        await data.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        link = RouterLink(channel, FRONTEND_KEY, 100, owned, data.address)
        worker = FakeWorker(data.address)
        try:
            await test(router, link, owned, worker)
        finally:
            worker.stop()
            await link.close()
            await channel.close()
            await data.stop(grace=0)
            await server.stop(grace=0)

    asyncio.run(main())


def request(rid: str) -> spb.GenerateRequest:
    return spb.GenerateRequest(request_id=rid, token_ids=spb.TokenIds(ids=[1, 2, 3]))


async def submitted(router: FakeRouter, link: RouterLink, rid: str) -> tuple[RelayedRequest, str]:
    """Submit ``rid``; returns its handle and the owner key the router got."""
    rr = link.submit(None, request(rid), None, "client-1")
    # NOTE: the router knows an owned request by its key (RelayedRequest.wire_id), never by the client's id.
    await until(lambda: any(m.generate.request_id == rr.owner_key for m in router.generates()), f"{rid} at the router")
    msg = next(m for m in router.generates() if m.generate.request_id == rr.owner_key)
    assert msg.owner.address == link.data_address and msg.owner.key == rr.owner_key
    return rr, msg.owner.key


def test_a_placed_request_outlives_its_router_stream_and_the_stream_reopens() -> None:
    async def test(router: FakeRouter, link: RouterLink, owned: OwnedRequests, worker: FakeWorker) -> None:
        placed, key = await submitted(router, link, "placed")
        waiting, _ = await submitted(router, link, "waiting")
        early, early_key = await submitted(router, link, "early")
        router.batches.put_nowait(spb.GenerateBatch(placed=[key]))
        worker.step(columns=columns((f"{early_key}#1", [1], 1)))  # its worker's first output beat the router's notice
        await until(lambda: owned.is_placed(key) and len(tokens(list(early.queue._queue))) == 1, "placed")  # type: ignore[attr-defined]
        router.batches.put_nowait(None)  # the router goes away
        await until(lambda: waiting.finished, "the unplaced request's end")
        err = drain(waiting)[-1]
        assert isinstance(err, RouterError) and err.code == grpc.StatusCode.UNAVAILABLE
        assert not placed.finished and not early.finished, "a request on a worker outlives the router's stream"
        await until(lambda: router.streams == 2, "the stream re-opened")
        worker.step(columns=columns((f"{key}#1", [7, 8], 2)))
        await until(lambda: len(tokens(list(placed.queue._queue))) == 2, "the first tokens")  # type: ignore[attr-defined]
        worker.step([output(f"{early_key}#1", [2], 2, finish="stop")])
        destination = FakeWorker(link.data_address, "w1")  # the request migrates: the same dispatch, another worker
        try:
            destination.step([output(f"{key}#1", [9], 3, finish="stop")])
            await until(lambda: placed.finished, "the placed request's end")
        finally:
            destination.stop()
        await until(lambda: early.finished, "the early request's end")
        assert tokens(drain(early)) == [1, 2]
        got = drain(placed)
        assert tokens(got) == [7, 8, 9] and [g.worker_id for g in got] == ["w0", "w1"]  # type: ignore[union-attr]
        final = got[-1]
        assert isinstance(final, spb.GenerateResponse) and final.finish_reason == "stop"
        assert (final.usage.prompt_tokens, final.usage.completion_tokens, final.num_migrations) == (3, 3, 1)
        conn = next(iter(link._connections.values()))
        assert not conn.closed and conn.live == {}, "the re-opened stream serves on; the ended request left it"
        await submitted(router, link, "after")  # a new request rides the new stream

    run_link(test)


def test_a_cancel_aborts_a_placed_request_on_its_data_link_while_the_router_is_away() -> None:
    async def test(router: FakeRouter, link: RouterLink, owned: OwnedRequests, worker: FakeWorker) -> None:
        rr, key = await submitted(router, link, "r")
        router.batches.put_nowait(spb.GenerateBatch(placed=[key]))
        worker.step(columns=columns((f"{key}#1", [5], 1)))
        await until(lambda: tokens(list(rr.queue._queue)) == [5], "the first token")  # type: ignore[attr-defined]
        router.batches.put_nowait(None)
        await until(lambda: router.streams == 2, "the stream re-opened")
        rr.cancel()
        assert await worker.aborts() == [key]
        assert key not in owned.states
        await until(lambda: any(m.cancel_request_id == rr.owner_key for m in router.got), "the cancel at the router")

    run_link(test)


def test_a_replay_notice_is_answered_with_the_delivered_ids_and_old_dispatches_are_fenced() -> None:
    async def test(router: FakeRouter, link: RouterLink, owned: OwnedRequests, worker: FakeWorker) -> None:
        rr, key = await submitted(router, link, "r")
        router.batches.put_nowait(spb.GenerateBatch(placed=[key]))
        worker.step(columns=columns((f"{key}#1", [11, 12], 2)))
        worker.step([output(f"{key}#1", [14], 4)])  # past a gap: held, never delivered
        await until(lambda: len(tokens(list(rr.queue._queue))) == 2, "the first tokens")  # type: ignore[attr-defined]
        router.batches.put_nowait(spb.GenerateBatch(replays=[key]))
        await until(lambda: any(m.WhichOneof("kind") == "resume" for m in router.got), "the Resume")
        resume = next(m.resume for m in router.got if m.WhichOneof("kind") == "resume")
        assert resume.owner_key == key and list(resume.output_ids) == [11, 12]
        worker.step(columns=columns((f"{key}#1", [13], 3)))  # the old dispatch: ignored
        worker.step(columns=columns((f"{key}#2", [23], 3)))  # the replay's: delivered
        worker.step([output(f"{key}#1", [99], 4, finish="stop"), output(f"{key}#2", [24], 4, finish="length")])
        await until(lambda: rr.finished, "the final response")
        got = drain(rr)
        assert tokens(got) == [11, 12, 23, 24]
        final = got[-1]
        assert isinstance(final, spb.GenerateResponse) and final.finish_reason == "length"
        assert (final.num_replays, final.num_migrations, final.usage.completion_tokens) == (1, 1, 4)
        assert owned.dropped_fenced == 2

    run_link(test)


def test_without_a_data_address_requests_are_relayed_through_the_router_as_before() -> None:
    async def test(router: FakeRouter, link: RouterLink, owned: OwnedRequests, worker: FakeWorker) -> None:
        plain = RouterLink(link.channel, FRONTEND_KEY, 100)
        rid = f"plain-{uuid.uuid4().hex[:6]}"
        rr = plain.submit(None, request(rid), None, "client-1")
        await until(lambda: any(m.generate.request_id == rid for m in router.generates()), "at the router")
        assert not next(m for m in router.generates() if m.generate.request_id == rid).HasField("owner")
        assert rr.owner_key is None
        final = spb.GenerateResponse(request_id=rid, token_ids=[4], finish_reason="stop")
        router.batches.put_nowait(spb.GenerateBatch(responses=[final]))
        await until(lambda: rr.finished, "the router's response")
        assert tokens(drain(rr)) == [4]
        await plain.close()

    run_link(test)


# ---- the frontend's wiring (kvserve/frontend/server.py) -------------------------------------------------
@pytest.mark.parametrize(("key", "owned_streams", "serves"), [(FRONTEND_KEY, True, True), (None, True, False),
                                                               (FRONTEND_KEY, False, False)])  # fmt: skip
def test_a_frontend_serves_a_data_service_only_with_a_frontend_key_and_owned_streams(
    key: str | None, owned_streams: bool, serves: bool
) -> None:
    from kvserve.frontend.server import FrontendServer, FrontendSettings
    from kvserve.router.config import RouterConfig

    async def main() -> None:
        settings = FrontendSettings("127.0.0.1:1", RouterConfig(port=0), 0, None, "frontend-t", key,
                                    owned_streams=owned_streams)  # fmt: skip
        front = FrontendServer(settings)
        await front.start()
        try:
            assert bool(front.data_address) == serves
            assert front._link is not None and front._link.data_address == front.data_address
            if serves:
                assert front.data_address.startswith("127.0.0.1:")
                worker = FakeWorker(front.data_address)  # a worker's data credential opens it
                try:
                    await until(lambda: front._data is not None and front._data.link.connected("w0"), "the data link")
                finally:
                    worker.stop()
        finally:
            await front.stop(grace=0)

    asyncio.run(main())


def test_the_data_service_serves_the_client_ports_tls_to_workers_with_their_link_credentials(tmp_path: Path) -> None:
    from tests.integration.test_router import make_pki

    pki = make_pki(tmp_path)

    async def main() -> None:
        owned = OwnedRequests()
        data = DataService(owned, FRONTEND_KEY, "127.0.0.1", 0, (pki["server_cert"], pki["server_key"], pki["ca"]))
        await data.start()
        plain = FakeWorker(data.address, "w1")  # NOTE: first: it would be in by the time the TLS one is
        tls = FakeWorker(data.address, "w0", tls=channel_credentials(pki["ca"], pki["client_cert"], pki["client_key"]))
        try:
            await until(lambda: data.link.connected("w0"), "the TLS data link")
            assert set(data.link.sessions) == {"w0"}, "a plaintext worker gets no data link"
        finally:
            # NOTE: not joined: its thread waits out a handshake that cannot succeed (a daemon, it ends alone)
            plain.client._stop.set()
            tls.stop()
            await data.stop(grace=0)

    asyncio.run(main())


def test_a_client_id_is_free_again_once_its_owned_request_ended_on_the_data_link() -> None:
    """The router knows an owned request by its key: the client may reuse its id as soon as the final output
    came on the data link (before the router has seen that finish), and the router sees a fresh id."""

    async def test(router: FakeRouter, link: RouterLink, owned: OwnedRequests, worker: FakeWorker) -> None:
        rr, key = await submitted(router, link, "same")
        router.batches.put_nowait(spb.GenerateBatch(placed=[key]))
        worker.step([output(f"{key}#1", [5], 1, finish="length")])
        await until(lambda: rr.finished, "the final response")
        again, key2 = await submitted(router, link, "same")  # NOTE: ALREADY_EXISTS here without the wire id
        assert key2 != key and again.request_id == "same"

    run_link(test)


def test_the_abort_rpc_ends_an_owned_request_cancelled_at_the_frontend_and_its_router() -> None:
    async def test(router: FakeRouter, link: RouterLink, owned: OwnedRequests, worker: FakeWorker) -> None:
        rr, key = await submitted(router, link, "mine")
        assert link.abort(None, "other") is None  # not owned here: the router answers it
        assert link.abort(None, "mine") is True
        assert isinstance(await rr.first(), RouterError) and (await rr.first()).code == grpc.StatusCode.CANCELLED
        await until(lambda: any(m.cancel_request_id == key for m in router.got), "the cancel at the router")
        assert link.abort(None, "mine") is False  # already ended (its id is free once the router confirms)

    run_link(test)
