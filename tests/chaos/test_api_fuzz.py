"""Hostile clients against a real ``kvserve serve``: any field values, and raw bytes that may not
even decode, get a clear status (INVALID_ARGUMENT, RESOURCE_EXHAUSTED, ALREADY_EXISTS) or a
stream, never INTERNAL or UNKNOWN; afterwards the cluster serves a normal request and every
block is free with every pool intact.

Each accepted request is cancelled after its first response (the client may always cancel), so
the run is bounded by the number of examples, not by what max_tokens they ask for.
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvserve.protos.kvserve.v1 import serving_pb2 as spb
from kvserve.protos.kvserve.v1 import serving_pb2_grpc
from tests.chaos.conftest import ServedCluster

CALL_TIMEOUT = 30.0
ALLOWED = {
    grpc.StatusCode.OK,  # a stream started (then cancelled by us)
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.ALREADY_EXISTS,
}
GENERATE = "/kvserve.v1.KVServe/Generate"
ABORT = "/kvserve.v1.KVServe/Abort"

_text = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=40)  # proto strings are UTF-8
_int32 = st.integers(-(2**31), 2**31 - 1)
_uint32 = st.integers(0, 2**32 - 1)
_token = st.one_of(st.integers(-3, 33_000), _int32)
_f32 = st.floats(width=32)  # NaN and infinities included
_small_uint = st.one_of(st.integers(0, 64), _uint32)


@st.composite
def _sampling(draw: st.DrawFn) -> spb.SamplingParams:
    msg = spb.SamplingParams(
        max_tokens=draw(_small_uint),
        temperature=draw(st.one_of(st.floats(0, 2, width=32), _f32)),
        top_k=draw(_small_uint),
        stop=draw(st.lists(_text, max_size=4)),
        stop_token_ids=draw(st.lists(_token, max_size=4)),
        ignore_eos=draw(st.booleans()),
    )
    if (top_p := draw(st.none() | st.floats(0, 1, width=32) | _f32)) is not None:
        msg.top_p = top_p
    if (seed := draw(st.none() | st.integers(0, 2**64 - 1))) is not None:
        msg.seed = seed
    if (logprobs := draw(st.none() | _small_uint)) is not None:
        msg.logprobs = logprobs
    return msg


@st.composite
def _requests(draw: st.DrawFn) -> spb.GenerateRequest:
    msg = spb.GenerateRequest(
        request_id=draw(st.one_of(st.just(""), st.sampled_from(["fuzz-a", "fuzz-b"]), _text)),
        priority=draw(st.one_of(st.integers(-2, 2), _int32)),
        tenant=draw(st.one_of(st.just(""), _text)),
    )
    if draw(st.booleans()):
        msg.sampling.CopyFrom(draw(_sampling()))
    kind = draw(st.sampled_from(["text", "ids", "none"]))
    if kind == "text":
        msg.text = draw(_text)
    elif kind == "ids":
        msg.token_ids.ids.extend(draw(st.lists(_token, max_size=40)))
    return msg


def _identity(b: bytes) -> bytes:
    return b


@pytest.fixture(scope="module")
def channel(served_cluster: ServedCluster) -> Iterator[grpc.Channel]:
    with served_cluster.channel() as ch:
        yield ch


def _first_response_status(call: grpc.Call) -> grpc.StatusCode:
    """Read until the first response or the end; cancel a stream that is still running."""
    try:
        for _ in call:
            break
    except grpc.RpcError as e:
        return e.code()
    call.cancel()
    return grpc.StatusCode.OK


def _check(code: grpc.StatusCode, what: object) -> None:
    event(code.name)  # --hypothesis-show-statistics: how many examples reached each outcome
    assert code in ALLOWED, f"{code} for {what!r}"


_FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)


@_FUZZ
@given(request=_requests())
def test_any_field_values_get_a_clear_status(channel: grpc.Channel, request: spb.GenerateRequest) -> None:
    call = serving_pb2_grpc.KVServeStub(channel).Generate(request, timeout=CALL_TIMEOUT)
    _check(_first_response_status(call), request)


@_FUZZ
@given(payload=st.one_of(st.binary(max_size=64), st.sampled_from([b"\xff" * 8, b"\x0a\x05ab", b"\x1a\x02\x08"])))
def test_raw_bytes_get_a_clear_status(channel: grpc.Channel, payload: bytes) -> None:
    generate = channel.unary_stream(GENERATE, request_serializer=_identity, response_deserializer=_identity)
    _check(_first_response_status(generate(payload, timeout=CALL_TIMEOUT)), payload)
    abort = channel.unary_unary(ABORT, request_serializer=_identity, response_deserializer=_identity)
    try:
        abort(payload, timeout=CALL_TIMEOUT)
    except grpc.RpcError as e:
        _check(e.code(), payload)


def test_cluster_serves_normally_after_the_fuzz(served_cluster: ServedCluster) -> None:
    """Last in the module: a plain request works and nothing leaked."""
    request = spb.GenerateRequest(
        token_ids=spb.TokenIds(ids=list(range(10, 30))),
        sampling=spb.SamplingParams(max_tokens=8, ignore_eos=True),
    )
    responses = served_cluster.generate(request)
    assert responses[-1].finish_reason == "length"
    assert sum(len(r.token_ids) for r in responses) == 8
    served_cluster.wait_idle()


def test_worker_pids_are_found_through_the_cluster(served_cluster: ServedCluster) -> None:
    pids = {w: served_cluster.worker_pid(w) for w in ("worker-0", "worker-1")}
    assert len(set(pids.values())) == 2
