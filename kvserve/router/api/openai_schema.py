"""OpenAI's HTTP request schema -> kvserve's protos: request bodies -> ``GenerateRequest`` protos, and the
router's refusals -> OpenAI errors. Pure functions and types: no server, no event loop
(``kvserve/router/api/http_api.py`` serves them; responses are ``kvserve/router/api/openai_output.py``).

The bodies check only JSON types and the OpenAI-specific fields (``n``, ``stream_options``,
``top_logprobs``...); ranges are the router's (``kvserve/router/gate/validation.py``), and its
``ValidationError`` field is mapped back to the OpenAI parameter name in the error's ``param``.

Status mapping (the gRPC status the router returns -> HTTP): INVALID_ARGUMENT 400,
UNAUTHENTICATED 401, RESOURCE_EXHAUSTED 429 with ``Retry-After`` (seconds) and ``retry-after-ms``
(the OpenAI client honours both), UNAVAILABLE 503. Errors use OpenAI's shape:
``{"error": {"message", "type", "param", "code"}}``.

Field mapping: ``max_tokens``/``max_completion_tokens`` -> max_tokens; ``temperature``, ``top_p``,
``top_k`` (-1 or 0 = off, as vLLM), ``seed``, ``stop``, ``stop_token_ids``/``ignore_eos`` (vLLM
extensions), ``logprobs``/``top_logprobs``, ``priority`` (extension); ``user`` -> the tenant, so
different users never share prefix-cache blocks (the cache is salted per tenant); ``n`` > 1 runs n
requests on the same prompt (after the first one's blocks are cached the others reuse its prefix),
choice j seeded ``seed + j`` when a seed is given (else they would all be equal). Unknown fields are
ignored, as OpenAI does.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Annotated, Any, Literal

import grpc
from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from kvserve.protos.kvserve.v1 import serving_pb2 as spb
from kvserve.router.requests.request import RouterError

MAX_N = 16
MAX_TOP_LOGPROBS = 20
_INT32_MAX = (1 << 31) - 1
_UINT32_MAX = (1 << 32) - 1

_HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "invalid_request_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.CANCELLED: (499, "cancelled"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
}
# The router's field names -> OpenAI parameter names (the rest keep theirs, less "sampling.").
_PARAM_NAMES = {
    "prompt.text": "prompt",
    "prompt.token_ids": "prompt",
    "sampling.max_tokens": "max_tokens",
    "tenant": "user",
    "request_id": None,
}
_FIELD_PREFIX = re.compile(r"([A-Za-z_][\w.\[\]]*): ")


# ---- request bodies (types only; ranges are the router's) ---------------------------------------------
def _unicode(s: str) -> str:
    """Refuses a string protobuf cannot carry (a lone surrogate such as ``"\\ud800"`` is valid JSON but
    not Unicode text): a 400 naming the field, not a 500 when the request proto is built."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"not valid Unicode text (a lone surrogate at index {e.start})") from None
    return s


# NOTE: every string and token id a request proto will carry is bounded to what the proto field
# holds (UTF-8 text, int32), so no JSON value can fail while the proto is built (issue 42: 2**40
# in ``prompt`` and ``"\\ud800"`` were 500s). Ranges proper (vocab, lengths) stay the router's.
Text = Annotated[str, AfterValidator(_unicode)]
TokenId = Annotated[int, Field(ge=-(1 << 31), le=_INT32_MAX)]


class _Body(BaseModel):
    # NOTE: strict: "0.5" for a number is a 400, as OpenAI answers it (ints still pass as floats).
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Body):
    include_usage: bool = False


class _SamplingBody(_Body):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1, le=_UINT32_MAX)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = Field(None, ge=-1, le=_UINT32_MAX)
    seed: int | None = Field(None, ge=0, lt=1 << 64)
    stop: Text | list[Text] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Text | None = None
    priority: int = Field(0, ge=-_INT32_MAX, le=_INT32_MAX)
    return_token_ids: bool = False  # extension (as vLLM): each choice/chunk carries its token ids


class CompletionBody(_SamplingBody):
    prompt: Text | list[TokenId] | list[Text] | list[list[TokenId]]
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False


class TextPart(_Body):
    type: Literal["text"]
    text: Text


class MessageBody(_Body):
    role: Text
    content: Text | list[TextPart] | None = None


class ChatBody(_SamplingBody):
    messages: list[MessageBody]
    max_completion_tokens: int | None = Field(None, ge=1, le=_UINT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)


