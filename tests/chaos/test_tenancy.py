"""API keys carry a principal (kvserve/router/gate/tenancy.py, README "Security"), through the real gRPC and
HTTP surfaces in-process, over fake workers (no Ray: the router's dispatches are recorded and the
test plays the worker's outputs back, so what a tenant could observe is exact).

Attacks tried (issue 25, finding 2), by tenant A (key A) against tenant B (key B):
- claim B's tenant in the request to share B's prefix cache: the key's tenant wins;
- learn whether B uses a request id (ALREADY_EXISTS as an oracle): ids are per tenant;
- Abort B's request by its id: not found, B's stream goes on;
- ask for a priority above the key's: INVALID_ARGUMENT;
- exceed the key's requests / tokens per minute: RESOURCE_EXHAUSTED with retry-after-ms.

And by the holder of the ``--auth-token`` bearer when keys are configured (issue 42, finding 4), against
tenant B: probe B's request id, abort B's request, claim B's tenant for its cache hits: the token is
its own tenant (``OPERATOR_TENANT``), none of these reach B.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from kvserve.protos.kvserve.v1 import serving_pb2 as spb
from kvserve.protos.kvserve.v1 import serving_pb2_grpc
from kvserve.protos.kvserve.v1 import worker_pb2 as pb
from kvserve.router.api.server import RouterService
from kvserve.router.config import RouterConfig
from kvserve.router.gate.tenancy import OPERATOR_TENANT, KeyRing, hash_key
from kvserve.router.table.worker_link import _Session
from kvserve.workers.core.identity import WorkerIdentity

KEY_A, KEY_B, KEY_SLOW, KEY_TOKENS = "key-of-team-a", "key-of-team-b", "key-of-a-slow-team", "key-of-a-token-team"
CALL_TIMEOUT = 10.0


class FakeWorker:
    """Records the router's Ray calls (``add_request``...) and answers them at once."""

    def __init__(self) -> None:
        self.added: list[Any] = []

    def __getattr__(self, name: str) -> Any:
        worker = self

        class Method:
            def remote(self, *args: Any, **kwargs: Any) -> asyncio.Future:
                if name == "add_request":
                    worker.added.append(args[0])
                if name == "add_requests":  # several placed while a call was in flight
                    worker.added.extend(args[0])
                fut = asyncio.get_running_loop().create_future()
                fut.set_result([None] * len(args[0]) if name == "add_requests" else None)
                return fut

        return Method()


def _key_file(tmp_path: Path) -> Path:
    path = tmp_path / "keys.yaml"
    path.write_text(json.dumps({"keys": [
        {"sha256": hash_key(KEY_A), "tenant": "team-a", "max_priority": 1},
        {"sha256": hash_key(KEY_B), "tenant": "team-b", "max_priority": 5},
        {"sha256": hash_key(KEY_SLOW), "tenant": "team-s", "requests_per_minute": 2},
        {"sha256": hash_key(KEY_TOKENS), "tenant": "team-t", "tokens_per_minute": 100},
    ]}))  # fmt: skip
    return path


async def start_with_fake_worker(service: RouterService) -> FakeWorker:
    """Start ``service`` with one fake worker "w" registered and said Hello (its WorkerLink session
    faked: no worker process, its dispatches recorded)."""
    await service.start()
    worker = FakeWorker()
    identity = WorkerIdentity("w", "m", block_size=4, total_blocks=256, max_model_len=256, vocab_size=100)
    await service.add_worker("w", worker, identity)
    session = service.router.link.sessions.setdefault("w", _Session())
    session.incarnation, session.queue = "inc", asyncio.Queue()
    service.router.on_hello("w", pb.Hello(worker_id="w", total_blocks=256), False)
    return worker


def run(
    tmp_path: Path, test: Callable[[RouterService, grpc.aio.Channel, FakeWorker], Awaitable[None]], **extra: Any
) -> None:
    async def main() -> None:
        config = RouterConfig(port=0, auth_keys=str(_key_file(tmp_path)), default_max_tokens=8, **extra)
        service = RouterService(config, http_port=0, ready_timeout_s=0.2)
        worker = await start_with_fake_worker(service)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{service.port}") as channel:
                await test(service, channel, worker)
        finally:
            await service.stop(grace=0)

    asyncio.run(main())


