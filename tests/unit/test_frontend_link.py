"""A frontend's relay of one request (kvserve/frontend/link.py ``RelayedRequest``), without a router: the
slow-consumer rule, cancels sent once, refusals named by the field the caller sent, merging."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kvserve.frontend.link import RelayedRequest, request_error
from kvserve.protos.kvserve.v1 import serving_pb2 as spb
from kvserve.router.requests.request import RouterError


class FakeConnection:
    def __init__(self) -> None:
        self.cancels: list[str] = []

    def send_cancel(self, request_id: str) -> None:
        self.cancels.append(request_id)


def _resp(tokens: list[int], worker: str = "w0", finish: str = "") -> spb.GenerateResponse:
    return spb.GenerateResponse(request_id="r", token_ids=tokens, text_delta="x" * len(tokens), worker_id=worker,
                                finish_reason=finish)  # fmt: skip


async def _drain(rr: RelayedRequest) -> list[spb.GenerateResponse]:
    return [r async for r in rr.responses()]


def test_a_caller_that_does_not_read_is_cancelled_resource_exhausted() -> None:
    conn = FakeConnection()
    rr = RelayedRequest(conn, "r", max_buffered=3)  # type: ignore[arg-type]
    for i in range(5):
        rr.put(_resp([i]))
    assert conn.cancels == ["r"] and rr.finished
    with pytest.raises(RouterError) as e:
        asyncio.run(_drain(rr))
    assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_buffered_responses" in e.value.message
    rr.cancel()
    assert conn.cancels == ["r"], "a request that ended is not cancelled again"


def test_waiting_responses_merge_per_worker_in_order() -> None:
    rr = RelayedRequest(FakeConnection(), "r", max_buffered=100)  # type: ignore[arg-type]
    for item in (_resp([1]), _resp([2, 3]), _resp([4], worker="w1"), _resp([5], worker="w1", finish="length")):
        rr.put(item)
    got = asyncio.run(_drain(rr))
    assert [(list(r.token_ids), r.worker_id) for r in got] == [([1, 2, 3], "w0"), ([4, 5], "w1")]
    assert got[-1].finish_reason == "length"


def test_a_refusal_names_the_prompt_field_the_caller_sent() -> None:
    rr = RelayedRequest(FakeConnection(), "r", max_buffered=100)  # type: ignore[arg-type]
    rr.prompt_field = "prompt.text"
    too_long = "prompt.token_ids: 9000 tokens exceed max_model_len=2048"
    rr.put(request_error(spb.RequestError(request_id="r", code=grpc.StatusCode.INVALID_ARGUMENT.value[0],
                                          message=too_long)))  # fmt: skip
    first = asyncio.run(rr.first())
    assert isinstance(first, RouterError) and first.message.startswith("prompt.text: 9000 tokens")
    throttled = request_error(spb.RequestError(request_id="r", code=grpc.StatusCode.RESOURCE_EXHAUSTED.value[0],
                                               message="busy", retry_after_ms=250))  # fmt: skip
    assert throttled.trailers == (("retry-after-ms", "250"),)
