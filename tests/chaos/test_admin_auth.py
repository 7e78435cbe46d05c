"""Who may drain a worker (``kvserve.v1.Admin``, kvserve/router/gate/auth.py), over real gRPC against an
in-process router with fake workers: only an admin credential (an API key flagged ``admin: true``,
or the bearer token); a tenant's key is PERMISSION_DENIED, a worker credential too (even beside an
admin key), no credential UNAUTHENTICATED. The admin's drain streams its progress to "done"; bytes
that do not decode are INVALID_ARGUMENT."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvserve.protos.kvserve.v1 import serving_pb2 as spb
from kvserve.protos.kvserve.v1 import serving_pb2_grpc
from kvserve.protos.kvserve.v1 import worker_pb2 as pb
from kvserve.router.api.server import RouterService
from kvserve.router.config import RouterConfig
from kvserve.router.gate.tenancy import hash_key
from kvserve.router.table.worker_link import _Session
from kvserve.workers.core.identity import WorkerIdentity
from kvserve.workers.core.worker_credential import WORKER_CREDENTIAL_HEADER, issue_worker_credential, new_worker_key

TOKEN = "operator-token"
ADMIN_KEY, TENANT_KEY = "admin-key-0123", "tenant-key-4567"
TIMEOUT = 10.0


class _Worker:
    """A fake worker actor: every call answers None at once."""

    def __getattr__(self, name: str) -> Any:
        class Method:
            def remote(self, *args: Any, **kwargs: Any) -> asyncio.Future:
                fut = asyncio.get_running_loop().create_future()
                fut.set_result(None)
                return fut

        return Method()


def _hello(service: RouterService, worker_id: str, incarnation: str) -> None:
    s = service.router.link.sessions.setdefault(worker_id, _Session())
    restarted = bool(s.incarnation) and s.incarnation != incarnation
    s.incarnation, s.queue = incarnation, asyncio.Queue()
    service.router.on_hello(worker_id, pb.Hello(worker_id=worker_id, total_blocks=64, incarnation=incarnation),
                            restarted)  # fmt: skip


def _md(secret: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {secret}"),)


async def _drain_code(stub: serving_pb2_grpc.AdminStub, worker_id: str, metadata: tuple) -> grpc.StatusCode:
    call = stub.DrainWorker(spb.DrainRequest(worker_id=worker_id), metadata=metadata, timeout=TIMEOUT)
    try:
        async for _ in call:
            pass
    except grpc.aio.AioRpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def test_only_an_admin_credential_may_drain_and_its_drain_streams_to_done(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ray

    monkeypatch.setattr(ray, "kill", lambda handle, no_restart=True: None)
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"keys": [
        {"sha256": hash_key(ADMIN_KEY), "tenant": "ops", "admin": True},
        {"sha256": hash_key(TENANT_KEY), "tenant": "team-a"},
    ]}))  # fmt: skip

    async def main() -> None:
        worker_key = new_worker_key()
        config = RouterConfig(port=0, auth_token=TOKEN, auth_keys=str(keys))
        service = RouterService(config, ready_timeout_s=0.2, worker_key=worker_key)
        await service.start()
        for w in ("w0", "w1"):
            identity = WorkerIdentity(w, "m", block_size=4, total_blocks=64, max_model_len=64, vocab_size=100)
            await service.add_worker(w, _Worker(), identity)
            _hello(service, w, "inc-1")
        worker_credential = ((WORKER_CREDENTIAL_HEADER, issue_worker_credential(worker_key, "w0")),)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{service.port}") as channel:
                admin = serving_pb2_grpc.AdminStub(channel)
                assert await _drain_code(admin, "w0", ()) == grpc.StatusCode.UNAUTHENTICATED
                assert await _drain_code(admin, "w0", _md("wrong")) == grpc.StatusCode.UNAUTHENTICATED
                assert await _drain_code(admin, "w0", _md(TENANT_KEY)) == grpc.StatusCode.PERMISSION_DENIED
                assert await _drain_code(admin, "w0", worker_credential) == grpc.StatusCode.PERMISSION_DENIED
                both = worker_credential + _md(ADMIN_KEY)
                assert await _drain_code(admin, "w0", both) == grpc.StatusCode.PERMISSION_DENIED
                assert "w0" not in service.router.drainer.drains, "a refused caller started a drain"
                # The tenant's key still opens the client API.
                status = await serving_pb2_grpc.KVServeStub(channel).GetClusterStatus(
                    spb.ClusterStatusRequest(), metadata=_md(TENANT_KEY), timeout=TIMEOUT
                )
                assert {w.state for w in status.workers} == {"up"}
                # Admin credentials pass: the key (an unknown worker is NOT_FOUND) and the token.
                assert await _drain_code(admin, "nope", _md(ADMIN_KEY)) == grpc.StatusCode.NOT_FOUND
                assert await _drain_code(admin, "nope", _md(TOKEN)) == grpc.StatusCode.NOT_FOUND
                call = admin.DrainWorker(spb.DrainRequest(worker_id="w0", deadline_s=5), metadata=_md(ADMIN_KEY),
                                         timeout=TIMEOUT)  # fmt: skip
                phases = []
                async for progress in call:
                    phases.append(progress.phase)
                    if progress.phase == "restarting" and phases.count("restarting") == 1:
                        _hello(service, "w0", "inc-2")  # the fresh process says Hello
                assert phases[-1] == "done" and "moving" in phases, phases
                assert progress.old_incarnation == "inc-1" and progress.new_incarnation == "inc-2"
                # Guarded like the client API: bytes that are no DrainRequest are INVALID_ARGUMENT.
                raw = channel.unary_stream("/kvserve.v1.Admin/DrainWorker")
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    async for _ in raw(b"\xff\xff\xff", metadata=_md(ADMIN_KEY), timeout=TIMEOUT):
                        pass
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value
        finally:
            await service.stop(grace=0)

    asyncio.run(main())
