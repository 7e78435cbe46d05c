"""OpenAI-compatible HTTP API server (``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``) and health:
routes, auth, deadlines, streaming. What the JSON means is pure translation elsewhere:
``kvserve/router/api/openai_schema.py`` (bodies -> ``GenerateRequest`` protos, refusals -> OpenAI
errors and HTTP statuses) and ``kvserve/router/api/openai_output.py`` (responses -> OpenAI objects
and SSE chunks); the ASGI middlewares (metrics, body size, served-by) are
``kvserve/router/api/http_middleware.py``.

Health (open: probes carry no secret): ``/health`` and ``/health/ready`` answer readiness (200 iff
some worker can serve now, else 503: the same verdict as gRPC health), and ``/health/live``
liveness (200 while the server answers at all).

FastAPI + uvicorn (``HttpApiServer``), over an ``ApiBackend``: ``RouterBackend``
(``kvserve/router/api/router_backend.py``) on the router's own event loop beside ``grpc.aio``
(``--frontends 0``), or a frontend's relay to the router (``kvserve/frontend/http_backend.py``,
``--frontends N``). Either way a request becomes ``GenerateRequest`` protos and goes through the
very path a gRPC Generate takes (``Router.submit`` validates and admits it into the one request
table, its responses stream back, a cancel frees its blocks). This module names no router class:
a frontend serves it without the router's state.

Auth: the router's bearer token (``Authorization: Bearer``) or an API key, checked before the body
is parsed. A client that disconnects (stream or not) cancels its requests at once, which frees
their blocks at the workers' next step.

Resume (a kvserve extension, through frontends only: docs/architecture.md section 2a "Resuming through another
frontend"): a streamed single choice answers with the header ``kvserve-resume: <request id> <token>``; a client
whose stream broke before ``[DONE]`` (its frontend died) POSTs the same body to another frontend with the header
``kvserve-resume: <request id> <token> <tokens it has> <text characters it has>`` and gets the rest of the
stream. OpenAI clients ignore the header (they cannot resume).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import socket
import ssl
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse

from kvserve.protos.kvserve.v1 import serving_pb2 as spb
from kvserve.router.api.http_middleware import BodyLimitMiddleware, MetricsMiddleware, ServedByMiddleware
from kvserve.router.api.openai_output import DONE, Chunks, Collected, TokenText
from kvserve.router.api.openai_schema import (
    ApiError,
    ChatBody,
    CompletionBody,
    api_error,
    bad_request,
    chat_requests,
    completion_requests,
    deadline_error,
    invalid_body,
    prompts_of,
    top_logprobs,
)
from kvserve.router.gate.limits import InputLimits
from kvserve.router.gate.tenancy import Principal
from kvserve.router.requests.request import RouterError

logger = logging.getLogger(__name__)

RESUME_HEADER = "kvserve-resume"

ROUTES = frozenset(
    ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/health/ready", "/health/live")
)


def _response(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


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


# ---- the app --------------------------------------------------------------------------------------------
class OpenAIApi:
    """The FastAPI app over one ``ApiBackend``. Every handler runs on the backend's event loop."""

    def __init__(self, backend: ApiBackend, auth_token: str | None = None) -> None:
        self.backend = backend
        self.limits = backend.limits
        self._expected = f"Bearer {auth_token}".encode() if auth_token else None
        self._text = TokenText(backend.tokenizer)
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

    async def _resume(self, request: Request, header: str, chat: bool) -> tuple[list[Any], asyncio.TimerHandle, int]:
        """Take over the stream ``header`` names (``<request id> <token> <tokens> <text characters>``) for its
        client, through the backend's ``take_over`` (a frontend's; the router direct has none: 400); with the
        text characters the client has (its logprobs' text offsets go on from there)."""
        take_over = getattr(self.backend, "take_over", None)
        if take_over is None:
            raise bad_request(RESUME_HEADER, "a stream resumes only through a frontend")
        parts = header.split()
        if len(parts) != 4 or not parts[2].isdigit() or not parts[3].isdigit():
            raise bad_request(RESUME_HEADER, "expected '<request id> <token> <tokens> <text characters>'")
        resume = spb.GenerateRequest(request_id=parts[0], resume=spb.ResumeStream(
            token=parts[1], num_tokens=int(parts[2]), num_text_chars=int(parts[3])))  # fmt: skip
        client = request.client.host if request.client else ""
        timeout_s = self.backend.default_timeout_s
        try:
            handle = await take_over(client, resume, request.headers.get("authorization"))
        except RouterError as e:
            raise api_error(e, chat) from e
        timer = asyncio.get_running_loop().call_later(timeout_s, self._expire, [handle], timeout_s)
        return [handle], timer, resume.resume.num_text_chars

    def _expire(self, admitted: list[Any], timeout_s: float) -> None:
        """The HTTP deadline passed: end what still runs with DEADLINE_EXCEEDED and abort it on its
        worker (its blocks are freed at the worker's next step)."""
        for handle in admitted:
            self.backend.expire(handle, deadline_error(timeout_s))

    def _check_choices(self, num_prompts: int, n: int) -> None:
        """prompts x n before any request is built (each becomes a router request)."""
        limit = self.limits.max_choices_per_request
        if num_prompts * n > limit:
            raise bad_request("prompt", f"{num_prompts} prompts x n={n} choices, at most {limit} "
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
        self._check_choices(len(prompts_of(body)), body.n)
        return await self._generate(request, body, completion_requests(body), chat=False)

    async def chat_completions(self, body: ChatBody, request: Request) -> Any:
        self._check_model(body.model)
        self._check_choices(1, body.n)
        return await self._generate(request, body, chat_requests(body), chat=True)

    async def _generate(self, request: Request, body: Any, requests: list[spb.GenerateRequest], chat: bool) -> Any:
        resume = request.headers.get(RESUME_HEADER)
        text_offset = 0  # the text characters the client has (a resume's)
        if resume is not None:
            if not body.stream or len(requests) != 1:
                raise bad_request(RESUME_HEADER, "a resume continues one streamed choice (stream true, n 1)")
            admitted, timer, text_offset = await self._resume(request, resume, chat)
        else:
            admitted, timer = await self._submit(request, requests, chat)
        head = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}",
            "created": int(time.time()),
            "model": self.model_name(),
        }
        k = top_logprobs(body, chat)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            events = self._stream(admitted, head, body.n, chat, k, include_usage, body.return_token_ids, timer,
                                  text_offset)  # fmt: skip
            headers = {"Cache-Control": "no-cache"}
            token = getattr(admitted[0], "resume_token", "") if len(admitted) == 1 else ""
            if token:  # NOTE: a frontend's owned request: its client may resume it elsewhere
                headers[RESUME_HEADER] = f"{admitted[0].request_id} {token}"
            return StreamingResponse(events, media_type="text/event-stream", headers=headers)
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

    async def _collect(self, admitted: list[Any], head: dict, n: int, chat: bool, k: int, return_ids: bool) -> dict:
        collected = Collected(len(admitted), chat, k, self._text)
        async for i, resp in self._responses(admitted):
            collected.add(i, resp)
        return collected.result(head, n, return_ids)

    async def _stream(self, admitted: list[Any], head: dict, n: int, chat: bool, k: int,
                      include_usage: bool, return_ids: bool,
                      timer: asyncio.TimerHandle, text_offset: int = 0) -> AsyncIterator[str]:  # fmt: skip
        """Server-sent events; the client going away cancels this generator, which cancels the requests.
        ``text_offset``: the text characters a resuming client has."""
        chunks = Chunks(head, len(admitted), chat, k, self._text, include_usage, return_ids, text_offset)
        try:
            for event in chunks.opening():
                yield event
            async for i, resp in self._responses(admitted):
                yield chunks.chunk(i, resp)
            if include_usage:
                yield chunks.usage_chunk(n)
        except RouterError as e:
            yield chunks.error(e)
        finally:
            timer.cancel()
            self._cancel_unfinished(admitted)
        yield DONE

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
            return _response(e)

        @app.exception_handler(RequestValidationError)
        async def _invalid(request: Request, e: RequestValidationError) -> JSONResponse:
            return _response(invalid_body(e.errors()))


