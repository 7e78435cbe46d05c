"""The client's UNAVAILABLE retries and default deadlines against scripted gRPC servers on
127.0.0.1 (no Ray): retried before the first response (a router restarting on the same port costs
one attempt), never after it; every call has a deadline even when none is given."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import socket
import threading
import time

import grpc
import pytest

from kvserve.cluster import client as client_module
from kvserve.cluster.client import AsyncKVServeClient, KVServeClient
from kvserve.protos.kvserve.v1 import serving_pb2 as spb
from kvserve.protos.kvserve.v1 import serving_pb2_grpc

RESTART_DELAY_S = 1.0  # how long the scripted "router" stays away


class _Unavailable(serving_pb2_grpc.KVServeServicer):
    """Answers the first ``failures`` Generates UNAVAILABLE, then streams [1, 2] and [3];
    ``mid_stream`` fails after the first message instead."""

    def __init__(self, failures: int, mid_stream: bool = False) -> None:
        self.failures, self.mid_stream = failures, mid_stream
        self.calls: list[float] = []
        self.deadlines: list[float | None] = []

    def Generate(self, request, context):  # noqa: N802, ANN001, ANN201 - gRPC servicer
        self.calls.append(time.monotonic())
        self.deadlines.append(context.time_remaining())
        if len(self.calls) <= self.failures and not self.mid_stream:
            context.abort(grpc.StatusCode.UNAVAILABLE, "no healthy worker")
        yield spb.GenerateResponse(request_id="r1", token_ids=[1, 2], text_delta="ab")
        if self.mid_stream:
            context.abort(grpc.StatusCode.UNAVAILABLE, "router going away")
        yield spb.GenerateResponse(request_id="r1", token_ids=[3], text_delta="c", finish_reason="length")

    def GetClusterStatus(self, request, context):  # noqa: N802, ANN001, ANN201
        self.deadlines.append(context.time_remaining())
        return spb.ClusterStatus()


def _serve(servicer: _Unavailable, port: int = 0) -> tuple[grpc.Server, int]:
    server = grpc.server(cf.ThreadPoolExecutor(4), options=[("grpc.so_reuseport", 0)])
    serving_pb2_grpc.add_KVServeServicer_to_server(servicer, server)
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    assert port
    server.start()
    return server, port


@pytest.fixture
def servers():
    started: list[grpc.Server] = []
    yield started
    for s in started:
        s.stop(None)


def test_unavailable_before_the_first_response_is_retried(servers) -> None:  # noqa: ANN001
    servicer = _Unavailable(failures=2)
    server, port = _serve(servicer)
    servers.append(server)
    with KVServeClient(f"127.0.0.1:{port}", timeout=10) as c:
        ids, text, final = c.generate_all([1])
    assert (ids, text, final.finish_reason) == ([1, 2, 3], "abc", "length")
    assert len(servicer.calls) == 3


def test_unavailable_after_the_first_response_is_raised_not_retried(servers) -> None:  # noqa: ANN001
    servicer = _Unavailable(failures=0, mid_stream=True)
    server, port = _serve(servicer)
    servers.append(server)
    with KVServeClient(f"127.0.0.1:{port}", timeout=10) as c:
        stream = c.generate([1])
        assert list(next(stream).token_ids) == [1, 2]
        with pytest.raises(grpc.RpcError) as e:
            next(stream)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert len(servicer.calls) == 1  # a retry would have repeated tokens 1 and 2


def test_a_router_restarting_on_the_same_port_costs_one_retry(servers) -> None:  # noqa: ANN001
    """The port is closed when the Generate starts (the router just died) and serves again a second
    later (``kvserve serve`` restarted it): the call succeeds, with 2 attempts, not 5."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    servicer = _Unavailable(failures=0)

    def restart() -> None:
        time.sleep(RESTART_DELAY_S)  # NOTE: this is the outage being simulated, not a race fix
        servers.append(_serve(servicer, port)[0])

    thread = threading.Thread(target=restart)
    thread.start()
    try:
        with KVServeClient(f"127.0.0.1:{port}", timeout=30, max_attempts=2) as c:
            t0 = time.monotonic()
            ids, _, _ = c.generate_all([1])
    finally:
        thread.join()
    assert ids == [1, 2, 3] and len(servicer.calls) == 1
    assert time.monotonic() - t0 >= RESTART_DELAY_S * 0.9


def test_async_client_retries_unavailable_too(servers) -> None:  # noqa: ANN001
    servicer = _Unavailable(failures=1)
    server, port = _serve(servicer)
    servers.append(server)

    async def run() -> list[int]:
        async with AsyncKVServeClient(f"127.0.0.1:{port}", timeout=10) as ac:
            return (await ac.generate_all([1]))[0]

    assert asyncio.run(run()) == [1, 2, 3] and len(servicer.calls) == 2


def test_every_call_has_a_deadline_by_default(servers) -> None:  # noqa: ANN001
    servicer = _Unavailable(failures=0)
    server, port = _serve(servicer)
    servers.append(server)
    with KVServeClient(f"127.0.0.1:{port}") as c:  # no timeout anywhere
        c.generate_all([1])
        c.status()
    generate_deadline, status_deadline = servicer.deadlines
    assert generate_deadline is not None and status_deadline is not None
    # NOTE: within 5 s either way: gRPC rounds a deadline on the wire, and this box is slow.
    assert abs(generate_deadline - client_module.DEFAULT_GENERATE_TIMEOUT_S) < 5
    assert abs(status_deadline - client_module.DEFAULT_CALL_TIMEOUT_S) < 5
