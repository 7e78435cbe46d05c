"""A frontend (frontend/) widens nothing: API keys are still the router's to enforce, a frontend
cannot pose as a worker, and only a frontend holding the cluster's frontend key may name the end
client a request counts against (README "Security").

In-process, no Ray: a real RouterService over a fake worker (its dispatches recorded, as in
tests/chaos/test_tenancy.py) and a real FrontendServer relaying to it, real gRPC and HTTP on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
import httpx

from kvserve.frontend.server import FrontendServer, FrontendSettings
from kvserve.protos.kvserve.v1 import serving_pb2 as spb
from kvserve.protos.kvserve.v1 import serving_pb2_grpc
from kvserve.protos.kvserve.v1 import worker_pb2 as pb
from kvserve.router.api.server import RouterService
from kvserve.router.config import RouterConfig
from kvserve.router.gate.auth import FRONTEND_CREDENTIAL_HEADER
from kvserve.router.gate.tenancy import OPERATOR_TENANT
from kvserve.workers.core.worker_credential import WORKER_CREDENTIAL_HEADER, issue_worker_credential, new_worker_key
from tests.chaos.test_tenancy import (
    KEY_A,
    KEY_B,
    KEY_SLOW,
    FakeWorker,
    _code,
    _key_file,
    _md,
    _req,
    _stream_code,
    start_with_fake_worker,
)
from tests.chaos.test_worker_impersonation import _credential_header, _refused, hello

FRONTEND_KEY = "the-clusters-frontend-key"
CALL_TIMEOUT = 10.0

Test = Callable[[RouterService, FrontendServer, FakeWorker, str], Awaitable[None]]


def run(tmp_path: Path, test: Test, keys: bool = True, **router_knobs: object) -> None:
    async def main() -> None:
        auth_keys = str(_key_file(tmp_path)) if keys else None
        config = RouterConfig(port=0, auth_keys=auth_keys, default_max_tokens=8, **router_knobs)  # type: ignore[arg-type]
        service = RouterService(config, ready_timeout_s=0.2, worker_key=new_worker_key(), frontend_key=FRONTEND_KEY)
        worker = await start_with_fake_worker(service)
        # NOTE: relayed through the router: the fake worker streams to the router only (owned requests' data
        # links and their trust boundary: tests/unit/test_frontend_owned.py, and owner below)
        settings = FrontendSettings(f"127.0.0.1:{service.port}", config, 0, 0, "frontend-t", FRONTEND_KEY,
                                    owned_streams=False)  # fmt: skip
        front = FrontendServer(settings)
        await front.start()
        try:
            await test(service, front, worker, f"127.0.0.1:{front.grpc_port}")
        finally:
            await front.stop(grace=0)
            await service.stop(grace=0)

    asyncio.run(main())


async def _dispatched(worker: FakeWorker, n: int) -> None:
    for _ in range(500):
        if len(worker.added) >= n:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{len(worker.added)} dispatched, expected {n}")


def test_keys_through_a_frontend_are_enforced_as_at_the_router(tmp_path: Path) -> None:
    async def test(service: RouterService, front: FrontendServer, worker: FakeWorker, address: str) -> None:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = serving_pb2_grpc.KVServeStub(channel)
            for md in ((), _md("not-a-key")):  # refused by the frontend itself
                code, _, _ = await _code(stub.GetClusterStatus(spb.ClusterStatusRequest(), metadata=md, timeout=10))
                assert code == grpc.StatusCode.UNAUTHENTICATED
                code, _, _ = await _stream_code(stub.Generate(_req(), metadata=md, timeout=CALL_TIMEOUT))
                assert code == grpc.StatusCode.UNAUTHENTICATED
            assert not worker.added
            # A claims B's tenant: the key's tenant salts the cache; B's own request keeps B's.
            a_call = stub.Generate(_req("shared-id", tenant="team-b"), metadata=_md(KEY_A), timeout=CALL_TIMEOUT)
            await _dispatched(worker, 1)
            b_call = stub.Generate(_req("shared-id"), metadata=_md(KEY_B), timeout=CALL_TIMEOUT)
            await _dispatched(worker, 2)
            assert [d.cache_salt for d in worker.added] == ["team-a", "team-b"]
            # A cannot abort B's request through the frontend either.
            found = await stub.Abort(spb.AbortRequest(request_id="shared-id"), metadata=_md(KEY_A), timeout=10)
            assert found.found is True and (await _stream_code(a_call))[0] == grpc.StatusCode.CANCELLED
            found = await stub.Abort(spb.AbortRequest(request_id="shared-id"), metadata=_md(KEY_A), timeout=10)
            assert found.found is False
            out = pb.RequestOutput(request_id=worker.added[1].request_id, new_token_ids=[5, 6], num_output_tokens=2,
                                   finish_reason="length")  # fmt: skip
            service.router._on_output("w", out)
            got = [r async for r in b_call]
            assert [t for r in got for t in r.token_ids] == [5, 6] and {r.request_id for r in got} == {"shared-id"}
            # Priority above the key's and the key's rate: the router's refusals, trailers included.
            code, details, _ = await _stream_code(stub.Generate(_req(priority=2), metadata=_md(KEY_A), timeout=10))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "max_priority 1" in details
            calls = [stub.Generate(_req(), metadata=_md(KEY_SLOW), timeout=CALL_TIMEOUT) for _ in range(2)]
            await _dispatched(worker, 4)
            code, details, trailers = await _stream_code(stub.Generate(_req(), metadata=_md(KEY_SLOW), timeout=10))
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "requests_per_minute" in details
            assert 1 <= int(trailers["retry-after-ms"]) <= 30_000
            for call in calls:
                call.cancel()
        async with httpx.AsyncClient() as http:
            url = f"http://127.0.0.1:{front.http_port}/v1/completions"
            r = await http.post(url, json={"prompt": [1, 2, 3], "max_tokens": 2}, timeout=CALL_TIMEOUT)
            assert r.status_code == 401
            r = await http.post(url, json={"prompt": [1, 2, 3], "max_tokens": 2, "priority": 3},
                                headers={"authorization": f"Bearer {KEY_A}"}, timeout=CALL_TIMEOUT)  # fmt: skip
            assert r.status_code == 400 and "max_priority" in r.json()["error"]["message"]

    run(tmp_path, test)


def test_the_operator_token_through_a_frontend_reaches_no_tenants_requests(tmp_path: Path) -> None:
    """Issue 42, finding 4, through a frontend: with keys, the --auth-token bearer is its own tenant."""
    token = "the-operators-token"

    async def test(service: RouterService, front: FrontendServer, worker: FakeWorker, address: str) -> None:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = serving_pb2_grpc.KVServeStub(channel)
            b_call = stub.Generate(_req("b-job"), metadata=_md(KEY_B), timeout=CALL_TIMEOUT)
            await _dispatched(worker, 1)
            op_call = stub.Generate(_req("b-job", tenant="team-b"), metadata=_md(token), timeout=CALL_TIMEOUT)
            await _dispatched(worker, 2)  # no ALREADY_EXISTS: B's id is not probed
            assert [d.cache_salt for d in worker.added] == ["team-b", OPERATOR_TENANT]
            for _ in range(2):  # its own "b-job", then nothing: never B's
                await stub.Abort(spb.AbortRequest(request_id="b-job"), metadata=_md(token), timeout=10)
            assert (await _stream_code(op_call))[0] == grpc.StatusCode.CANCELLED
            rb = service.router.dispatcher.current(worker.added[0].request_id)
            assert rb is not None and not rb.cancelled
            b_call.cancel()

    run(tmp_path, test, auth_token=token)


def test_a_frontend_cannot_pose_as_a_worker_nor_a_worker_use_a_frontend(tmp_path: Path) -> None:
    async def test(service: RouterService, front: FrontendServer, worker: FakeWorker, address: str) -> None:
        await service.expect_workers(["worker-0"])
        async with grpc.aio.insecure_channel(f"127.0.0.1:{service.port}") as router:
            for md in ((_credential_header(FRONTEND_KEY),), ((FRONTEND_CREDENTIAL_HEADER, FRONTEND_KEY),)):
                assert await _refused(router, md, []) == grpc.StatusCode.UNAUTHENTICATED
                assert await _refused(router, md, [hello("worker-0")]) == grpc.StatusCode.UNAUTHENTICATED
        assert set(service.router.link.sessions) == {"w"}, "no session for a frontend posing as a worker"
        async with grpc.aio.insecure_channel(address) as channel:
            stub = serving_pb2_grpc.KVServeStub(channel)
            worker_md = ((WORKER_CREDENTIAL_HEADER, issue_worker_credential(new_worker_key(), "w")), *_md(KEY_A))
            code, _, _ = await _stream_code(stub.Generate(_req(), metadata=worker_md, timeout=CALL_TIMEOUT))
            assert code == grpc.StatusCode.PERMISSION_DENIED

    run(tmp_path, test)


def test_only_a_frontend_with_the_key_names_the_end_client(tmp_path: Path) -> None:
    """With one stream per client allowed, two requests naming two clients on one GenerateStream: from
    a caller without the frontend key both count against its own address (the second is refused);
    with the key each counts against the client it names (both run)."""

    async def test(service: RouterService, front: FrontendServer, worker: FakeWorker, address: str) -> None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{service.port}") as router:
            stub = serving_pb2_grpc.KVServeStub(router)
            for trusted in (False, True):
                outgoing: asyncio.Queue = asyncio.Queue()

                async def requests(q: asyncio.Queue = outgoing):  # noqa: ANN202 - an async generator
                    while (m := await q.get()) is not None:
                        yield m

                md = ((FRONTEND_CREDENTIAL_HEADER, FRONTEND_KEY),) if trusted else ()
                call = stub.GenerateStream(requests(), metadata=md, timeout=CALL_TIMEOUT)
                before = len(worker.added)
                for i, client in enumerate(("10.0.0.1", "10.0.0.2")):
                    outgoing.put_nowait(spb.GenerateStreamRequest(generate=_req(f"{trusted}-{i}"), client=client))
                batches = aiter(call)
                if trusted:
                    await _dispatched(worker, before + 2)
                else:
                    batch = await anext(batches)
                    assert [(e.request_id, e.code) for e in batch.errors] == [
                        ("False-1", grpc.StatusCode.RESOURCE_EXHAUSTED.value[0])
                    ]
                call.cancel()

    # NOTE: no API keys: a keyed caller's streams count per key, wherever they come from.
    run(tmp_path, test, keys=False, max_streams_per_client=1)


def test_only_a_frontend_may_name_an_owner_or_resume(tmp_path: Path) -> None:
    """An attack on the client -> router boundary of owned requests (docs/architecture.md 2a): a client with
    a valid key but no frontend credential names an owner (an address the workers would dial) or sends a
    Resume: refused PERMISSION_DENIED, nothing dispatched; with the frontend credential the owner is taken."""

    async def test(service: RouterService, front: FrontendServer, worker: FakeWorker, address: str) -> None:
        router = f"127.0.0.1:{service.port}"
        owner = spb.Owner(address="10.0.0.66:4242", key="k-attacker")
        async with grpc.aio.insecure_channel(router) as channel:
            stub = serving_pb2_grpc.KVServeStub(channel)
            msgs = [spb.GenerateStreamRequest(generate=_req("own-1"), owner=owner)]
            batches = [b async for b in stub.GenerateStream(iter(msgs), metadata=_md(KEY_A), timeout=CALL_TIMEOUT)]
            errors = [e for b in batches for e in b.errors]
            assert [(e.request_id, e.code) for e in errors] == [("own-1", grpc.StatusCode.PERMISSION_DENIED.value[0])]
            assert not worker.added, "a client-named owner reached a worker"
            resume = [spb.GenerateStreamRequest(resume=spb.Resume(owner_key="k-attacker", output_ids=[1, 2]))]
            call = stub.GenerateStream(iter(resume), metadata=_md(KEY_A), timeout=CALL_TIMEOUT)
            assert (await _stream_code(call))[0] == grpc.StatusCode.PERMISSION_DENIED
            trusted = (*_md(KEY_A), (FRONTEND_CREDENTIAL_HEADER, FRONTEND_KEY))
            msgs = [spb.GenerateStreamRequest(generate=_req("own-2"), owner=owner)]
            call = stub.GenerateStream(iter(msgs), metadata=trusted, timeout=CALL_TIMEOUT)
            await _dispatched(worker, 1)
            added = worker.added[0]
            assert (added.owner, added.owner_key) == (owner.address, owner.key)
            call.cancel()

    run(tmp_path, test)
