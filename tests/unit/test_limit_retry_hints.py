"""Every RESOURCE_EXHAUSTED of kvserve/router/gate/limits.py carries a retry hint (issue 41: 144
``max_streams_per_client`` refusals had none); a client over its stream limit is told when its first
stream is expected to end."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import grpc
import pytest

from kvserve.router.gate.bounds import Bounds
from kvserve.router.gate.limits import UNKNOWN_RETRY_MS, ClientStreams, LimitExceeded, WatcherSlots
from kvserve.router.policy.service_times import ServiceTimes


@dataclass
class _Req:
    max_tokens: int = 100
    started_at: float | None = None
    finished: bool = False
    params: SimpleNamespace = field(init=False)

    def __post_init__(self) -> None:
        self.params = SimpleNamespace(max_tokens=self.max_tokens)


def _refusal(streams: ClientStreams, client: str) -> LimitExceeded:
    with pytest.raises(LimitExceeded) as e, streams.reserve(client, 1):
        pass
    return e.value


def test_a_stream_limit_refusal_carries_the_hint_from_the_clients_live_streams() -> None:
    seen: list[list[_Req]] = []
    streams = ClientStreams(limit=2, retry_after_ms=lambda live: seen.append(list(live)) or 1234)
    live = [_Req(), _Req()]
    with streams.reserve("c", 2):
        streams.track("c", live)
    e = _refusal(streams, "c")
    assert e.retry_after_ms == 1234 and seen == [live]
    assert dict(e.trailers) == {"retry-after-ms": "1234"}


def test_every_concurrency_refusal_has_a_retry_hint() -> None:
    streams = ClientStreams(limit=0)
    assert dict(_refusal(streams, "c").trailers) == {"retry-after-ms": str(UNKNOWN_RETRY_MS)}
    watchers = WatcherSlots(limit=0)
    with pytest.raises(LimitExceeded) as e, watchers.hold():
        pass
    assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "retry-after-ms" in dict(e.value.trailers)
    invalid = LimitExceeded(grpc.StatusCode.INVALID_ARGUMENT, "max_stop_token_ids", "too many")
    assert invalid.trailers == ()  # a size bound: retrying the same call cannot help


def test_the_hint_is_when_the_first_live_stream_is_expected_to_end() -> None:
    service = ServiceTimes()
    router = SimpleNamespace(queue=SimpleNamespace(service=service))
    bounds = SimpleNamespace(router=router)
    now = time.monotonic()
    live = [_Req(started_at=now - 1.0), _Req(started_at=now - 3.0)]
    assert Bounds._stream_ends_ms(bounds, live) == UNKNOWN_RETRY_MS  # nothing measured yet
    for _ in range(4):
        service.observe(4.0, 100)  # 4 s per 100-token request
    hint = Bounds._stream_ends_ms(bounds, live)
    assert 900 <= hint <= 1000  # the older stream has about 1 s left
    assert Bounds._stream_ends_ms(bounds, [_Req(started_at=now - 60.0)]) == 100  # overdue: the floor


def test_a_frontends_prompt_queue_refusal_has_a_retry_hint() -> None:
    import asyncio

    from kvserve.frontend.relay import frontend_prompts, prepare
    from kvserve.protos.kvserve.v1 import serving_pb2 as spb
    from kvserve.router.gate.limits import InputLimits
    from kvserve.router.requests.request import RouterError

    prompts = frontend_prompts(
        tokenizer=None, template=None, limits=InputLimits(prompt_threads=1, max_pending_prompts=0)
    )
    with pytest.raises(RouterError) as e:
        asyncio.run(prepare(prompts, spb.GenerateRequest(text="hello")))
    assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "retry-after-ms" in dict(e.value.trailers)