async def _until_disconnect(request: Request) -> None:
    """Returns when the client has gone (the body was read: the next ASGI message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


# ---- the server -----------------------------------------------------------------------------------------
class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # NOTE: the process (kvserve serve, a Ray actor, a test) owns its signals, not this server.
        yield


class HttpApiServer:
    """uvicorn serving ``OpenAIApi`` as a task on the current event loop (beside grpc.aio)."""

    def __init__(
        self,
        backend: ApiBackend,
        host: str,
        port: int,
        auth_token: str | None = None,
        tls: tuple[str, str, str | None] | None = None,
        reuse_port: bool = False,
        served_by: tuple[str, str] | None = None,
    ) -> None:
        """
        Args:
            backend: what admits and streams the requests: the router in this process
                (``kvserve/router/api/router_backend.py``) or a frontend's relay
                (``kvserve/frontend/http_backend.py``).
            host, port: where to listen (port 0 = a free one; ``start`` returns it).
            auth_token: require ``Authorization: Bearer <token>`` (all but ``/health``).
            tls: ``(cert, key, client CA or None)`` PEM files: HTTPS, and with a client CA client
                certificates required (the gRPC port's ``tls_cert``/``tls_key``/``tls_client_ca``).
            reuse_port: bind with ``SO_REUSEPORT``, so several frontend processes share the port
                (the kernel spreads connections over them; one that dies stops getting new ones).
            served_by: ``(header, value)`` added to every response (a frontend's name).
        """
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
        app: Callable = MetricsMiddleware(
            BodyLimitMiddleware(self.api.app, self.api.limits.max_http_body_bytes), ROUTES
        )
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
