"""The OpenAI HTTP API's backend in the router's own process (``--frontends 0``): ``RouterBackend``
admits through the router's ``Bounds`` (the very path a gRPC Generate takes) and streams from its
request table. A frontend's backend is ``kvserve/frontend/http_backend.py``; the API itself
(``kvserve/router/api/http_api.py``) knows only the ``ApiBackend`` contract."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from kvserve.protos.kvserve.v1 import serving_pb2 as spb
from kvserve.router.api.health import cluster_ready, serving_workers
from kvserve.router.gate.bounds import Bounds
from kvserve.router.gate.tenancy import Principal
from kvserve.router.requests.demux import stream_responses
from kvserve.router.requests.request import RouterError, RouterRequest

if TYPE_CHECKING:
    from kvserve.router.requests.router import Router


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
