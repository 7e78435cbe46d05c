"""The client's resume bookkeeping (kvserve/cluster/client.py ``ResumeCursor``, ``GenerateStream``; docs/architecture.md
2a "Resuming through another frontend"), on fake stubs: a stream cut UNAVAILABLE after its first responses resumes
through the next address with exactly what it yielded (id, token, tokens, text characters) and yields the rest once;
without a token, or refused, the error is raised; a fresh request's UNAVAILABLE is retried on the next address."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from kvserve.cluster.client import KVServeClient, ResumeCursor
from kvserve.protos.kvserve.v1 import serving_pb2 as spb

TOKEN = "ab" * 16


class _Error(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode) -> None:
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._code.name

    def trailing_metadata(self) -> tuple:
        return ()


class _Call:
    def __init__(self, responses: list[spb.GenerateResponse], error: grpc.StatusCode | None) -> None:
        self._it: Iterator[spb.GenerateResponse] = iter(responses)
        self._error = error

    def __next__(self) -> spb.GenerateResponse:
        try:
            return next(self._it)
        except StopIteration:
            if self._error is not None:
                raise _Error(self._error) from None
            raise

    def cancel(self) -> None:
        pass


class _Stub:
    """Answers each Generate with the next scripted (responses, error or None)."""

    def __init__(self, script: list[tuple[list[spb.GenerateResponse], grpc.StatusCode | None]]) -> None:
        self.script = script
        self.requests: list[spb.GenerateRequest] = []

    def Generate(self, request: spb.GenerateRequest, **_: Any) -> _Call:  # noqa: N802 - gRPC method name
        self.requests.append(request)
        return _Call(*self.script.pop(0))


def _resp(ids: list[int], text: str, token: str = "", finish: str = "") -> spb.GenerateResponse:
    return spb.GenerateResponse(request_id="req-1", token_ids=ids, text_delta=text, resume_token=token,
                                finish_reason=finish)  # fmt: skip


def _client(stubs: list[_Stub]) -> KVServeClient:
    client = KVServeClient([f"127.0.0.1:{9000 + i}" for i in range(len(stubs))])
    client._stub_at = lambda i: stubs[i % len(stubs)]  # type: ignore[method-assign]
    return client


def test_the_cursor_counts_what_was_yielded_and_builds_the_resume() -> None:
    c = ResumeCursor("")
    c.observe(_resp([1, 2], "hé", token=TOKEN))
    c.observe(_resp([3], "llo"))
    req = c.request()
    assert req.request_id == "req-1" and req.WhichOneof("prompt") is None
    assert (req.resume.token, req.resume.num_tokens, req.resume.num_text_chars) == (TOKEN, 3, 5)


def test_a_cut_stream_resumes_through_the_next_address_and_yields_each_token_once() -> None:
    first = _Stub([([_resp([1, 2], "ab", token=TOKEN), _resp([3], "c")], grpc.StatusCode.UNAVAILABLE)])
    second = _Stub([([_resp([4, 5], "de"), _resp([6], "f", finish="length")], None)])
    with _client([first, second]) as client:
        stream = client.generate([7, 8], max_tokens=6)
        got = list(stream)
    assert [t for r in got for t in r.token_ids] == [1, 2, 3, 4, 5, 6]
    assert "".join(r.text_delta for r in got) == "abcdef" and got[-1].finish_reason == "length"
    (resume,) = second.requests
    assert (resume.request_id, resume.resume.token, resume.resume.num_tokens, resume.resume.num_text_chars) == (
        "req-1", TOKEN, 3, 3)  # fmt: skip
    assert stream.resumes == 1 and len(first.requests) == 1


def test_a_resume_that_finds_a_dead_address_tries_the_next() -> None:
    cut = ([_resp([1], "a", token=TOKEN)], grpc.StatusCode.UNAVAILABLE)
    first = _Stub([cut, ([], grpc.StatusCode.UNAVAILABLE)])  # NOTE: second use: the dead frontend again
    second = _Stub([([], grpc.StatusCode.UNAVAILABLE), ([_resp([2], "b", finish="length")], None)])
    with _client([first, second]) as client:
        assert [t for r in client.generate([7], max_tokens=2) for t in r.token_ids] == [1, 2]
    assert [r.resume.num_tokens for r in first.requests[1:] + second.requests] == [1, 1, 1]


def test_without_a_token_or_when_refused_the_error_is_raised() -> None:
    no_token = _Stub([([_resp([1], "a")], grpc.StatusCode.UNAVAILABLE)])
    with _client([no_token, _Stub([])]) as client, pytest.raises(grpc.RpcError) as e:
        list(client.generate([7], max_tokens=2))
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    cut = _Stub([([_resp([1], "a", token=TOKEN)], grpc.StatusCode.UNAVAILABLE)])
    refused = _Stub([([], grpc.StatusCode.NOT_FOUND)])
    with _client([cut, refused]) as client, pytest.raises(grpc.RpcError) as e:
        list(client.generate([7], max_tokens=2))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND and len(refused.requests) == 1


def test_a_fresh_requests_unavailable_is_retried_on_the_next_address() -> None:
    dead = _Stub([([], grpc.StatusCode.UNAVAILABLE)])
    live = _Stub([([_resp([1], "a", finish="length")], None)])
    with _client([dead, live]) as client:
        assert [t for r in client.generate([7], max_tokens=1) for t in r.token_ids] == [1]
    assert live.requests[0].WhichOneof("prompt") == "token_ids"
