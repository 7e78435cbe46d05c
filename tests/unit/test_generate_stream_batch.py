"""GenerateStream batches: a frontend sends what it queued while its last message was being written as one
``GenerateStreamRequests`` message (``kvserve/frontend/link.py``), and the router reads a batch's messages in
order, each as if it came alone (``read_generate_stream``); a batch inside a batch is refused."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import pytest

from kvserve.frontend import link
from kvserve.frontend.link import MuxConnection
from kvserve.protos.kvserve.v1 import serving_pb2 as spb
from kvserve.router.api.grpc_surface import BATCH_TURN, read_generate_stream
from kvserve.router.requests.mux import StreamMux
from kvserve.router.requests.request import RouterError


@dataclass
class _Live:
    request_id: str
    finished: bool = False


def _gen(rid: str, prompt_len: int = 4) -> spb.GenerateStreamRequest:
    return spb.GenerateStreamRequest(
        generate=spb.GenerateRequest(request_id=rid, token_ids=spb.TokenIds(ids=[1] * prompt_len))
    )


def _batch(*msgs: spb.GenerateStreamRequest) -> spb.GenerateStreamRequest:
    return spb.GenerateStreamRequest(batch=spb.GenerateStreamRequests(requests=list(msgs)))


async def _iterate(*msgs: spb.GenerateStreamRequest) -> AsyncIterator[spb.GenerateStreamRequest]:
    for m in msgs:
        yield m


def _read(*wire: spb.GenerateStreamRequest) -> list[str]:
    """What the router does with ``wire``: ``submit <id>`` / ``cancel <id>`` in order."""
    seen: list[str] = []
    live: dict[str, _Live] = {}

    async def submit(rid: str, msg: spb.GenerateStreamRequest) -> None:
        live[rid] = _Live(rid)
        seen.append(f"submit {rid}")

    def cancel(r: _Live) -> None:
        r.finished = True
        seen.append(f"cancel {r.request_id}")

    asyncio.run(read_generate_stream(_iterate(*wire), StreamMux(), live, submit, cancel, columns=False))
    return seen


def test_a_batch_is_read_in_order_as_if_each_message_came_alone() -> None:
    cancel_a = spb.GenerateStreamRequest(cancel_request_id="a")
    alone = _read(_gen("a"), cancel_a, _gen("b"), _gen("c"))
    batched = _read(_batch(_gen("a"), cancel_a, _gen("b")), _gen("c"))
    assert batched == alone == ["submit a", "cancel a", "submit b", "submit c"]


def test_a_large_batch_is_read_whole() -> None:
    assert _read(_batch(*[_gen(f"r{i}") for i in range(300)])) == [f"submit r{i}" for i in range(300)]


def test_a_batch_inside_a_batch_is_invalid() -> None:
    with pytest.raises(RouterError) as e:
        _read(_batch(_gen("a"), _batch(_gen("b"))))
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "batch inside a batch" in str(e.value)


def test_a_batch_keeps_the_id_rules_of_its_messages() -> None:
    with pytest.raises(RouterError) as e:
        _read(_batch(_gen("a"), _gen("a")))
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "already in use" in str(e.value)


def _written(queued: list[spb.GenerateStreamRequest | None]) -> list[spb.GenerateStreamRequest]:
    """What the frontend's request iterator yields for a queue that already holds ``queued``."""

    async def run() -> list[spb.GenerateStreamRequest]:
        outbox: asyncio.Queue[spb.GenerateStreamRequest | None] = asyncio.Queue()
        for m in queued:
            outbox.put_nowait(m)
        return [m async for m in MuxConnection._requests(outbox)]

    return asyncio.run(run())


def _ids(msg: spb.GenerateStreamRequest) -> list[str]:
    msgs = msg.batch.requests if msg.WhichOneof("kind") == "batch" else [msg]
    return [m.generate.request_id for m in msgs]


def test_the_frontend_sends_what_is_queued_as_one_batch_and_a_lone_message_as_itself() -> None:
    out = _written([_gen("a"), _gen("b"), _gen("c"), None])
    assert [_ids(m) for m in out] == [["a", "b", "c"]]
    (alone,) = _written([_gen("a"), None])
    assert alone.WhichOneof("kind") == "generate"


def test_the_frontend_bounds_a_batch_by_count_and_by_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(link, "MAX_BATCH", 3)
    out = _written([_gen(f"r{i}") for i in range(7)] + [None])
    assert [_ids(m) for m in out] == [["r0", "r1", "r2"], ["r3", "r4", "r5"], ["r6"]]
    big = 4000  # tokens: each message is several KB
    monkeypatch.setattr(link, "MAX_BATCH", 64)
    monkeypatch.setattr(link, "MAX_BATCH_BYTES", 2 * _gen("x", big).ByteSize() + 10)
    out = _written([_gen(f"b{i}", big) for i in range(5)] + [None])
    assert [_ids(m) for m in out] == [["b0", "b1"], ["b2", "b3"], ["b4"]]  # none lost, none past the bound


def test_a_large_batch_does_not_hold_the_routers_loop() -> None:
    """A client's batch of thousands of messages is read a slice per loop turn: other streams go on meanwhile."""
    n = 20 * BATCH_TURN

    async def run() -> tuple[int, int]:
        turns = 0
        done = False

        async def other_stream() -> None:
            nonlocal turns
            while not done:
                turns += 1
                await asyncio.sleep(0)

        async def submit(rid: str, msg: spb.GenerateStreamRequest) -> None:
            live[rid] = _Live(rid)  # NOTE: never suspends, as a refusal or a cheap admission does not

        live: dict[str, _Live] = {}
        ticker = asyncio.create_task(other_stream())
        await asyncio.sleep(0)
        before = turns
        wire = _batch(*[_gen(f"r{i}") for i in range(n)])
        await read_generate_stream(_iterate(wire), StreamMux(), live, submit, lambda r: None, columns=False)
        done = True
        await ticker
        return turns - before, len(live)

    turns, read = asyncio.run(run())
    assert read == n and turns >= n // BATCH_TURN - 1, (turns, read)
