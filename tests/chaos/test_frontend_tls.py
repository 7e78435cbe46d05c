"""A frontend on a TLS cluster (README "Security"): its client ports serve TLS with the router's
certificate (HTTPS and gRPC; plaintext is refused), under ``tls_client_ca`` they require a client
certificate as the router's do, and its connection to the router is TLS too (the router's own port
refuses anything else), with the frontend's key pair presented under the router's mTLS.

In-process, no Ray: a real RouterService over a fake worker (as tests/chaos/test_frontend_auth.py)
and a real FrontendServer relaying to it, real TLS on 127.0.0.1 with a test CA.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Awaitable, Callable

import grpc
import httpx
import pytest

from kvserve.frontend.server import FrontendServer, FrontendSettings
from kvserve.protos.kvserve.v1 import serving_pb2 as spb
from kvserve.protos.kvserve.v1 import serving_pb2_grpc
from kvserve.protos.kvserve.v1 import worker_pb2 as pb
from kvserve.router.api.server import RouterService
from kvserve.router.config import RouterConfig
from kvserve.workers.core.tls import channel_credentials
from kvserve.workers.core.worker_credential import new_worker_key
from tests.chaos.test_tenancy import FakeWorker, _code, _req, _stream_code, start_with_fake_worker
from tests.integration.test_router import make_pki

CALL_TIMEOUT = 10.0

Test = Callable[[RouterService, FrontendServer, FakeWorker], Awaitable[None]]


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return make_pki(tmp_path_factory.mktemp("pki"))


def run(pki: dict[str, str], test: Test, mtls: bool, link_tls: tuple[str | None, str | None, str | None]) -> None:
    async def main() -> None:
        config = RouterConfig(port=0, default_max_tokens=8, tls_cert=pki["server_cert"], tls_key=pki["server_key"],
                              tls_client_ca=pki["ca"] if mtls else None)  # fmt: skip
        service = RouterService(config, ready_timeout_s=0.2, worker_key=new_worker_key())
        worker = await start_with_fake_worker(service)
        settings = FrontendSettings(f"127.0.0.1:{service.port}", config, 0, 0, "frontend-t", None, link_tls)
        front = FrontendServer(settings)
        await front.start()
        try:
            await test(service, front, worker)
        finally:
            await front.stop(grace=0)
            await service.stop(grace=0)

    asyncio.run(main())


async def _generate_through(address: str, service: RouterService, worker: FakeWorker,
                            creds: grpc.ChannelCredentials) -> list[int]:  # fmt: skip
    """A Generate through the frontend at ``address``, answered by the fake worker: its token ids."""
    async with grpc.aio.secure_channel(address, creds) as channel:
        call = serving_pb2_grpc.KVServeStub(channel).Generate(_req("via-tls"), timeout=CALL_TIMEOUT)
        for _ in range(500):
            if worker.added:
                break
            await asyncio.sleep(0.01)
        assert worker.added, "the request never reached the router over the frontend's TLS link"
        out = pb.RequestOutput(request_id=worker.added[-1].request_id, new_token_ids=[5, 6], num_output_tokens=2,
                               finish_reason="length")  # fmt: skip
        service.router._on_output("w", out)
        return [t async for r in call for t in r.token_ids]


def test_a_frontend_serves_tls_and_reaches_the_router_over_tls(pki: dict[str, str]) -> None:
    async def test(service: RouterService, front: FrontendServer, worker: FakeWorker) -> None:
        address = f"127.0.0.1:{front.grpc_port}"
        assert await _generate_through(address, service, worker, channel_credentials(pki["ca"])) == [5, 6]
        async with grpc.aio.insecure_channel(address) as channel:  # plaintext to a TLS port
            code, _, _ = await _stream_code(serving_pb2_grpc.KVServeStub(channel).Generate(_req(), timeout=5))
            assert code == grpc.StatusCode.UNAVAILABLE
        async with httpx.AsyncClient(verify=ssl.create_default_context(cafile=pki["ca"]), timeout=10) as http:
            r = await http.get(f"https://127.0.0.1:{front.http_port}/v1/models")
            assert r.status_code == 200 and r.headers["kvserve-frontend"] == "frontend-t"
        async with httpx.AsyncClient(timeout=10) as http:
            with pytest.raises(httpx.HTTPError):
                await http.get(f"http://127.0.0.1:{front.http_port}/v1/models")

    run(pki, test, mtls=False, link_tls=(pki["ca"], None, None))


def test_under_mtls_a_frontend_needs_a_client_certificate_and_presents_its_own(pki: dict[str, str]) -> None:
    async def test(service: RouterService, front: FrontendServer, worker: FakeWorker) -> None:
        address = f"127.0.0.1:{front.grpc_port}"
        with_cert = channel_credentials(pki["ca"], pki["client_cert"], pki["client_key"])
        assert await _generate_through(address, service, worker, with_cert) == [5, 6]
        async with grpc.aio.secure_channel(address, channel_credentials(pki["ca"])) as channel:  # no client cert
            code, _, _ = await _code(
                serving_pb2_grpc.KVServeStub(channel).GetClusterStatus(spb.ClusterStatusRequest(), timeout=5)
            )
            assert code == grpc.StatusCode.UNAVAILABLE

    run(pki, test, mtls=True, link_tls=(pki["ca"], pki["client_cert"], pki["client_key"]))


def test_a_frontend_without_the_routers_ca_or_its_client_certificate_gets_nothing_through(
    pki: dict[str, str],
) -> None:
    """The router's port, not the frontend, is the boundary: a frontend that speaks plaintext to a
    TLS router, or lacks a client certificate under mTLS, relays nothing (its callers get an error,
    the worker sees no request)."""

    async def refused(service: RouterService, front: FrontendServer, worker: FakeWorker) -> None:
        creds = channel_credentials(pki["ca"], pki["client_cert"], pki["client_key"])
        async with grpc.aio.secure_channel(f"127.0.0.1:{front.grpc_port}", creds) as channel:
            code, _, _ = await _stream_code(serving_pb2_grpc.KVServeStub(channel).Generate(_req(), timeout=3))
            assert code != grpc.StatusCode.OK
        assert not worker.added

    run(pki, refused, mtls=False, link_tls=(None, None, None))
    run(pki, refused, mtls=True, link_tls=(pki["ca"], None, None))
