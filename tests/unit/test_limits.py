"""kvserve/router/gate/limits.py: each bound refuses with its knob named, and frees its slot however a call ends."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import grpc
import pytest

from kvserve.protos.kvserve.v1 import serving_pb2 as spb
from kvserve.router.gate.limits import (
    ClientStreams,
    InputLimits,
    LimitExceeded,
    WatcherSlots,
    check_request,
    client_of_peer,
)


@dataclass
class _Req:
    finished: bool = False


def test_streams_per_client_count_until_finished() -> None:
    streams = ClientStreams(limit=2)
    first = [_Req(), _Req()]
    with streams.reserve("10.0.0.1", 2):
        streams.track("10.0.0.1", first)
    with pytest.raises(LimitExceeded) as e, streams.reserve("10.0.0.1", 1):
        pass
    assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and e.value.limit == "max_streams_per_client"
    assert "max_streams_per_client" in str(e.value)
    with streams.reserve("10.0.0.2", 2):  # another client is not affected
        pass
    first[0].finished = True  # however it ended (finished, cancelled, failed): the router marks it
    with streams.reserve("10.0.0.1", 1):
        streams.track("10.0.0.1", [_Req()])
    assert streams.live("10.0.0.1") == 2


def test_reserved_slots_count_while_a_submit_is_in_flight() -> None:
    streams = ClientStreams(limit=3)
    with streams.reserve("c", 2):
        with pytest.raises(LimitExceeded), streams.reserve("c", 2):
            pass
    with streams.reserve("c", 3):  # released on the way out
        pass


def test_pressure_watchers_are_bounded_and_released() -> None:
    watchers = WatcherSlots(limit=1)
    with watchers.hold():
        with pytest.raises(LimitExceeded) as e, watchers.hold():
            pass
        assert e.value.limit == "max_pressure_watchers"
    with watchers.hold():
        pass
    assert watchers.active == 0


def _request(stop_ids: int = 0, logprobs: int | None = None, max_tokens: int = 0) -> spb.GenerateRequest:
    r = spb.GenerateRequest(token_ids=spb.TokenIds(ids=[1, 2]))
    r.sampling.stop_token_ids.extend([3] * stop_ids)
    r.sampling.max_tokens = max_tokens
    if logprobs is not None:
        r.sampling.logprobs = logprobs
    return r


@pytest.mark.parametrize(
    ("request_", "limit"),
    [
        (_request(stop_ids=257), "max_stop_token_ids"),
        (_request(logprobs=20, max_tokens=4000), "max_logprob_tokens"),
        (_request(logprobs=20), "max_logprob_tokens"),  # max_tokens unset: the default counts
    ],
)
def test_size_bounds_name_their_knob(request_: spb.GenerateRequest, limit: str) -> None:
    limits = InputLimits(max_logprob_tokens=4096)
    with pytest.raises(LimitExceeded) as e:
        check_request(request_, limits, default_max_tokens=256)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and e.value.limit == limit and limit in str(e.value)


def test_within_bounds_passes() -> None:
    check_request(_request(stop_ids=256, logprobs=5, max_tokens=100), InputLimits(), default_max_tokens=256)


@pytest.mark.parametrize(
    ("peer", "client"),
    [("ipv4:10.0.0.7:53211", "10.0.0.7"), ("ipv6:[::1]:5", "::1"), ("unix:/tmp/s", "unix:/tmp/s")],
)
def test_client_of_peer(peer: str, client: str) -> None:
    assert client_of_peer(peer) == client


def test_prompts_wait_in_a_bounded_queue() -> None:
    from kvserve.router.gate.prompt_preparer import PromptPreparer

    class SlowTokenizer:
        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            import time

            time.sleep(0.2)
            return [1, 2, 3]

    class FakeRouter:
        from kvserve.router.gate.validation import ModelLimits

        limits = ModelLimits(vocab_size=100, max_model_len=64)
        tokenizer = SlowTokenizer()
        chat_template = None

    async def test() -> None:
        preparer = PromptPreparer(FakeRouter(), threads=1, max_pending=2)  # type: ignore[arg-type]
        text = spb.GenerateRequest(text="hello")
        first = asyncio.ensure_future(preparer.prepare(text))
        second = asyncio.ensure_future(preparer.prepare(text))
        await asyncio.sleep(0)
        with pytest.raises(LimitExceeded) as e:
            await preparer.prepare(text)
        assert e.value.limit == "max_pending_prompts"
        for done in await asyncio.gather(first, second):
            assert list(done.token_ids.ids) == [1, 2, 3]
        assert preparer.pending == 0
        preparer.close()

    asyncio.run(test())
