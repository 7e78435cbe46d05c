"""The router's gRPC surface in-process (no Ray, no workers): undecodable bytes, router bugs,
readiness. Every call has a deadline, so a regression fails instead of hanging."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvserve.protos.kvserve.v1 import serving_pb2 as spb
from kvserve.protos.kvserve.v1 import serving_pb2_grpc
from kvserve.router.api.server import RouterService
from kvserve.router.config import RouterConfig
from kvserve.router.requests.router import RouterError

CALL_TIMEOUT = 10.0
GARBAGE = [b"\xff\xff\xff\xff", b"\x0a\x05ab", b"\x12\x80", b"\x08"]  # bad tags, truncated fields


def _identity(b: bytes) -> bytes:
    return b


def run(test: Callable[[RouterService, grpc.aio.Channel], Awaitable[None]], ready_timeout_s: float = 0.2) -> None:
    async def main() -> None:
        service = RouterService(RouterConfig(port=0), ready_timeout_s=ready_timeout_s)
        await service.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{service.port}") as channel:
                await test(service, channel)
        finally:
            await service.stop(grace=0)

    asyncio.run(main())


async def _raw_status(channel: grpc.aio.Channel, method: str, payload: bytes, streaming: bool) -> grpc.StatusCode:
    factory = channel.unary_stream if streaming else channel.unary_unary
    call = factory(method, request_serializer=_identity, response_deserializer=_identity)(
        payload, timeout=CALL_TIMEOUT
    )
    try:
        if streaming:
            async for _ in call:
                pass
        else:
            await call
    except grpc.aio.AioRpcError as e:
        assert "class" not in (e.details() or ""), e.details()  # no Python class names leak
        return e.code()
    return grpc.StatusCode.OK


@pytest.mark.parametrize("payload", GARBAGE)
def test_undecodable_bytes_are_invalid_argument(payload: bytes) -> None:
    async def test(service: RouterService, channel: grpc.aio.Channel) -> None:
        for method, streaming in (
            ("/kvserve.v1.KVServe/Generate", True),
            ("/kvserve.v1.KVServe/Abort", False),
            ("/kvserve.v1.KVServe/GetClusterStatus", False),
            ("/kvserve.v1.KVServe/WatchBlockPressure", True),
        ):
            assert await _raw_status(channel, method, payload, streaming) == grpc.StatusCode.INVALID_ARGUMENT, method

    run(test)


def test_unexpected_exception_is_internal_with_request_id_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    async def test(service: RouterService, channel: grpc.aio.Channel) -> None:
        def broken_submit(request: spb.GenerateRequest, time_remaining_s: float | None = None) -> None:
            raise TypeError("a bug in submit")

        service.router.submit = broken_submit  # type: ignore[method-assign]
        service.router.ready_event().set()
        stub = serving_pb2_grpc.KVServeStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            async for _ in stub.Generate(spb.GenerateRequest(request_id="bug-1", text="hi"), timeout=CALL_TIMEOUT):
                pass
        assert e.value.code() == grpc.StatusCode.INTERNAL
        assert "bug-1" in e.value.details() and "TypeError" not in e.value.details()

    with caplog.at_level(logging.ERROR, logger="kvserve.router.api.server"):
        run(test)
    records = [r for r in caplog.records if "bug-1" in r.getMessage()]
    assert len(records) == 1 and records[0].exc_info is not None
    assert "a bug in submit" in str(records[0].exc_info[1])


def test_health_not_serving_until_a_worker_is_ready_and_generate_waits_for_it() -> None:
    async def test(service: RouterService, channel: grpc.aio.Channel) -> None:
        health = health_pb2_grpc.HealthStub(channel)
        for name in ("", "kvserve.v1.KVServe"):
            reply = await health.Check(health_pb2.HealthCheckRequest(service=name), timeout=CALL_TIMEOUT)
            assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING

        ready = service.router.ready_event()
        submitted_when_ready: list[bool] = []

        def submit(request: spb.GenerateRequest, time_remaining_s: float | None = None) -> None:
            submitted_when_ready.append(ready.is_set())
            raise RouterError(grpc.StatusCode.FAILED_PRECONDITION, "reached submit")

        service.router.submit = submit  # type: ignore[method-assign]
        stub = serving_pb2_grpc.KVServeStub(channel)

        async def generate() -> grpc.StatusCode:
            try:
                async for _ in stub.Generate(spb.GenerateRequest(text="hi"), timeout=CALL_TIMEOUT):
                    pass
            except grpc.aio.AioRpcError as e:
                return e.code()
            return grpc.StatusCode.OK

        call = asyncio.ensure_future(generate())
        # The call is parked in the readiness wait once the event has a waiter.
        while not ready._waiters:  # type: ignore[attr-defined]
            await asyncio.sleep(0)
        assert not call.done()
        ready.set()
        assert await call == grpc.StatusCode.FAILED_PRECONDITION
        assert submitted_when_ready == [True]
        # Readiness itself follows the workers, not this event (tests/chaos/test_health.py).
    run(test, ready_timeout_s=CALL_TIMEOUT * 2)


def test_generate_during_startup_gives_up_after_ready_timeout() -> None:
    async def test(service: RouterService, channel: grpc.aio.Channel) -> None:
        stub = serving_pb2_grpc.KVServeStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            async for _ in stub.Generate(spb.GenerateRequest(text="hi"), timeout=CALL_TIMEOUT):
                pass
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE  # ready_timeout_s (0.2 s) < the deadline

    run(test)


def test_projected_wait_metric_reads_the_queue() -> None:
    from kvserve.router.observe import metrics

    async def test(service: RouterService, channel: grpc.aio.Channel) -> None:
        (family,) = metrics.ROUTER_PROJECTED_WAIT.collect()
        assert [s.value for s in family.samples] == [0.0]  # empty queue: no wait

    run(test)
