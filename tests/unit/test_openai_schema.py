"""The OpenAI translation without a server (kvserve/router/api/openai_schema.py, openai_output.py): bodies ->
GenerateRequest protos, the router's refusals -> OpenAI errors, responses -> OpenAI objects and SSE chunks."""

from __future__ import annotations

import json

import grpc
import pytest

from kvserve.protos.kvserve.v1 import serving_pb2 as spb
from kvserve.router.api.openai_output import DONE, Chunks, Collected, TokenText
from kvserve.router.api.openai_schema import (
    ApiError,
    ChatBody,
    CompletionBody,
    api_error,
    chat_requests,
    completion_requests,
    invalid_body,
)
from kvserve.router.requests.request import RouterError


def test_a_completion_is_one_request_per_prompt_and_choice_prompt_major() -> None:
    body = CompletionBody(prompt=[[1, 2], [3]], n=2, seed=7, top_k=-1, stop="x", max_tokens=5, user="u")
    reqs = completion_requests(body)
    assert [list(r.token_ids.ids) for r in reqs] == [[1, 2], [1, 2], [3], [3]]
    assert [r.sampling.seed for r in reqs] == [7, 8, 7, 8]  # choice j seeded seed + j
    assert all(r.sampling.top_k == 0 and list(r.sampling.stop) == ["x"] and r.tenant == "u" for r in reqs)
    assert all(r.sampling.max_tokens == 5 and not r.sampling.HasField("logprobs") for r in reqs)


def test_a_chat_takes_max_completion_tokens_and_needs_logprobs_for_top_logprobs() -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    body = ChatBody(messages=[{"role": "user", "content": parts}], max_tokens=3, max_completion_tokens=9,
                    logprobs=True, top_logprobs=2)  # fmt: skip
    (r,) = chat_requests(body)
    assert r.messages.messages[0].content == "a\nb" and r.sampling.max_tokens == 9 and r.sampling.logprobs == 2
    with pytest.raises(ApiError) as e:
        chat_requests(ChatBody(messages=[{"role": "user", "content": "a"}], top_logprobs=2))
    assert (e.value.status, e.value.param) == (400, "top_logprobs")


def test_a_refusal_keeps_its_status_parameter_and_retry_hint() -> None:
    bad = api_error(RouterError(grpc.StatusCode.INVALID_ARGUMENT, "sampling.logprobs: too many"), chat=True)
    assert (bad.status, bad.type, bad.param) == (400, "invalid_request_error", "top_logprobs")
    busy = api_error(RouterError(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy", (("retry-after-ms", "1500"),)))
    assert busy.status == 429 and busy.headers == {"retry-after-ms": "1500", "Retry-After": "2"}
    assert busy.body() == {"error": {"message": "busy", "type": "rate_limit_error", "param": None, "code": None}}


def test_a_body_error_names_the_openai_parameter() -> None:
    loc = ("body", "messages", 0, "content")
    errors = [{"type": "string_type", "loc": (*loc, "str"), "msg": "bad"},
              {"type": "value_error", "loc": (*loc, "list[TextPart]"), "msg": "x"}]  # fmt: skip
    e = invalid_body(errors)
    assert (e.status, e.param, e.message) == (400, "messages[0].content", "messages[0].content: x")


def _resp(text: str, ids: list[int], finish: str = "", prompt: int = 0, completion: int = 0) -> spb.GenerateResponse:
    r = spb.GenerateResponse(text_delta=text, token_ids=ids, finish_reason=finish, worker_id="w0")
    r.usage.prompt_tokens, r.usage.completion_tokens = prompt, completion
    return r


def test_collected_choices_count_each_prompt_once() -> None:
    collected = Collected(2, chat=False, k=0, text=TokenText(None))
    collected.add(1, _resp("b", [2]))
    collected.add(0, _resp("a", [1], "stop", prompt=4, completion=1))
    collected.add(1, _resp("c", [3], "length", prompt=4, completion=2))
    obj = collected.result({"id": "cmpl-1"}, n=2, return_ids=True)
    assert obj["object"] == "text_completion"
    assert [(c["text"], c["token_ids"], c["finish_reason"]) for c in obj["choices"]] == [
        ("a", [1], "stop"), ("bc", [2, 3], "length")]  # fmt: skip
    assert obj["usage"]["prompt_tokens"] == 4 and obj["usage"]["completion_tokens"] == 3


def test_chat_chunks_open_with_the_role_and_end_with_usage() -> None:
    chunks = Chunks({"id": "c"}, 1, chat=True, k=0, text=TokenText(None), include_usage=True, return_ids=False)
    events = [*chunks.opening(), chunks.chunk(0, _resp("hi", [5])), chunks.chunk(0, _resp("", [], "stop", 3, 1))]
    events.append(chunks.usage_chunk(1))
    decoded = [json.loads(e.removeprefix("data: ")) for e in events]
    assert [d["choices"][0]["delta"] if d["choices"] else None for d in decoded] == [
        {"role": "assistant", "content": ""}, {"content": "hi"}, {}, None]  # fmt: skip
    assert decoded[2]["choices"][0]["finish_reason"] == "stop" and decoded[-1]["usage"]["total_tokens"] == 4
    assert all(d["object"] == "chat.completion.chunk" for d in decoded) and DONE == "data: [DONE]\n\n"
    error = json.loads(chunks.error(RouterError(grpc.StatusCode.UNAVAILABLE, "gone")).removeprefix("data: "))
    assert error["error"]["type"] == "service_unavailable"
