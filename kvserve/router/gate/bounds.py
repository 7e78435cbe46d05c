"""``Bounds``: every bound of ``kvserve/router/gate/limits.py`` applied to one router's submits, shared by
its gRPC and HTTP APIs (a client's streams count across both), and the tenancy of API keys.

It sees the router through ``Admitting`` (what it calls), not the ``Router`` class, so the gate
depends on no request table.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

import grpc

from kvserve.protos.kvserve.v1 import serving_pb2 as spb
from kvserve.router.gate.limits import (
    UNKNOWN_RETRY_MS,
    ClientStreams,
    InputLimits,
    LimitExceeded,
    WatcherSlots,
    check_request,
)
from kvserve.router.gate.prompt_preparer import PromptModel, PromptPreparer
from kvserve.router.gate.tenancy import Principal, Tenancy
from kvserve.router.gate.validation import ValidationError
from kvserve.router.requests.request import RouterError, RouterRequest

if TYPE_CHECKING:
    from kvserve.router.config import RouterConfig
    from kvserve.router.observe.metrics import RouterMetrics
    from kvserve.router.requests.mux import StreamMux


class ServiceTimes(Protocol):
    """Recent completions (``kvserve/router/policy/service_times.py``): when a stream is expected to end."""

    def expected_s(self, max_tokens: int) -> float: ...

    def typical_s(self) -> float | None: ...


class Queue(Protocol):
    """The admission queue, for its service times only."""

    @property
    def service(self) -> ServiceTimes: ...


class Cancelling(Protocol):
    def cancel(self, r: RouterRequest) -> None:
        """Stop ``r`` now (aborted on its worker, its blocks freed)."""


class Admitting(PromptModel, Protocol):
    """What ``Bounds`` uses of the router (``kvserve/router/requests/router.py`` ``Router`` implements it)."""

    config: RouterConfig
    metrics: RouterMetrics

    @property
    def queue(self) -> Queue: ...

    @property
    def lifecycle(self) -> Cancelling: ...

    def submit(
        self, request: spb.GenerateRequest, time_remaining_s: float | None = None, mux: StreamMux | None = None,
        owner: spb.Owner | None = None,
    ) -> RouterRequest:
        """Validate and place or queue a request; raises RouterError."""
        ...


class Bounds:
    """Every bound over one router, shared by the gRPC and the HTTP API (a client's streams count
    across both)."""

    def __init__(self, router: Admitting, limits: InputLimits | None = None, tenancy: Tenancy | None = None) -> None:
        """
        Args:
            tenancy: API keys (``--auth-keys``): callers with a key get their tenant's scope,
                priority bound and rate limits (kvserve/router/gate/tenancy.py); None = simple mode.
        """
        self.router = router
        self.tenancy = tenancy
        self.limits = limits or InputLimits.from_config(router.config)
        self.streams = ClientStreams(self.limits.max_streams_per_client, self._stream_ends_ms)
        self.watchers = WatcherSlots(self.limits.max_pressure_watchers)
        # NOTE: prompt processes load the model directory's tokenizer (none: threads, as tests' fakes)
        self.prompts = PromptPreparer(router, self.limits.prompt_threads, self.limits.max_pending_prompts,
                                      model_dir=router.config.model or None)  # fmt: skip

    def principal(self, authorization: str | bytes | None) -> Principal | None:
        """The caller's API key, when keys are configured and it presented one."""
        return None if self.tenancy is None else self.tenancy.principal(authorization)

    async def submit_all(
        self,
        client: str,
        requests: Sequence[spb.GenerateRequest],
        time_remaining_s: Callable[[], float | None] = lambda: None,
        who: Principal | None = None,
        mux: StreamMux | None = None,
        owner: spb.Owner | None = None,
    ) -> list[RouterRequest]:
        """Check, tokenize (off the loop) and submit every request, or none.

        Args:
            client: the caller's key for ``max_streams_per_client`` (``client_of_peer``); a
                caller with an API key is counted by its key instead.
            time_remaining_s: seconds left of the caller's deadline, asked at submit time.
            who: the caller's API key: its tenant, id scope, priority bound and rate apply.
            mux: the GenerateStream the requests' responses go to (``Router.submit``'s ``mux``).
            owner: the frontend that owns them (``Router.submit``'s ``owner``; checked by the caller).

        Raises:
            RouterError: a limit (its code, naming the knob), a bad prompt (INVALID_ARGUMENT), or
                whatever ``Router.submit`` refused; the requests already admitted are cancelled.
        """
        default_max_tokens = self.router.config.default_max_tokens
        try:
            if who is not None:
                assert self.tenancy is not None
                requests = [self.tenancy.scope(who, r) for r in requests]
                client = f"key:{who.key_id}"
            for r in requests:
                check_request(r, self.limits, default_max_tokens)
            with self.streams.reserve(client, len(requests)):
                refunds: list[Callable[[], None]] = []
                if who is not None:
                    # NOTE: the request rate is charged before any work (tokenizing, rendering): a key
                    # limited to N requests a minute gets at most N prompts a minute tokenized (issue 42).
                    # A prompt refused once tokenized keeps its charge (its work was done).
                    refunds.append(self.tenancy.charge(who, requests, default_max_tokens,  # type: ignore[union-attr]
                                                       budgets=("requests_per_minute",)))  # fmt: skip
                try:
                    prepared = await self._prepare_all(requests)
                except LimitExceeded:  # NOTE: nothing was tokenized: no work to charge
                    for refund in refunds:
                        refund()
                    raise
                if who is not None:
                    refunds.append(self.tenancy.charge(who, prepared, default_max_tokens,  # type: ignore[union-attr]
                                                       budgets=("tokens_per_minute",)))  # fmt: skip
                admitted: list[RouterRequest] = []
                try:
                    for r in prepared:
                        # NOTE: mux only for GenerateStream (Router.submit's optional third argument)
                        extra = {} if owner is None else {"owner": owner}
                        admitted.append(self.router.submit(r, time_remaining_s(), *((mux,) if mux is not None else ()),
                                                           **extra))  # fmt: skip
                except RouterError:
                    for a in admitted:
                        self.router.lifecycle.cancel(a)
                    for refund in refunds:  # NOTE: the budgets count admitted (and tokenized) requests only
                        refund()
                    raise
                self.streams.track(client, admitted)
                return admitted
        except LimitExceeded as e:
            self.router.metrics.rejected(e.limit)
            raise RouterError(e.code, str(e), e.trailers) from e
        except ValidationError as e:
            self.router.metrics.rejected("invalid")
            raise RouterError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from e

    async def _prepare_all(self, requests: Sequence[spb.GenerateRequest]) -> list[spb.GenerateRequest]:
        """Each distinct prompt tokenized once (an HTTP call's n choices share theirs)."""
        by_prompt: dict[bytes, list[int]] = {}
        out = []
        for r in requests:
            key = _prompt_key(r)
            if key is not None and key in by_prompt:
                p = spb.GenerateRequest()
                p.CopyFrom(r)
                p.ClearField("prompt")
                p.token_ids.ids.extend(by_prompt[key])
                out.append(p)
                continue
            p = await self.prompts.prepare(r)
            if key is not None and p.WhichOneof("prompt") == "token_ids":
                by_prompt[key] = list(p.token_ids.ids)
            out.append(p)
        return out

    def _stream_ends_ms(self, live: Sequence[RouterRequest]) -> int:
        """When the first of ``live`` (a client's streams) is expected to end, in ms (at least 100):
        its typical remaining service time (kvserve/router/policy/service_times.py); ``UNKNOWN_RETRY_MS``
        with no completions measured."""
        service, now = self.router.queue.service, time.monotonic()
        ends = [service.expected_s(r.params.max_tokens) - (now - (r.started_at or now)) for r in live]
        if service.typical_s() is None or not ends:
            return UNKNOWN_RETRY_MS
        return max(100, math.ceil(min(ends) * 1000))

    def close(self) -> None:
        self.prompts.close()


def _prompt_key(r: spb.GenerateRequest) -> bytes | None:
    """Equal for requests whose text or chat prompt is the same; None for token-id prompts."""
    kind = r.WhichOneof("prompt")
    if kind == "text":
        return b"t" + r.text.encode()
    if kind == "messages":
        return b"m" + r.messages.SerializeToString(deterministic=True)
    return None
