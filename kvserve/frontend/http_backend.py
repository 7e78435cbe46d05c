"""The OpenAI HTTP API's ``ApiBackend`` in a frontend (``kvserve/router/api/http_api.py`` serves it as it does on
the router): requests go to the router through the frontend's relay (``kvserve/frontend/relay.py``).

``submit`` waits for the router's first answer to every choice, so a refusal is an HTTP status
(400/429/503...) before any body is sent, exactly as when the router serves HTTP itself.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

from kvserve.frontend.link import RelayedRequest
from kvserve.frontend.relay import Relay
from kvserve.protos.kvserve.v1 import serving_pb2 as spb
from kvserve.router.gate.limits import InputLimits
from kvserve.router.gate.tenancy import Principal, Tenancy
from kvserve.router.requests.request import RouterError


class RelayBackend:
    """``ApiBackend`` over a frontend's ``Relay``.

    Args:
        relay: the frontend's relay to the router.
        tenancy: the API keys (for the caller check only; the router applies what a key may do).
        names: (served model name, model argument, model id).
        tokenizer: for logprobs' token text.
        readiness: the router's readiness as last seen (``kvserve/frontend/server.py`` mirrors it).
        default_timeout_s: every HTTP request's deadline (the router config's ``http_default_timeout_s``).
    """

    def __init__(self, relay: Relay, tenancy: Tenancy | None, names: tuple[str, ...], tokenizer: Any,
                 readiness: Callable[[], bool], default_timeout_s: float) -> None:  # fmt: skip
        self.relay = relay
        self.default_timeout_s = default_timeout_s
        self.tenancy = tenancy
        self.limits: InputLimits = relay.limits
        self.tokenizer = tokenizer
        self.keyed = tenancy is not None
        self._names = names
        self._readiness = readiness

    def principal(self, authorization: str | bytes | None) -> Principal | None:
        return None if self.tenancy is None else self.tenancy.principal(authorization)

    def names(self) -> tuple[str, ...]:
        return self._names

    async def submit(
        self, client: str, requests: list[spb.GenerateRequest], authorization: str | None, timeout_s: float
    ) -> list[RelayedRequest]:
        handles = await self.relay.submit(client, requests, authorization, timeout_s)
        await self.relay.admitted(handles)
        return handles

    async def take_over(self, client: str, request: spb.GenerateRequest, authorization: str | None) -> RelayedRequest:
        """Resume a stream another frontend owned (``request.resume``: the HTTP API's ``kvserve-resume``); waits for
        the router's first answer, so a refusal is an HTTP status (404) before any body."""
        handle = self.relay.link.take_over(authorization, request, client)
        await self.relay.admitted([handle])
        return handle

    def expire(self, handle: RelayedRequest, error: RouterError) -> None:
        if not handle.finished:
            handle.put(error)  # ends its stream (and marks it finished) ...
            handle.connection.send_cancel(handle.request_id)  # ... and aborts it at the router

    def responses(self, handle: RelayedRequest) -> AsyncIterator[spb.GenerateResponse]:
        return handle.responses()

    def cancel(self, handle: RelayedRequest) -> None:
        handle.cancel()

    def ready(self) -> tuple[bool, int | None]:
        return self._readiness(), None
