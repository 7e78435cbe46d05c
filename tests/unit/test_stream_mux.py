"""StreamMux: a GenerateStream's batch, built from the demux's response fields, one response per
request and worker, in arrival order; errors apart; a dropped request leaves nothing behind."""

from __future__ import annotations

import asyncio

import grpc

from kvserve.protos.kvserve.v1 import serving_pb2 as spb
from kvserve.router.requests.mux import StreamMux
from kvserve.router.requests.request import RouterError


def _fields(rid: str, ids: list[int], text: str, worker: str = "w0", **final: object) -> dict:
    return {"request_id": rid, "token_ids": ids, "text_delta": text, "worker_id": worker, **final}


def _lp(token: int, logprob: float) -> spb.TokenLogprobs:
    return spb.TokenLogprobs(logprobs={token: logprob})


def test_a_requests_consecutive_responses_from_one_worker_merge_until_its_final_one() -> None:
    async def test() -> None:
        mux = StreamMux()
        a, b = mux.slot("a"), mux.slot("b")
        a.put_nowait(_fields("a", [1], "x"))
        b.put_nowait(_fields("b", [7], "p"))
        a.put_nowait(_fields("a", [2, 3], "yz", logprobs=[_lp(2, -0.5), _lp(3, -0.25)]))
        a.put_nowait(_fields("a", [4], "!", finish_reason="stop", usage={"completion_tokens": 4}))
        assert a.qsize() == 3 and b.qsize() == 1
        batch = await mux.next_batch()
        assert [(r.request_id, list(r.token_ids), r.text_delta) for r in batch.responses] == [
            ("a", [1, 2, 3, 4], "xyz!"), ("b", [7], "p")]  # fmt: skip
        assert batch.responses[0].finish_reason == "stop" and batch.responses[0].usage.completion_tokens == 4
        assert [dict(lp.logprobs) for lp in batch.responses[0].logprobs] == [{2: -0.5}, {3: -0.25}]
        assert a.qsize() == 0 and a.empty()

    asyncio.run(test())


def test_another_worker_or_a_finished_response_starts_a_new_one() -> None:
    async def test() -> None:
        mux = StreamMux()
        a = mux.slot("a")
        a.put_nowait(_fields("a", [1], "x", worker="w0"))
        a.put_nowait(_fields("a", [2], "y", worker="w1"))  # a migration: worker_id must stay exact
        a.put_nowait(_fields("a", [3], "z", worker="w1", finish_reason="length"))
        a.put_nowait(_fields("a", [9], "!", worker="w1"))  # NOTE: nothing merges into a final response
        batch = mux.take()
        assert [(r.worker_id, list(r.token_ids)) for r in batch.responses] == [("w0", [1]), ("w1", [2, 3]), ("w1", [9])]

    asyncio.run(test())


def test_errors_ride_apart_and_a_dropped_request_leaves_nothing() -> None:
    async def test() -> None:
        mux = StreamMux()
        a, b = mux.slot("a"), mux.slot("b")
        a.put_nowait(_fields("a", [1], "x"))
        b.put_nowait(_fields("b", [5], "q"))
        b.get_nowait()  # the router dropped b's backlog (slow consumer)
        b.put_nowait(RouterError(grpc.StatusCode.RESOURCE_EXHAUSTED, "too slow", (("retry-after-ms", "250"),)))
        batch = mux.take()
        assert [r.request_id for r in batch.responses] == ["a"]
        (err,) = batch.errors
        assert err.request_id == "b" and err.message == "too slow" and err.retry_after_ms == 250
        assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]

    asyncio.run(test())
