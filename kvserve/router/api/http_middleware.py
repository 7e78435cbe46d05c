"""The HTTP API's ASGI middlewares (``kvserve/router/api/http_api.py`` wraps its app in them): request
metrics, the body-size bound, and the name of the process that answered. Pure ASGI, so a stream
pays nothing per chunk but one header check."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Collection

from kvserve.router.api.openai_schema import ApiError
from kvserve.router.observe.metrics import RouterMetrics


class MetricsMiddleware:
    """Counts requests by route and status (pure ASGI: no per-chunk overhead on streams)."""

    def __init__(self, app: Callable, routes: Collection[str]) -> None:
        """``routes``: the paths counted by name; any other is counted as ``other`` (bounded labels)."""
        self.app, self.routes = app, routes

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = scope["path"] if scope["path"] in self.routes else "other"
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
