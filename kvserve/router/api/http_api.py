"""OpenAI-compatible HTTP API (``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``) and health.

Health (``kvserve/router/api/health.py``, open: probes carry no secret): ``/health`` and ``/health/ready`` answer
readiness (200 iff some worker can serve now, else 503: the same verdict as gRPC health), and
``/health/live`` liveness (200 while the router answers at all).

FastAPI + uvicorn (``HttpApiServer``), over an ``ApiBackend``: ``RouterBackend`` on the router's own
event loop beside ``grpc.aio`` (``--frontends 0``), or a frontend's relay to the router
(``kvserve/frontend/http_backend.py``, ``--frontends N``). Either way a request becomes ``GenerateRequest``
protos and goes through the very path a gRPC Generate takes (``Router.submit`` validates and admits
it into the one request table, its responses stream back, a cancel frees its blocks). So the HTTP
layer checks only JSON types and the OpenAI-specific fields (``n``, ``stream_options``,
``top_logprobs``...); ranges are the router's, and
its ``ValidationError`` field is mapped back to the OpenAI parameter name in the error's ``param``.

Status mapping (the gRPC status the router returns -> HTTP): INVALID_ARGUMENT 400,
UNAUTHENTICATED 401 (the router's bearer token, ``Authorization: Bearer``), RESOURCE_EXHAUSTED 429
with ``Retry-After`` (seconds) and ``retry-after-ms`` (the OpenAI client honours both), UNAVAILABLE
503. Errors use OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

Field mapping: ``max_tokens``/``max_completion_tokens`` -> max_tokens; ``temperature``, ``top_p``,
``top_k`` (-1 or 0 = off, as vLLM), ``seed``, ``stop``, ``stop_token_ids``/``ignore_eos`` (vLLM
extensions), ``logprobs``/``top_logprobs``, ``priority`` (extension); ``user`` -> the tenant, so
different users never share prefix-cache blocks (the cache is salted per tenant); ``n`` > 1 runs n
requests on the same prompt (after the first one's blocks are cached the others reuse its prefix),
choice j seeded ``seed + j`` when a seed is given (else they would all be equal). Unknown fields are
ignored, as OpenAI does.

A client that disconnects (stream or not) cancels its requests at once (``Router.cancel``), which
frees their blocks at the workers' next step. Usage (prompt, cached, completion tokens) and the
``x-`` extensions (workers, preemptions, swaps, migrations) come in the final object or, streaming
with ``stream_options.include_usage``, in the final chunk.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import math
import re
import socket
import ssl
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, Protocol

import grpc
import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from kvserve.protos.kvserve.v1 import serving_pb2 as spb
from kvserve.router.api.health import cluster_ready, serving_workers
from kvserve.router.gate.bounds import Bounds
from kvserve.router.gate.limits import InputLimits
from kvserve.router.gate.tenancy import Principal
from kvserve.router.observe.metrics import RouterMetrics
from kvserve.router.requests.demux import stream_responses
from kvserve.router.requests.router import Router, RouterError, RouterRequest

logger = logging.getLogger(__name__)

MAX_N = 16
MAX_TOP_LOGPROBS = 20
_INT32_MAX = (1 << 31) - 1
_UINT32_MAX = (1 << 32) - 1
_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/health/ready", "/health/live")

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
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": None}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


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


def _bad(param: str, message: str) -> ApiError:
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
        raise _bad("echo", "not supported")
    prompts = _prompts(body)
    if not prompts:
        raise _bad("prompt", "empty prompt")
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


def _prompts(body: CompletionBody) -> list[str | list[int]]:
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
        raise _bad("top_logprobs", "needs logprobs: true")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    max_tokens = body.max_completion_tokens or body.max_tokens
    out = []
    for j in range(body.n):
        r = spb.GenerateRequest(messages=messages, priority=body.priority, tenant=body.user or "")
        r.sampling.CopyFrom(_sampling(body, max_tokens, logprobs, j))
        out.append(r)
    return out


# ---- responses ------------------------------------------------------------------------------------------
@dataclass
class _Choice:
    """What one choice (one router request) accumulated."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    final: spb.GenerateResponse | None = None


