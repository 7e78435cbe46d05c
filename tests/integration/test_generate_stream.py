"""``KVServe.GenerateStream``: many requests on one stream, one GenerateBatch per worker step, unbatched by
request id; tokens equal the offline engine's; refusals, cancels and a closed stream end cleanly and free
every block. A real two-worker cluster, real gRPC on 127.0.0.1."""

from __future__ import annotations

import asyncio
from collections import defaultdict

import grpc
import pytest

from kvserve.protos.kvserve.v1 import serving_pb2 as spb
from kvserve.protos.kvserve.v1 import serving_pb2_grpc
from kvserve.router.requests.mux import batch_responses, column_entries
from tests.integration.test_router import client, cluster, greedy, llm, rand_prompt, wait_idle  # noqa: F401

MAX_TOKENS = 16


def _gen(rid: str, prompt: list[int], max_tokens: int = MAX_TOKENS) -> spb.GenerateStreamRequest:
    return spb.GenerateStreamRequest(generate=spb.GenerateRequest(
        request_id=rid, token_ids=spb.TokenIds(ids=prompt),
        sampling=spb.SamplingParams(max_tokens=max_tokens, ignore_eos=True)))  # fmt: skip


async def _run(address: str, messages: list, close_after_first_batch: bool = False, columns: list | None = None):
    """(tokens per request, finish reasons, errors, batches received) of one GenerateStream; the
    batches' column entries are appended to ``columns`` when given."""
    tokens: dict[str, list[int]] = defaultdict(list)
    finish: dict[str, str] = {}
    errors: dict[str, spb.RequestError] = {}
    batches = 0

    async def requests():  # noqa: ANN202 - an async generator of messages
        for m in messages:
            yield m

    async with grpc.aio.insecure_channel(address) as channel:
        call = serving_pb2_grpc.KVServeStub(channel).GenerateStream(requests(), timeout=120)
        async for batch in call:
            batches += 1
            if columns is not None:
                columns.extend(column_entries(batch.columns))
            for resp in batch_responses(batch):
                tokens[resp.request_id].extend(resp.token_ids)
                if resp.finish_reason:
                    finish[resp.request_id] = resp.finish_reason
            for err in batch.errors:
                errors[err.request_id] = err
            if close_after_first_batch:
                call.cancel()
                break
    return tokens, finish, errors, batches


def test_many_requests_on_one_stream_equal_offline_greedy(cluster, client, llm):  # noqa: F811
    prompts = [rand_prompt(900 + i, n) for i, n in enumerate((5, 17, 33, 48, 9, 64, 12, 30))]
    expected = greedy(llm, prompts, MAX_TOKENS)
    messages = [_gen(f"s{i}", p) for i, p in enumerate(prompts)]
    tokens, finish, errors, batches = asyncio.run(_run(cluster.address, messages))
    assert not errors
    assert [tokens[f"s{i}"] for i in range(len(prompts))] == [e.token_ids for e in expected]
    assert set(finish.values()) == {"length"}
    # One message per step for all of them, not one per request and step.
    assert batches < len(prompts) * MAX_TOKENS / 2, batches
    wait_idle(client, cluster)


@pytest.mark.parametrize("reads_columns", [True, False], ids=["token-columns", "responses-only"])
def test_plain_tokens_come_as_columns_only_to_a_client_that_reads_them(cluster, client, llm, reads_columns):  # noqa: F811
    """The router's fast path end to end: real workers send their plain outputs as columns, the router
    delivers them as column entries to a stream that asked (token-exact, in order), and a client that
    did not ask gets every token as responses."""
    prompts = [rand_prompt(940 + i, n) for i, n in enumerate((7, 21, 40, 13))]
    expected = greedy(llm, prompts, MAX_TOKENS)
    messages = [_gen(f"c{i}", p) for i, p in enumerate(prompts)]
    if reads_columns:
        messages.insert(0, spb.GenerateStreamRequest(token_columns=True))
    columns: list = []
    tokens, finish, errors, _ = asyncio.run(_run(cluster.address, messages, columns=columns))
    assert not errors
    assert [tokens[f"c{i}"] for i in range(len(prompts))] == [e.token_ids for e in expected]
    assert set(finish.values()) == {"length"}
    if reads_columns:  # NOTE: all but each request's first and last token can ride the columns
        assert sum(len(ids) for _, ids, _, _ in columns) >= len(prompts) * (MAX_TOKENS - 2) // 2
        assert {w for _, _, _, w in columns} <= {"worker-0", "worker-1"}
    else:
        assert not columns
    wait_idle(client, cluster)


def test_refusals_and_cancels_are_per_request(cluster, client):  # noqa: F811
    bad = _gen("bad", rand_prompt(2, 8))
    bad.generate.token_ids.ids.append(10**8)  # not in the vocabulary: refused, the stream goes on
    messages = [
        _gen("ok", rand_prompt(1, 8)),
        bad,
        _gen("long", rand_prompt(4, 8), max_tokens=200),
        spb.GenerateStreamRequest(cancel_request_id="long"),
    ]
    tokens, finish, errors, _ = asyncio.run(_run(cluster.address, messages))
    assert finish == {"ok": "length"} and len(tokens["ok"]) == MAX_TOKENS
    assert errors["bad"].code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "bad" not in tokens
    assert errors["long"].code == grpc.StatusCode.CANCELLED.value[0] and len(tokens["long"]) < 200
    wait_idle(client, cluster)


@pytest.mark.parametrize("rid", ["", "dup"])
def test_an_id_that_cannot_be_answered_ends_the_stream_and_frees_its_requests(cluster, client, rid):  # noqa: F811
    messages = [_gen("dup", rand_prompt(7, 20), max_tokens=400), _gen(rid, rand_prompt(8, 8))]
    with pytest.raises(grpc.aio.AioRpcError) as e:
        asyncio.run(_run(cluster.address, messages))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "request_id" in e.value.details()
    wait_idle(client, cluster)


def test_closing_the_stream_cancels_its_requests_and_frees_their_blocks(cluster, client):  # noqa: F811
    steps_before = {w.worker_id: w.report.decode_steps for w in client.status().workers}
    messages = [_gen(f"c{i}", rand_prompt(50 + i, 20), max_tokens=1500) for i in range(8)]
    tokens, finish, errors, _ = asyncio.run(_run(cluster.address, messages, close_after_first_batch=True))
    assert not finish and not errors and tokens
    idle = wait_idle(client, cluster)  # no request left at the router, no used block on any worker
    # Cancelled at once, not stopped by the slow-consumer rule (which would take max_buffered_responses,
    # 256, unsent steps) nor run to their 1500 tokens.
    steps = {w.worker_id: w.report.decode_steps - steps_before[w.worker_id] for w in idle.workers}
    assert max(steps.values()) < 200, steps


def test_an_undecodable_message_ends_the_stream_invalid_argument(cluster):  # noqa: F811
    async def go() -> grpc.StatusCode:
        async with grpc.aio.insecure_channel(cluster.address) as channel:
            call = channel.stream_stream("/kvserve.v1.KVServe/GenerateStream")(iter([b"\xff\xff\xff"]), timeout=30)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                async for _ in call:
                    pass
            return e.value.code()

    assert asyncio.run(go()) == grpc.StatusCode.INVALID_ARGUMENT
