"""Router.stream merges the responses a slow client left waiting (fewer, larger messages)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kvserve.protos.kvserve.v1 import serving_pb2 as spb
from kvserve.router.requests.demux import stream_responses
from kvserve.router.requests.request import RouterError
from kvserve.router.requests.router import RouterRequest
from kvserve.workers.core.sampling_params import SamplingParams


def _request() -> RouterRequest:
    return RouterRequest("r", [1, 2, 3], SamplingParams(max_tokens=8), 0, "", (), 1)


def _resp(tokens: list[int], worker: str = "a", finish: str = "") -> spb.GenerateResponse:
    lps = [spb.TokenLogprobs(logprob=-float(t)) for t in tokens]
    return spb.GenerateResponse(
        request_id="r", token_ids=tokens, text_delta="".join(f"<{t}>" for t in tokens), worker_id=worker,
        finish_reason=finish, logprobs=lps,
    )  # fmt: skip


def _collect(items: list[spb.GenerateResponse | RouterError]) -> tuple[list[spb.GenerateResponse], Exception | None]:
    async def run() -> tuple[list[spb.GenerateResponse], Exception | None]:
        r = _request()
        for item in items:
            r.responses.put_nowait(item)
        got: list[spb.GenerateResponse] = []
        try:
            async for resp in stream_responses(r):
                got.append(resp)
        except RouterError as e:
            return got, e
        return got, None

    return asyncio.run(run())


def test_waiting_responses_merge_into_one_with_the_final_fields() -> None:
    final = _resp([13], finish="length")
    final.usage.completion_tokens = 4
    got, err = _collect([_resp([10]), _resp([11, 12]), final])
    assert err is None and len(got) == 1
    (m,) = got
    assert list(m.token_ids) == [10, 11, 12, 13]
    assert [lp.logprob for lp in m.logprobs] == [-10.0, -11.0, -12.0, -13.0]
    assert m.text_delta == "<10><11><12><13>"
    assert m.finish_reason == "length" and m.usage.completion_tokens == 4


def test_responses_of_different_workers_are_not_merged() -> None:
    got, _ = _collect([_resp([10], "a"), _resp([11], "a"), _resp([12], "b", finish="stop")])
    assert [(list(g.token_ids), g.worker_id) for g in got] == [([10, 11], "a"), ([12], "b")]


def test_an_error_after_waiting_responses_is_raised_after_them() -> None:
    err_in = RouterError(grpc.StatusCode.UNAVAILABLE, "worker died")
    got, err = _collect([_resp([10]), _resp([11]), err_in])
    assert [list(g.token_ids) for g in got] == [[10, 11]]
    assert err is err_in


@pytest.mark.parametrize("n", [1, 5])
def test_nothing_is_lost_or_duplicated(n: int) -> None:
    items = [_resp([i]) for i in range(n)] + [_resp([n], finish="stop")]
    got, _ = _collect(items)
    assert [t for g in got for t in g.token_ids] == list(range(n + 1))