def _md(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


def _req(request_id: str = "", priority: int = 0, tenant: str = "", max_tokens: int = 4) -> spb.GenerateRequest:
    return spb.GenerateRequest(
        request_id=request_id, token_ids=spb.TokenIds(ids=[1, 2, 3, 4, 5, 6, 7, 8, 9]),
        sampling=spb.SamplingParams(max_tokens=max_tokens), priority=priority, tenant=tenant,
    )  # fmt: skip


async def _admitted(stub: serving_pb2_grpc.KVServeStub, req: spb.GenerateRequest, key: str, worker: FakeWorker):
    """Start a Generate and wait until the router dispatched it to the worker; returns the call."""
    before = len(worker.added)
    call = stub.Generate(req, metadata=_md(key), timeout=CALL_TIMEOUT)
    for _ in range(500):
        if len(worker.added) > before:
            return call
        await asyncio.sleep(0.01)
    raise AssertionError(f"not dispatched: {await _stream_code(call)}")


async def _code(coro: Awaitable[Any]) -> tuple[grpc.StatusCode, str, dict]:
    try:
        await coro
    except grpc.aio.AioRpcError as e:
        return e.code(), e.details() or "", dict(e.trailing_metadata() or ())
    return grpc.StatusCode.OK, "", {}


async def _stream_code(call: Any) -> tuple[grpc.StatusCode, str, dict]:
    async def drain() -> None:
        async for _ in call:
            pass

    return await _code(drain())


def test_a_tenant_cannot_reach_another_tenants_requests_or_cache(tmp_path: Path) -> None:
    async def test(service: RouterService, channel: grpc.aio.Channel, worker: FakeWorker) -> None:
        stub = serving_pb2_grpc.KVServeStub(channel)
        b_call = await _admitted(stub, _req("shared-id"), KEY_B, worker)
        (b_dispatch,) = worker.added
        assert b_dispatch.cache_salt == "team-b"
        # A claims B's tenant (to share B's prefix cache) and reuses B's request id.
        a_call = await _admitted(stub, _req("shared-id", tenant="team-b"), KEY_A, worker)
        a_dispatch = worker.added[1]
        assert a_dispatch.cache_salt == "team-a", "the key's tenant, not the claimed one, salts the cache"
        ra, rb = (service.router.dispatcher.current(d.request_id) for d in (a_dispatch, b_dispatch))
        assert ra is not None and rb is not None and ra.block_hashes != rb.block_hashes
        # A cannot abort B's request by its id (it aborts nothing of its own either: its own id is in use).
        found = await stub.Abort(spb.AbortRequest(request_id="shared-id"), metadata=_md(KEY_A), timeout=CALL_TIMEOUT)
        assert found.found is True and ra.cancelled and not rb.cancelled  # A's own "shared-id"
        assert (await _stream_code(a_call))[0] == grpc.StatusCode.CANCELLED
        found = await stub.Abort(spb.AbortRequest(request_id="shared-id"), metadata=_md(KEY_A), timeout=CALL_TIMEOUT)
        assert found.found is False and not rb.cancelled
        # B's stream goes on and ends as its worker says; the id it sees is its own.
        service.router._on_output("w", pb.RequestOutput(request_id=b_dispatch.request_id, new_token_ids=[5, 6, 7, 8],
                                                        num_output_tokens=4, finish_reason="length",
                                                        num_cached_tokens=8, num_prompt_tokens=9))  # fmt: skip
        got = [resp async for resp in b_call]
        assert [t for r in got for t in r.token_ids] == [5, 6, 7, 8]
        assert {r.request_id for r in got} == {"shared-id"}
        assert got[-1].usage.cached_tokens == 8

    run(tmp_path, test)


OPERATOR_TOKEN = "the-operators-token"


def test_the_operator_token_cannot_reach_a_tenants_requests_or_cache(tmp_path: Path) -> None:
    async def test(service: RouterService, channel: grpc.aio.Channel, worker: FakeWorker) -> None:
        stub = serving_pb2_grpc.KVServeStub(channel)
        b_call = await _admitted(stub, _req("b-job"), KEY_B, worker)
        b_dispatch = worker.added[-1]
        rb = service.router.dispatcher.current(b_dispatch.request_id)
        # Probe B's id (ALREADY_EXISTS would say B uses it) while claiming B's tenant (its cache hits).
        op_call = await _admitted(stub, _req("b-job", tenant="team-b", priority=99), OPERATOR_TOKEN, worker)
        op_dispatch = worker.added[-1]
        assert op_dispatch.cache_salt == OPERATOR_TENANT, "the token shares a tenant's prefix cache"
        ro = service.router.dispatcher.current(op_dispatch.request_id)
        assert ro is not None and rb is not None and ro.block_hashes != rb.block_hashes
        # Abort B's request by its id: the token reaches its own request only, then nothing.
        for _ in range(2):
            await stub.Abort(spb.AbortRequest(request_id="b-job"), metadata=_md(OPERATOR_TOKEN), timeout=CALL_TIMEOUT)
            assert not rb.cancelled, "the operator token aborted a tenant's request"
        assert ro.cancelled and (await _stream_code(op_call))[0] == grpc.StatusCode.CANCELLED
        # B's stream goes on, with its own id.
        service.router._on_output("w", pb.RequestOutput(request_id=b_dispatch.request_id, new_token_ids=[5],
                                                        num_output_tokens=1, finish_reason="length",
                                                        num_prompt_tokens=9))  # fmt: skip
        got = [resp async for resp in b_call]
        assert [t for r in got for t in r.token_ids] == [5] and {r.request_id for r in got} == {"b-job"}

    run(tmp_path, test, auth_token=OPERATOR_TOKEN)


def test_request_ids_are_per_tenant_no_already_exists_oracle(tmp_path: Path) -> None:
    async def test(service: RouterService, channel: grpc.aio.Channel, worker: FakeWorker) -> None:
        stub = serving_pb2_grpc.KVServeStub(channel)
        b_call = await _admitted(stub, _req("secret-job"), KEY_B, worker)
        a_call = await _admitted(stub, _req("secret-job"), KEY_A, worker)  # B's id: no ALREADY_EXISTS for A
        again = stub.Generate(_req("secret-job"), metadata=_md(KEY_B), timeout=CALL_TIMEOUT)
        assert (await _stream_code(again))[0] == grpc.StatusCode.ALREADY_EXISTS  # B's own id, twice
        for call in (a_call, b_call):
            call.cancel()

    run(tmp_path, test)


def test_priority_above_the_key_is_refused(tmp_path: Path) -> None:
    async def test(service: RouterService, channel: grpc.aio.Channel, worker: FakeWorker) -> None:
        stub = serving_pb2_grpc.KVServeStub(channel)
        code, details, _ = await _stream_code(
            stub.Generate(_req(priority=2), metadata=_md(KEY_A), timeout=CALL_TIMEOUT)
        )
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "max_priority 1" in details
        ok = await _admitted(stub, _req(priority=1), KEY_A, worker)
        assert worker.added[0].priority == 1
        ok.cancel()
        async with httpx.AsyncClient() as http:
            r = await http.post(f"http://127.0.0.1:{await service.http_port()}/v1/completions",
                                json={"prompt": [1, 2, 3], "max_tokens": 2, "priority": 3},
                                headers={"authorization": f"Bearer {KEY_A}"}, timeout=CALL_TIMEOUT)  # fmt: skip
        assert r.status_code == 400 and "max_priority" in r.json()["error"]["message"]

    run(tmp_path, test)


def test_rate_limits_give_resource_exhausted_with_retry_after(tmp_path: Path) -> None:
    async def test(service: RouterService, channel: grpc.aio.Channel, worker: FakeWorker) -> None:
        stub = serving_pb2_grpc.KVServeStub(channel)
        calls = [await _admitted(stub, _req(), KEY_SLOW, worker) for _ in range(2)]  # its 2 requests per minute
        code, details, trailers = await _stream_code(
            stub.Generate(_req(), metadata=_md(KEY_SLOW), timeout=CALL_TIMEOUT)
        )
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "requests_per_minute" in details
        assert 1 <= int(trailers["retry-after-ms"]) <= 30_000  # a request's worth refills in 30 s
        # Other keys are not affected.
        other = await _admitted(stub, _req(), KEY_B, worker)
        # Tokens: prompt (9) + max_tokens, per minute.
        calls.append(await _admitted(stub, _req(max_tokens=4), KEY_TOKENS, worker))  # 13 of 100
        code, details, trailers = await _stream_code(
            stub.Generate(_req(max_tokens=80), metadata=_md(KEY_TOKENS), timeout=CALL_TIMEOUT)
        )  # 89 more: over
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "tokens_per_minute" in details
        assert 1 <= int(trailers["retry-after-ms"]) <= 60_000
        code, details, _ = await _stream_code(
            stub.Generate(_req(max_tokens=200), metadata=_md(KEY_TOKENS), timeout=CALL_TIMEOUT)
        )  # 209: more than a whole minute's budget, no wait makes it fit
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "tokens_per_minute" in details
        for call in (*calls, other):
            call.cancel()

    run(tmp_path, test)


def test_keys_and_unknown_keys(tmp_path: Path) -> None:
    async def test(service: RouterService, channel: grpc.aio.Channel, worker: FakeWorker) -> None:
        stub = serving_pb2_grpc.KVServeStub(channel)
        for md in ((), _md("not-a-key"), _md(hash_key(KEY_A))):  # the hash itself is no key
            code, _, _ = await _code(
                stub.GetClusterStatus(spb.ClusterStatusRequest(), metadata=md, timeout=CALL_TIMEOUT)
            )
            assert code == grpc.StatusCode.UNAUTHENTICATED
        await stub.GetClusterStatus(spb.ClusterStatusRequest(), metadata=_md(KEY_A), timeout=CALL_TIMEOUT)

    run(tmp_path, test)


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"sha256": "ab", "tenant": "t"}, r"keys\[0\]\.sha256"),
        ({"sha256": "a" * 64, "tenant": "a b"}, r"keys\[0\]\.tenant"),
        ({"sha256": "a" * 64, "tenant": "t", "requests_per_minute": 0}, r"requests_per_minute"),
        ({"sha256": "a" * 64, "tenant": "t", "key": "plain"}, r"keys\[0\]: a mapping"),
    ],
)
def test_bad_key_files_name_the_entry(tmp_path: Path, entry: dict, message: str) -> None:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"keys": [entry]}))
    with pytest.raises(ValueError, match=message):
        KeyRing.load(path)


