"""The router's HTTP surfaces (README "Security"), in-process: the API over TLS with the gRPC
port's certificate options (HTTPS verified against the test CA, plain HTTP refused, a client
certificate required with ``tls_client_ca``), and ``/metrics`` behind the client API's auth with
``metrics_auth``."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Awaitable, Callable

import httpx
import pytest

from kvserve.router.api.server import RouterService
from kvserve.router.config import RouterConfig
from tests.integration.test_router import make_pki


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return make_pki(tmp_path_factory.mktemp("pki"))


def run(config: RouterConfig, test: Callable[[str], Awaitable[None]], metrics_port: int | None = None) -> None:
    async def main() -> None:
        service = RouterService(config, metrics_port=metrics_port, http_port=0, ready_timeout_s=0.2)
        await service.start()
        try:
            await test(f"127.0.0.1:{await service.http_port()}")
        finally:
            await service.stop(grace=0)

    asyncio.run(main())


def _context(ca: str, cert: str | None = None, key: str | None = None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=ca)
    if cert:
        ctx.load_cert_chain(cert, key)
    return ctx


def test_https_with_the_grpc_certificate(pki: dict[str, str]) -> None:
    async def test(address: str) -> None:
        async with httpx.AsyncClient(verify=_context(pki["ca"]), timeout=10) as c:
            r = await c.get(f"https://{address}/health")
            assert r.status_code == 503  # served over TLS (no worker yet)
        async with httpx.AsyncClient(timeout=10) as c:
            with pytest.raises(httpx.HTTPError):
                await c.get(f"http://{address}/health")

    run(RouterConfig(port=0, tls_cert=pki["server_cert"], tls_key=pki["server_key"]), test)


def test_mtls_requires_a_client_certificate(pki: dict[str, str]) -> None:
    async def test(address: str) -> None:
        async with httpx.AsyncClient(verify=_context(pki["ca"]), timeout=10) as c:
            with pytest.raises(httpx.HTTPError):
                await c.get(f"https://{address}/health")
        with_cert = _context(pki["ca"], pki["client_cert"], pki["client_key"])
        async with httpx.AsyncClient(verify=with_cert, timeout=10) as c:
            assert (await c.get(f"https://{address}/health")).status_code == 503

    config = RouterConfig(port=0, tls_cert=pki["server_cert"], tls_key=pki["server_key"], tls_client_ca=pki["ca"])
    run(config, test)


def test_metrics_behind_the_client_apis_auth() -> None:
    from kvserve.cluster.launch import _free_port

    port = _free_port("127.0.0.1")
    url = f"http://127.0.0.1:{port}/metrics"

    async def test(address: str) -> None:
        async with httpx.AsyncClient(timeout=10) as c:
            for headers in ({}, {"authorization": "Bearer wrong"}):
                assert (await c.get(url, headers=headers)).status_code == 401
            r = await c.get(url, headers={"authorization": "Bearer metrics-token"})
            assert r.status_code == 200 and "kvserve:" in r.text

    run(RouterConfig(port=0, auth_token="metrics-token", metrics_auth=True), test, metrics_port=port)


def test_worker_links_under_mtls_need_the_certificate_and_the_process_nonce(pki: dict[str, str]) -> None:
    """Issue 42 (TLS in the attack suite): under mTLS a WorkerLink needs a client certificate before its
    credential is even read, and with one, a copied credential still needs its process's nonce."""
    import grpc

    from kvserve.workers.core.worker_credential import (
        LINK_PROOF_HEADER,
        issue_worker_credential,
        link_proof,
        new_worker_key,
    )
    from tests.chaos.test_worker_impersonation import _connect, _connected, _credential_header, _refused, _registered
    from tests.chaos.test_worker_impersonation import hello as worker_hello

    key = new_worker_key()
    ca, cert, client_key = (open(pki[k], "rb").read() for k in ("ca", "client_cert", "client_key"))

    async def main() -> None:
        config = RouterConfig(port=0, tls_cert=pki["server_cert"], tls_key=pki["server_key"], tls_client_ca=pki["ca"])
        service = RouterService(config, ready_timeout_s=0.2, worker_key=key)
        await service.start()
        try:
            actor = await _registered(service, "worker-1", "real-1")
            credential = issue_worker_credential(key, "worker-1")
            proof = link_proof(credential, "real-1", actor.nonces[-1])
            own = (_credential_header(credential), (LINK_PROOF_HEADER, proof))
            address = f"127.0.0.1:{service.port}"
            no_cert = grpc.ssl_channel_credentials(root_certificates=ca)
            with_cert = grpc.ssl_channel_credentials(ca, private_key=client_key, certificate_chain=cert)
            real_hello = [worker_hello("worker-1", "real-1")]
            async with grpc.aio.insecure_channel(address) as plain:
                assert await _refused(plain, own, real_hello) == grpc.StatusCode.UNAVAILABLE
            async with grpc.aio.secure_channel(address, no_cert) as anonymous:
                assert await _refused(anonymous, own, real_hello) == grpc.StatusCode.UNAVAILABLE
            async with grpc.aio.secure_channel(address, with_cert) as channel:
                copied = await _refused(channel, own, [worker_hello("worker-1")])  # a fresh incarnation
                assert copied == grpc.StatusCode.FAILED_PRECONDITION
                assert service.router.link.sessions == {}
                call = _connect(channel, own, [worker_hello("worker-1", "real-1")])  # the real process
                await _connected(service, "worker-1")
                call.cancel()
        finally:
            await service.stop(grace=0)

    asyncio.run(main())