def _usage(choices: list[_Choice], n: int) -> dict[str, Any]:
    finals = [c.final for c in choices if c.final is not None]
    # NOTE: OpenAI counts each prompt once, however many choices (n) it has.
    prompt = sum(c.final.usage.prompt_tokens for c in choices if c.final is not None and c.index % n == 0)
    completion = sum(f.usage.completion_tokens for f in finals)
    cached = sum(f.usage.cached_tokens for f in finals)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
        "x-cached-tokens": cached,
        "x-workers": [f.worker_id for f in finals],
        "x-preemptions": sum(f.num_preemptions for f in finals),
        "x-swaps": sum(f.num_swaps for f in finals),
        "x-migrations": sum(f.num_migrations for f in finals),
    }


class _TokenText:
    """Token id -> its text, for logprobs (``token_id:N`` when the model has no tokenizer, as vLLM)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer

    def __call__(self, token_id: int) -> str:
        if self._tok is None:
            return f"token_id:{token_id}"
        return self._tok.decode([token_id], skip_special_tokens=False)


def _chat_logprobs(resp: spb.GenerateResponse, k: int, text: _TokenText) -> list[dict[str, Any]]:
    out = []
    for tid, lp in zip(resp.token_ids, resp.logprobs, strict=False):
        tok = text(tid)
        top = sorted(lp.logprobs.items(), key=lambda kv: -kv[1])[:k]
        out.append({
            "token": tok, "logprob": lp.logprob, "bytes": list(tok.encode()),
            "top_logprobs": [{"token": text(t), "logprob": v, "bytes": list(text(t).encode())} for t, v in top],
        })  # fmt: skip
    return out


def _completion_logprobs(resp: spb.GenerateResponse, k: int, text: _TokenText, offset: int) -> dict[str, Any]:
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for tid, lp in zip(resp.token_ids, resp.logprobs, strict=False):
        tok = text(tid)
        tokens.append(tok)
        token_logprobs.append(lp.logprob)
        tops.append({text(t): v for t, v in sorted(lp.logprobs.items(), key=lambda kv: -kv[1])[:k]})
        offsets.append(offset)
        offset += len(tok)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


def _merge_logprobs(acc: dict[str, Any] | None, new: dict[str, Any], chat: bool) -> dict[str, Any]:
    if acc is None:
        return new
    if chat:
        acc["content"].extend(new["content"])
    else:
        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            acc[key].extend(new[key])
    return acc


# ---- where requests go ------------------------------------------------------------------------------------
class ApiBackend(Protocol):
    """What the HTTP API needs of whatever admits and streams its requests (the router in process,
    or a frontend's relay to it). A handle is one admitted request."""

    limits: InputLimits
    tokenizer: Any  # for logprobs' token text (None: ``token_id:N``)
    keyed: bool  # API keys are configured (kvserve/router/gate/tenancy.py)

    def principal(self, authorization: str | bytes | None) -> Principal | None: ...

    def names(self) -> tuple[str, ...]:
        """(served model name, model argument, the workers' model id); any may be empty."""
        ...

    default_timeout_s: float  # every HTTP request's deadline (``http_default_timeout_s``)

    async def submit(
        self, client: str, requests: list[spb.GenerateRequest], authorization: str | None, timeout_s: float
    ) -> list[Any]:
        """Admit every request or none, each within ``timeout_s`` from now; raises RouterError."""
        ...

    def expire(self, handle: Any, error: RouterError) -> None:
        """The request's deadline passed: unless it finished, abort it and end its stream with ``error``."""
        ...

    def responses(self, handle: Any) -> AsyncIterator[spb.GenerateResponse]:
        """One request's responses until its final one; RouterError if it ended abnormally."""
        ...

    def cancel(self, handle: Any) -> None:
        """Stop the request now unless it finished (its blocks are freed)."""
        ...

    def ready(self) -> tuple[bool, int | None]:
        """(some worker can serve now, how many can; None: not known here)."""
        ...


def deadline_error(timeout_s: float) -> RouterError:
    """How a request that outlived the server's HTTP deadline ends."""
    return RouterError(grpc.StatusCode.DEADLINE_EXCEEDED,
                       f"the request did not finish within the server's HTTP deadline of {timeout_s:g}s "
                       "(--http-default-timeout-s)")  # fmt: skip


class RouterBackend:
    """``ApiBackend`` over the Router in this process (on its event loop)."""

    def __init__(self, router: Router, bounds: Bounds | None = None) -> None:
        self.router = router
        self.bounds = bounds or Bounds(router)
        self.limits = self.bounds.limits
        self.tokenizer = router.tokenizer
        self.keyed = self.bounds.tenancy is not None
        self.default_timeout_s = router.config.http_default_timeout_s

    def principal(self, authorization: str | bytes | None) -> Principal | None:
        return self.bounds.principal(authorization)

    def names(self) -> tuple[str, ...]:
        c = self.router.config
        return c.served_model_name or "", c.model or "", self.router.model_id

    async def submit(
        self, client: str, requests: list[spb.GenerateRequest], authorization: str | None, timeout_s: float
    ) -> list[RouterRequest]:
        deadline = time.monotonic() + timeout_s
        return await self.bounds.submit_all(client, requests, lambda: deadline - time.monotonic(),
                                            who=self.bounds.principal(authorization))  # fmt: skip

    def expire(self, handle: RouterRequest, error: RouterError) -> None:
        if not handle.finished:
            self.router.lifecycle.cancel(handle)
            handle.responses.put_nowait(error)

    def responses(self, handle: RouterRequest) -> AsyncIterator[spb.GenerateResponse]:
        return stream_responses(handle)

    def cancel(self, handle: RouterRequest) -> None:
        if not handle.finished:
            self.router.lifecycle.cancel(handle)

    def ready(self) -> tuple[bool, int | None]:
        return cluster_ready(self.router), serving_workers(self.router)


# ---- the app --------------------------------------------------------------------------------------------
class OpenAIApi:
    """The FastAPI app over one ``ApiBackend``. Every handler runs on the backend's event loop."""

    def __init__(self, backend: ApiBackend, auth_token: str | None = None) -> None:
        self.backend = backend
        self.limits = backend.limits
        self._expected = f"Bearer {auth_token}".encode() if auth_token else None
        self._text = _TokenText(backend.tokenizer)
        self.app = FastAPI(title="kvserve OpenAI-compatible API", docs_url=None, redoc_url=None)
        self._routes()

    # -- plumbing --
    def model_name(self) -> str:
        """The served name, fixed from the start (as ``vllm serve --served-model-name``, default the model
        argument): a client that reads ``/v1/models`` before the workers are up gets the name it will use."""
        served, model, model_id = self.backend.names()
        return served or model or model_id or "kvserve"

    def _model_names(self) -> set[str]:
        """Names a request may give: the served name, the model argument and the workers' model id, each
        also as its last path component (the short name)."""
        names = {n for n in self.backend.names() if n} or {"kvserve"}
        return names | {Path(n).name for n in names}

    def _check_auth(self, request: Request) -> None:
        if self._expected is None and not self.backend.keyed:
            return
        got = request.headers.get("authorization", "").encode()
        if self.backend.principal(got) is not None:
            return  # an API key (kvserve/router/gate/tenancy.py)
        # NOTE: constant-time compare, as the gRPC interceptor (kvserve/router/gate/auth.py).
        if self._expected is None or not hmac.compare_digest(got, self._expected):
            raise ApiError(401, "missing or wrong bearer token (send 'Authorization: Bearer <token>')",
                           "authentication_error")  # fmt: skip

    def _check_model(self, model: str | None) -> None:
        # NOTE: a server that knows no name at all (a frontend started without --model or
        # --served-model-name) cannot tell a wrong name from a right one: it leaves the check out.
        if model is not None and any(self.backend.names()) and model not in self._model_names():
            raise ApiError(404, f"model {model!r} does not exist; this server serves {self.model_name()!r}",
                           "not_found_error", "model")  # fmt: skip

    async def _submit(
        self, request: Request, requests: list[spb.GenerateRequest], chat: bool
    ) -> tuple[list[Any], asyncio.TimerHandle]:
        """Admit every choice's request, or none (the ones already admitted are cancelled);
        prompts are tokenized off the loop, and the bounds of kvserve/router/gate/limits.py apply.

        Every HTTP request gets the server's deadline (``http_default_timeout_s``: the OpenAI API
        gives a client no way to send one): admission and the queue honour it as a gRPC
        deadline, and once it passes the requests still running end DEADLINE_EXCEEDED, aborted on
        their workers (``_expire``), whether or not the client is still there."""
        client = request.client.host if request.client else ""
        timeout_s = self.backend.default_timeout_s
        deadline = time.monotonic() + timeout_s
        try:
            admitted = await self.backend.submit(client, requests, request.headers.get("authorization"), timeout_s)
        except RouterError as e:
            raise api_error(e, chat) from e
        # NOTE: the caller cancels the timer when the response ends (it holds the requests).
        timer = asyncio.get_running_loop().call_later(
            max(deadline - time.monotonic(), 0.0), self._expire, admitted, timeout_s
        )
        return admitted, timer

    def _expire(self, admitted: list[Any], timeout_s: float) -> None:
        """The HTTP deadline passed: end what still runs with DEADLINE_EXCEEDED and abort it on its
        worker (its blocks are freed at the worker's next step)."""
        for handle in admitted:
            self.backend.expire(handle, deadline_error(timeout_s))

    def _check_choices(self, num_prompts: int, n: int) -> None:
        """prompts x n before any request is built (each becomes a router request)."""
        limit = self.limits.max_choices_per_request
        if num_prompts * n > limit:
            raise _bad("prompt", f"{num_prompts} prompts x n={n} choices, at most {limit} "
                                 "(limit max_choices_per_request)")  # fmt: skip

    def _cancel_unfinished(self, admitted: list[Any]) -> None:
        for r in admitted:
            self.backend.cancel(r)

    async def _responses(self, admitted: list[Any]) -> AsyncIterator[tuple[int, spb.GenerateResponse]]:
        """Every choice's responses as they come, tagged with the choice index; RouterError if one failed."""
        if len(admitted) == 1:  # NOTE: the common case skips the merge queue (one hop less per token)
            async for resp in self.backend.responses(admitted[0]):
                yield 0, resp
            return
        queue: asyncio.Queue[tuple[int, spb.GenerateResponse | RouterError]] = asyncio.Queue()

        async def pump(i: int, r: Any) -> None:
            try:
                async for resp in self.backend.responses(r):
                    queue.put_nowait((i, resp))
            except RouterError as e:
                queue.put_nowait((i, e))

        tasks = [asyncio.ensure_future(pump(i, r)) for i, r in enumerate(admitted)]
        try:
            remaining = len(tasks)
            while remaining:
                i, item = await queue.get()
                if isinstance(item, RouterError):
                    raise item
                if item.finish_reason:
                    remaining -= 1
                yield i, item
        finally:
            for t in tasks:
                t.cancel()

    # -- handlers --
    async def completions(self, body: CompletionBody, request: Request) -> Any:
        self._check_model(body.model)
        self._check_choices(len(_prompts(body)), body.n)
        return await self._generate(request, body, completion_requests(body), chat=False)

    async def chat_completions(self, body: ChatBody, request: Request) -> Any:
        self._check_model(body.model)
        self._check_choices(1, body.n)
        return await self._generate(request, body, chat_requests(body), chat=True)

    async def _generate(self, request: Request, body: Any, requests: list[spb.GenerateRequest], chat: bool) -> Any:
        admitted, timer = await self._submit(request, requests, chat)
        head = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}",
            "created": int(time.time()),
            "model": self.model_name(),
        }
        k = _top_logprobs(body, chat)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            events = self._stream(admitted, head, body.n, chat, k, include_usage, body.return_token_ids, timer)
            return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        collect = asyncio.ensure_future(self._collect(admitted, head, body.n, chat, k, body.return_token_ids))
        gone = asyncio.ensure_future(_until_disconnect(request))
        try:
            await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not collect.done():  # the client left: stop its requests now, not at their end
                collect.cancel()
                return JSONResponse({}, status_code=499)
            try:
                return JSONResponse(collect.result())
            except RouterError as e:
                raise api_error(e, chat) from e
        finally:
            gone.cancel()
            timer.cancel()
            self._cancel_unfinished(admitted)

    async def _collect(
        self, admitted: list[Any], head: dict, n: int, chat: bool, k: int, return_ids: bool
    ) -> dict:
        choices = [_Choice(i) for i in range(len(admitted))]
        logprobs: list[dict[str, Any] | None] = [None] * len(admitted)
        async for i, resp in self._responses(admitted):
            c = choices[i]
            if k or resp.logprobs:
                new = ({"content": _chat_logprobs(resp, k, self._text)} if chat
                       else _completion_logprobs(resp, k, self._text, len(c.text)))  # fmt: skip
                logprobs[i] = _merge_logprobs(logprobs[i], new, chat)
            c.text += resp.text_delta
            c.token_ids.extend(resp.token_ids)
            if resp.finish_reason:
                c.finish_reason, c.final = resp.finish_reason, resp
        if chat:
            out = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                    "logprobs": logprobs[c.index], "finish_reason": c.finish_reason} for c in choices]  # fmt: skip
        else:
            out = [{"index": c.index, "text": c.text, "logprobs": logprobs[c.index], "finish_reason": c.finish_reason}
                   for c in choices]  # fmt: skip
        if return_ids:
            for o, c in zip(out, choices, strict=True):
                o["token_ids"] = c.token_ids
        obj = "chat.completion" if chat else "text_completion"
        return {**head, "object": obj, "choices": out, "usage": _usage(choices, n)}

    async def _stream(self, admitted: list[Any], head: dict, n: int, chat: bool, k: int,
                      include_usage: bool, return_ids: bool,
                      timer: asyncio.TimerHandle) -> AsyncIterator[str]:  # fmt: skip
        """Server-sent events; the client going away cancels this generator, which cancels the requests."""
        obj = "chat.completion.chunk" if chat else "text_completion"
        choices = [_Choice(i) for i in range(len(admitted))]
        extra = {"usage": None} if include_usage else {}

        def chunk(choice: dict[str, Any], token_ids: Any = ()) -> str:
            if return_ids:
                choice["token_ids"] = list(token_ids)
            return _sse({**head, "object": obj, "choices": [choice], **extra})

        try:
            if chat:
                for c in choices:  # OpenAI's first chunk per choice: the role
                    yield chunk({"index": c.index, "delta": {"role": "assistant", "content": ""},
                                 "logprobs": None, "finish_reason": None})  # fmt: skip
            async for i, resp in self._responses(admitted):
                c = choices[i]
                lp = None
                if k or resp.logprobs:
                    lp = ({"content": _chat_logprobs(resp, k, self._text)} if chat
                          else _completion_logprobs(resp, k, self._text, len(c.text)))  # fmt: skip
                c.text += resp.text_delta
                finish = resp.finish_reason or None
                if finish:
                    c.finish_reason, c.final = finish, resp
                if chat:
                    delta = {"content": resp.text_delta} if resp.text_delta or not finish else {}
                    yield chunk({"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish}, resp.token_ids)
                else:
                    choice = {"index": i, "text": resp.text_delta, "logprobs": lp, "finish_reason": finish}
                    yield chunk(choice, resp.token_ids)
            if include_usage:
                yield _sse({**head, "object": obj, "choices": [], "usage": _usage(choices, n)})
        except RouterError as e:
            yield _sse(api_error(e, chat).body())
        finally:
            timer.cancel()
            self._cancel_unfinished(admitted)
        yield "data: [DONE]\n\n"

    async def models(self) -> dict:
        return {"object": "list", "data": [
            {"id": self.model_name(), "object": "model", "created": 0, "owned_by": "kvserve"}]}  # fmt: skip

    async def ready(self) -> JSONResponse:
        """Readiness: 200 iff some worker can serve now (gRPC health's verdict), else 503."""
        ready, serving = self.backend.ready()
        if ready:
            return JSONResponse({"status": "ok", **({"serving_workers": serving} if serving is not None else {})})
        return JSONResponse({"status": "no worker can serve", "serving_workers": 0}, status_code=503)

    async def live(self) -> JSONResponse:
        """Liveness: the router answers (whatever its workers' state)."""
        return JSONResponse({"status": "ok"})

    def _routes(self) -> None:
        app = self.app
        # NOTE: a dependency runs before the body is validated: no schema hints without the token.
        auth = [Depends(self._check_auth)]
        app.post("/v1/completions", dependencies=auth)(self.completions)
        app.post("/v1/chat/completions", dependencies=auth)(self.chat_completions)
        app.get("/v1/models", dependencies=auth)(self.models)
        app.get("/health")(self.ready)
        app.get("/health/ready")(self.ready)
        app.get("/health/live")(self.live)

        @app.exception_handler(ApiError)
        async def _api_error(request: Request, e: ApiError) -> JSONResponse:
            return e.response()

        @app.exception_handler(RequestValidationError)
        async def _invalid(request: Request, e: RequestValidationError) -> JSONResponse:
            # NOTE: of a union's member errors ours (a lone surrogate) then the deepest say most ([2**40]
            # for ``prompt``: the id is over int32, not "a valid string"); ties keep pydantic's order.
            err = max(e.errors(), key=lambda x: (x.get("type") == "value_error", len(x.get("loc", ()))),
                      default={"loc": (), "msg": "invalid request"})  # fmt: skip
            param = _loc(err.get("loc", ()))
            return ApiError(400, f"{param or 'body'}: {err.get('msg')}", "invalid_request_error", param).response()


def _top_logprobs(body: Any, chat: bool) -> int:
    """How many most likely tokens to list per output token (0 when logprobs are off)."""
    if chat:
        return (body.top_logprobs or 0) if body.logprobs else 0
    return body.logprobs or 0


def _loc(loc: tuple) -> str | None:
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


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def _until_disconnect(request: Request) -> None:
    """Returns when the client has gone (the body was read: the next ASGI message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


# ---- metrics middleware -------------------------------------------------------------------------------
class MetricsMiddleware:
    """Counts requests by route and status (pure ASGI: no per-chunk overhead on streams)."""

    def __init__(self, app: Callable) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = scope["path"] if scope["path"] in _ROUTES else "other"
        status = ["500"]
        start = time.monotonic()

        async def send_wrapper(message: dict) -> None:
            if message["type"] == "http.response.start":
                status[0] = str(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            RouterMetrics.http_request(route, status[0], time.monotonic() - start)


_MAX_DRAIN_BYTES = 64 << 20  # what a refused body may still send before the connection is dropped


class BodyLimitMiddleware:
    """Refuses a request body over ``max_bytes`` with 413 before anything parses it (by its
    Content-Length when it gives one, else as the bytes arrive); passes the body it read on."""

    def __init__(self, app: Callable, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or ()).get(b"content-length", b"0")
        if not length.isdigit() or int(length) > self.max_bytes:
            await self._refuse(send, receive)
            return
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away before sending its body
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await self._refuse(send, receive)
                return
            more = message.get("more_body", False)
        body = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replay() -> dict:
            return body.pop() if body else await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, send: Callable, receive: Callable) -> None:
        error = ApiError(413, f"request body over {self.max_bytes} bytes (limit max_http_body_bytes)",
                         "invalid_request_error")  # fmt: skip
        payload = json.dumps(error.body()).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                                (b"connection", b"close")]})  # fmt: skip
        await send({"type": "http.response.body", "body": payload})
        # NOTE: read (and drop) what the client is still sending, up to a bound: closing with unread
        # input makes the kernel reset the connection, and the client may never see the 413.
        drained, more = 0, True
        while more and drained <= _MAX_DRAIN_BYTES:
            message = await receive()
            drained += len(message.get("body", b""))
            more = message["type"] == "http.request" and message.get("more_body", False)


# ---- the server -----------------------------------------------------------------------------------------
class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # NOTE: the process (kvserve serve, a Ray actor, a test) owns its signals, not this server.
        yield


class ServedByMiddleware:
    """Names the process that answered in a response header (``kvserve-frontend``, as the gRPC API's
    initial metadata does): behind a shared port, which frontend served a call is otherwise unknown
    to the client and to whoever reads its logs."""

    def __init__(self, app: Callable, header: bytes, value: str) -> None:
        self.app, self.header, self.value = app, header, value.encode()

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_named(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), (self.header, self.value)]}
            await send(message)

        await self.app(scope, receive, send_named)


class HttpApiServer:
    """uvicorn serving ``OpenAIApi`` as a task on the current event loop (beside grpc.aio)."""

    def __init__(
        self,
        router: Router | ApiBackend,
        host: str,
        port: int,
        auth_token: str | None = None,
        bounds: Bounds | None = None,
        tls: tuple[str, str, str | None] | None = None,
        reuse_port: bool = False,
        served_by: tuple[str, str] | None = None,
    ) -> None:
        """
        Args:
            router: the Router in this process, or another ``ApiBackend`` (a frontend's relay).
            host, port: where to listen (port 0 = a free one; ``start`` returns it).
            auth_token: require ``Authorization: Bearer <token>`` (all but ``/health``).
            bounds: the input bounds, shared with the gRPC API (kvserve/router/gate/limits.py).
            tls: ``(cert, key, client CA or None)`` PEM files: HTTPS, and with a client CA client
                certificates required (the gRPC port's ``tls_cert``/``tls_key``/``tls_client_ca``).
            reuse_port: bind with ``SO_REUSEPORT``, so several frontend processes share the port
                (the kernel spreads connections over them; one that dies stops getting new ones).
            served_by: ``(header, value)`` added to every response (a frontend's name).
        """
        backend = RouterBackend(router, bounds) if isinstance(router, Router) else router
        self.api = OpenAIApi(backend, auth_token)
        self.tls = tls
        self.reuse_port = reuse_port
        self.served_by = served_by
        self.host, self.port = host, port
        self._server: _Server | None = None
        self._task: asyncio.Task | None = None

    async def start(self) -> int:
        """Bind and start serving; returns the bound port. Raises OSError when the port is taken."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if self.reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            sock.bind((self.host, self.port))
        except OSError as e:
            sock.close()
            raise OSError(f"cannot bind the HTTP API port at {self.host}:{self.port}: {e}") from e
        self.port = int(sock.getsockname()[1])
        # NOTE: log_config=None: the process's logging stays as it is (uvicorn would install its own).
        app: Callable = MetricsMiddleware(BodyLimitMiddleware(self.api.app, self.api.limits.max_http_body_bytes))
        if self.served_by is not None:
            app = ServedByMiddleware(app, self.served_by[0].encode(), self.served_by[1])
        config = uvicorn.Config(
            app,
            log_config=None, log_level="warning", access_log=False,
            lifespan="off", timeout_graceful_shutdown=1, **self._ssl_options(),
        )  # fmt: skip
        self._server = _Server(config)
        self._task = asyncio.get_running_loop().create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:  # NOTE: startup only (socket already bound): a few loop turns
            if self._task.done():
                self._task.result()  # raises what failed
                raise OSError("the HTTP API server stopped at startup")
            await asyncio.sleep(0.01)
        logger.info("OpenAI-compatible HTTP API on %s://%s:%d", "https" if self.tls else "http", self.host, self.port)
        return self.port

    def _ssl_options(self) -> dict[str, Any]:
        if self.tls is None:
            return {}
        cert, key, client_ca = self.tls
        return {
            "ssl_certfile": cert, "ssl_keyfile": key, "ssl_ca_certs": client_ca,
            "ssl_cert_reqs": ssl.CERT_REQUIRED if client_ca else ssl.CERT_NONE,
        }  # fmt: skip

    async def stop(self) -> None:
        if self._server is None or self._task is None:
            return
        self._server.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._task, timeout=5)
        self._server = self._task = None