def test_generate_stream_applies_the_same_tenancy(tmp_path: Path) -> None:
    """GenerateStream (many requests on one stream) is no way around the key: tenant salt, priority
    bound, and ids reported as the tenant sent them."""

    async def test(service: RouterService, channel: grpc.aio.Channel, worker: FakeWorker) -> None:
        stub = serving_pb2_grpc.KVServeStub(channel)
        outgoing: asyncio.Queue = asyncio.Queue()

        async def requests():  # noqa: ANN202 - an async generator of messages
            while (m := await outgoing.get()) is not None:
                yield m

        call = stub.GenerateStream(requests(), metadata=_md(KEY_A), timeout=CALL_TIMEOUT)
        outgoing.put_nowait(spb.GenerateStreamRequest(generate=_req("too-high", priority=2)))
        outgoing.put_nowait(spb.GenerateStreamRequest(generate=_req("mine", tenant="team-b")))
        batches = aiter(call)
        errors = []
        while not errors:
            errors = list((await anext(batches)).errors)
        assert [(e.request_id, e.code) for e in errors] == [("too-high", grpc.StatusCode.INVALID_ARGUMENT.value[0])]
        for _ in range(500):
            if worker.added:
                break
            await asyncio.sleep(0.01)
        (dispatch,) = worker.added
        assert dispatch.cache_salt == "team-a"
        out = pb.RequestOutput(request_id=dispatch.request_id, new_token_ids=[5, 6, 7, 8], num_output_tokens=4,
                               finish_reason="length")  # fmt: skip
        service.router._on_output("w", out)
        batch = await anext(batches)
        assert [(r.request_id, list(r.token_ids)) for r in batch.responses] == [("mine", [5, 6, 7, 8])]
        outgoing.put_nowait(None)
        assert [b async for b in batches] == []

    run(tmp_path, test)