# ---- errors ---------------------------------------------------------------------------------------------
class ApiError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(self, status: int, message: str, type_: str, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.headers = status, message, type_, param, headers or {}

    def body(self) -> dict[str, Any]:
        """The JSON body of the error response."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": None}}


def _param(field: str, chat: bool) -> str | None:
    if field in _PARAM_NAMES:
        return _PARAM_NAMES[field]
    if field.startswith("prompt.messages"):
        return field.removeprefix("prompt.")
    if field == "sampling.logprobs":
        return "top_logprobs" if chat else "logprobs"
    return field.removeprefix("sampling.")


def api_error(e: RouterError, chat: bool = False) -> ApiError:
    """The router's refusal as an HTTP error: status, OpenAI type, the parameter it names."""
    status, type_ = _HTTP_STATUS.get(e.code, (500, "server_error"))
    param = None
    m = _FIELD_PREFIX.match(e.message)
    if m and e.code == grpc.StatusCode.INVALID_ARGUMENT:
        param = _param(m.group(1), chat)
    headers: dict[str, str] = {}
    retry_ms = dict(e.trailers).get("retry-after-ms")
    if retry_ms is not None:
        headers = {"retry-after-ms": retry_ms, "Retry-After": str(max(1, math.ceil(int(retry_ms) / 1000)))}
    return ApiError(status, e.message, type_, param, headers)


def bad_request(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", "invalid_request_error", param)


# ---- body -> GenerateRequests -------------------------------------------------------------------------
def _sampling(
    body: _SamplingBody, max_tokens: int | None, logprobs: int | None, seed_offset: int
) -> spb.SamplingParams:
    s = spb.SamplingParams(max_tokens=max_tokens or 0, ignore_eos=body.ignore_eos)
    if body.temperature is not None:
        s.temperature = body.temperature
    if body.top_p is not None:
        s.top_p = body.top_p
    if body.top_k is not None and body.top_k > 0:
        s.top_k = body.top_k
    if body.seed is not None:
        s.seed = (body.seed + seed_offset) % (1 << 64)
    if body.stop is not None:
        s.stop.extend([body.stop] if isinstance(body.stop, str) else body.stop)
    if body.stop_token_ids:
        s.stop_token_ids.extend(body.stop_token_ids)
    if logprobs is not None:
        s.logprobs = logprobs
    return s


def completion_requests(body: CompletionBody) -> list[spb.GenerateRequest]:
    """One GenerateRequest per (prompt, choice), in OpenAI's choice order (prompt-major)."""
    if body.echo:
        raise bad_request("echo", "not supported")
    prompts = prompts_of(body)
    if not prompts:
        raise bad_request("prompt", "empty prompt")
    out = []
    for p in prompts:
        for j in range(body.n):
            r = spb.GenerateRequest(priority=body.priority, tenant=body.user or "")
            if isinstance(p, str):
                r.text = p
            else:
                r.token_ids.ids.extend(p)
            r.sampling.CopyFrom(_sampling(body, body.max_tokens, body.logprobs, j))
            out.append(r)
    return out


def prompts_of(body: CompletionBody) -> list[str | list[int]]:
    """The completion's prompts: one text or id list, or a list of them."""
    if isinstance(body.prompt, str) or (body.prompt and isinstance(body.prompt[0], int)):
        return [body.prompt]  # type: ignore[list-item]
    return list(body.prompt)  # type: ignore[arg-type]


def _content(m: MessageBody) -> str:
    if m.content is None:
        return ""  # the router names messages[i].content: empty
    if isinstance(m.content, str):
        return m.content
    return "\n".join(part.text for part in m.content)  # NOTE: text parts joined as vLLM does


def chat_requests(body: ChatBody) -> list[spb.GenerateRequest]:
    """n GenerateRequests of the chat (the router renders it with the model's template)."""
    messages = spb.ChatMessages()
    for m in body.messages:
        messages.messages.add(role=m.role, content=_content(m))
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs", "needs logprobs: true")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    max_tokens = body.max_completion_tokens or body.max_tokens
    out = []
    for j in range(body.n):
        r = spb.GenerateRequest(messages=messages, priority=body.priority, tenant=body.user or "")
        r.sampling.CopyFrom(_sampling(body, max_tokens, logprobs, j))
        out.append(r)
    return out


def deadline_error(timeout_s: float) -> RouterError:
    """How a request that outlived the server's HTTP deadline ends."""
    return RouterError(grpc.StatusCode.DEADLINE_EXCEEDED,
                       f"the request did not finish within the server's HTTP deadline of {timeout_s:g}s "
                       "(--http-default-timeout-s)")  # fmt: skip


def top_logprobs(body: Any, chat: bool) -> int:
    """How many most likely tokens to list per output token (0 when logprobs are off)."""
    if chat:
        return (body.top_logprobs or 0) if body.logprobs else 0
    return body.logprobs or 0


def error_param(loc: tuple) -> str | None:
    """Pydantic's error location -> ``messages[0].content`` style (union member names dropped)."""
    parts = [p for p in loc if p != "body"]
    out = ""
    for p in parts:
        if isinstance(p, int):
            out += f"[{p}]"
        elif p.startswith(("str", "list[", "int", "float", "bool", "function-")) or p in ("TextPart",):
            break  # pydantic names the union member it tried; the field is what came before
        else:
            out += ("." if out else "") + p
    return out or None


def invalid_body(errors: Sequence[Any]) -> ApiError:
    """Pydantic's errors of a request body -> one 400 naming the OpenAI parameter."""
    # NOTE: of a union's member errors ours (a lone surrogate) then the deepest say most ([2**40]
    # for ``prompt``: the id is over int32, not "a valid string"); ties keep pydantic's order.
    err = max(errors, key=lambda x: (x.get("type") == "value_error", len(x.get("loc", ()))),
              default={"loc": (), "msg": "invalid request"})  # fmt: skip
    param = error_param(err.get("loc", ()))
    return ApiError(400, f"{param or 'body'}: {err.get('msg')}", "invalid_request_error", param)
