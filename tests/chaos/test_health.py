"""Health tells the truth in both directions (in-process router, fake workers, real gRPC and HTTP
on 127.0.0.1): readiness is SERVING / 200 iff some worker can serve, gRPC and HTTP agree, and it
flips back when every worker is down or retired; liveness stays SERVING / 200 throughout.
Every call has a deadline and every wait a bound, so a regression fails instead of hanging."""

from __future__ import annotations

import asyncio
import time

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvserve.router.api.health import LIVENESS_SERVICE, READINESS_SERVICES
from kvserve.router.api.server import RouterService
from kvserve.router.config import RouterConfig
from tests.unit.test_router_failover import FakeWorker, _connect, _identity

CALL_TIMEOUT = 10.0
FLIP_TIMEOUT_S = 5.0  # 25 publisher intervals: generous on a loaded box, still a bound
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def _grpc(stub: health_pb2_grpc.HealthStub, service: str) -> int:
    reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=CALL_TIMEOUT)
    return reply.status


async def _http(client: httpx.AsyncClient, base: str, path: str) -> int:
    return (await client.get(base + path, timeout=CALL_TIMEOUT)).status_code


async def _agree(stub: health_pb2_grpc.HealthStub, client: httpx.AsyncClient, base: str, ready: bool) -> float:
    """Wait until every readiness answer (gRPC and HTTP) says ``ready``; the seconds it took.

    Raises:
        AssertionError: they did not all say so within FLIP_TIMEOUT_S.
    """
    want_grpc, want_http = (SERVING, 200) if ready else (NOT_SERVING, 503)
    t0 = time.monotonic()
    while True:
        got = [await _grpc(stub, s) for s in READINESS_SERVICES]
        got_http = [await _http(client, base, p) for p in ("/health", "/health/ready")]
        if all(g == want_grpc for g in got) and all(h == want_http for h in got_http):
            return time.monotonic() - t0
        assert time.monotonic() - t0 < FLIP_TIMEOUT_S, f"readiness still {got} / {got_http}, want ready={ready}"
        await asyncio.sleep(0.05)


async def _live(stub: health_pb2_grpc.HealthStub, client: httpx.AsyncClient, base: str) -> None:
    assert await _grpc(stub, LIVENESS_SERVICE) == SERVING
    assert await _http(client, base, "/health/live") == 200


def test_readiness_follows_the_workers_both_ways_and_grpc_and_http_agree() -> None:
    async def main() -> None:
        service = RouterService(RouterConfig(port=0, worker_restart_limit=0), http_port=0, ready_timeout_s=0.2)
        await service.start()
        base = f"http://127.0.0.1:{await service.http_port()}"
        router = service.router
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{service.port}") as channel, httpx.AsyncClient() as http:
                stub = health_pb2_grpc.HealthStub(channel)
                await _live(stub, http, base)
                await _agree(stub, http, base, ready=False)  # no worker yet

                for w in ("a", "b"):
                    router.add_worker(w, FakeWorker(), _identity(w))
                    _connect(router, w, "inc-1")
                await _agree(stub, http, base, ready=True)

                router.on_disconnect("a")  # one worker down: still ready
                await _agree(stub, http, base, ready=True)
                router.on_disconnect("b")  # none can serve: NOT ready again
                await _agree(stub, http, base, ready=False)
                await _live(stub, http, base)  # the router itself is alive all along

                _connect(router, "b", "inc-1")  # its link is back (same process)
                await _agree(stub, http, base, ready=True)
                # A restarted "a" beyond the restart limit (0) is retired; "b" dies: nobody serves.
                _connect(router, "a", "inc-2")
                assert router.table["a"].state == "retired"
                router.on_disconnect("b")
                await _agree(stub, http, base, ready=False)
                await _live(stub, http, base)
        finally:
            await service.stop(grace=0)

    asyncio.run(main())


def test_health_watch_streams_each_change_once() -> None:
    async def main() -> None:
        service = RouterService(RouterConfig(port=0), ready_timeout_s=0.2)
        await service.start()
        router = service.router
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{service.port}") as channel:
                watch = health_pb2_grpc.HealthStub(channel).Watch(
                    health_pb2.HealthCheckRequest(service=""), timeout=CALL_TIMEOUT
                )
                seen = [(await watch.read()).status]
                router.add_worker("a", FakeWorker(), _identity("a"))
                _connect(router, "a", "inc-1")
                seen.append((await watch.read()).status)
                router.on_disconnect("a")
                seen.append((await watch.read()).status)
                watch.cancel()
                assert seen == [NOT_SERVING, SERVING, NOT_SERVING]
        finally:
            await service.stop(grace=0)

    asyncio.run(main())
