"""Bounds on what one call or one client can make the router do (README "Security").

The router runs on one event loop that also carries every worker's WorkerLink and the health
probes; a request that costs it seconds starves them all. So, on both APIs (gRPC and HTTP):

- size bounds are checked before the work they bound (``check_request``; the HTTP body size and
  prompts x n before parsing and building, see ``kvserve/router/api/http_api.py``): INVALID_ARGUMENT (HTTP
  400/413) naming the knob;
- concurrency bounds (``ClientStreams``: streams per client; ``WatcherSlots``: WatchBlockPressure
  subscribers; ``PromptPreparer``: prompts waiting to be tokenized) answer RESOURCE_EXHAUSTED (HTTP
  429) naming the knob;
- a text or chat prompt that cannot fit ``max_model_len`` by its byte size alone is refused before
  any tokenizing (``check_prompt_size``), and a key's request rate is charged before any work;
- tokenization and chat-template rendering run in spawned prompt processes (``PromptPreparer``),
  off the router's loop and GIL: rendering is Python (regexes and Jinja over the whole content,
  a second per megabyte) and even the tokenizer, which releases the GIL while it encodes, takes it
  back to build the ids, so in a thread either stalls the loop on a loaded machine (issue 42). A
  router without a model directory (tests' fakes) uses a bounded thread pool instead. A huge prompt
  delays only itself.

Every bound is a ``RouterConfig`` knob (``kvserve/router/config.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import multiprocessing
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc

from kvserve.protos.kvserve.v1 import serving_pb2 as spb
from kvserve.router.gate.prompts import (
    check_prompt_size,
    child_init,
    child_prompt_ids,
    longest_token_bytes,
    prompt_ids,
    with_token_ids,
)
from kvserve.router.gate.tenancy import Principal, Tenancy
from kvserve.router.gate.validation import ValidationError
from kvserve.router.requests.request import RouterError, RouterRequest

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from kvserve.router.config import RouterConfig
    from kvserve.router.requests.mux import StreamMux
    from kvserve.router.requests.router import Router


# The retry hint of a concurrency bound with nothing to estimate its release from (ms).
UNKNOWN_RETRY_MS = 1_000


class LimitExceeded(Exception):
    """A call over one of the limits: ``code`` to answer, ``limit`` the knob's name, and for
    RESOURCE_EXHAUSTED the ``retry_after_ms`` hint its answer carries (every refusal has one)."""

    def __init__(self, code: grpc.StatusCode, limit: str, message: str, retry_after_ms: int = UNKNOWN_RETRY_MS) -> None:
        super().__init__(f"{message} (limit {limit})")
        self.code, self.limit, self.retry_after_ms = code, limit, retry_after_ms

    @property
    def trailers(self) -> tuple[tuple[str, str], ...]:
        if self.code != grpc.StatusCode.RESOURCE_EXHAUSTED:
            return ()
        return (("retry-after-ms", str(self.retry_after_ms)),)


@dataclass(frozen=True)
class InputLimits:
    """The knobs of ``RouterConfig`` this module enforces (see their help there)."""

    max_http_body_bytes: int = 8 << 20
    max_choices_per_request: int = 64
    max_stop_token_ids: int = 256
    max_logprob_tokens: int = 1 << 16
    max_streams_per_client: int = 256
    max_pressure_watchers: int = 64
    prompt_threads: int = 2
    max_pending_prompts: int = 256

    @classmethod
    def from_config(cls, config: RouterConfig) -> InputLimits:
        return cls(**{name: getattr(config, name) for name in cls.__dataclass_fields__})


def check_request(request: spb.GenerateRequest, limits: InputLimits, default_max_tokens: int) -> None:
    """The per-call size bounds beside ``kvserve/router/gate/validation.py``'s, checked before any work.

    Raises:
        LimitExceeded: INVALID_ARGUMENT naming the field and the knob.
    """
    s = request.sampling
    if len(s.stop_token_ids) > limits.max_stop_token_ids:
        raise LimitExceeded(
            grpc.StatusCode.INVALID_ARGUMENT,
            "max_stop_token_ids",
            f"sampling.stop_token_ids: {len(s.stop_token_ids)} ids, at most {limits.max_stop_token_ids}",
        )
    if s.HasField("logprobs"):
        tokens = (s.logprobs + 1) * (s.max_tokens or default_max_tokens)  # NOTE: +1: the sampled token's own
        if tokens > limits.max_logprob_tokens:
            raise LimitExceeded(
                grpc.StatusCode.INVALID_ARGUMENT,
                "max_logprob_tokens",
                f"sampling.logprobs: (logprobs + 1) x max_tokens = {tokens} log-probabilities, "
                f"at most {limits.max_logprob_tokens}",
            )


def client_of_peer(peer: str) -> str:
    """A client's key for per-client bounds: the host of a gRPC peer (``ipv4:10.0.0.7:53211`` ->
    ``10.0.0.7``, ``ipv6:[::1]:5`` -> ``::1``), as the HTTP API keys its clients."""
    kind, _, address = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return peer
    return address.rpartition(":")[0].strip("[]")


class ClientStreams:
    """Live streams (router requests) per client, at most ``limit`` each.

    A stream counts from ``reserve`` until its ``RouterRequest`` is finished; finished ones are
    dropped lazily (no callback to miss, so nothing leaks however a stream ends).
    """

    _SWEEP_AT = 4096  # clients remembered before every finished entry is swept

    def __init__(self, limit: int, retry_after_ms: Callable[[Sequence[Any]], int] | None = None) -> None:
        """``retry_after_ms``: the hint for a refused client from its live streams (when one is
        expected to end); None: ``UNKNOWN_RETRY_MS``."""
        self.limit = limit
        self.retry_after_ms = retry_after_ms
        self._live: dict[str, list[Any]] = {}
        self._reserved: Counter[str] = Counter()

    def live(self, client: str) -> int:
        live = [r for r in self._live.get(client, ()) if not r.finished]
        if live:
            self._live[client] = live
        else:
            self._live.pop(client, None)
        return len(live)

    @contextlib.contextmanager
    def reserve(self, client: str, n: int) -> Iterator[None]:
        """Hold ``n`` slots while the caller submits (then ``track`` what was admitted).

        Raises:
            LimitExceeded: RESOURCE_EXHAUSTED, the client already has too many streams.
        """
        if len(self._live) > self._SWEEP_AT:
            for c in list(self._live):
                self.live(c)
        have = self.live(client) + self._reserved[client]
        if have + n > self.limit:
            live = self._live.get(client, [])
            raise LimitExceeded(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                "max_streams_per_client",
                f"this client has {have} streams open; at most {self.limit} at once",
                self.retry_after_ms(live) if self.retry_after_ms is not None and live else UNKNOWN_RETRY_MS,
            )
        self._reserved[client] += n
        try:
            yield
        finally:
            self._reserved[client] -= n
            if not self._reserved[client]:
                del self._reserved[client]

    def track(self, client: str, requests: Sequence[Any]) -> None:
        """Count these admitted requests against ``client`` until they finish."""
        self._live.setdefault(client, []).extend(requests)


class WatcherSlots:
    """At most ``limit`` WatchBlockPressure streams at once (each costs a status build per tick)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.active = 0

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """Raises LimitExceeded (RESOURCE_EXHAUSTED) when all are taken."""
        if self.active >= self.limit:
            raise LimitExceeded(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                "max_pressure_watchers",
                f"{self.active} WatchBlockPressure streams are open; at most {self.limit}",
            )
        self.active += 1
        try:
            yield
        finally:
            self.active -= 1


class PromptPreparer:
    """Text and chat prompts -> token ids off the router's event loop and GIL.

    ``prepare`` returns the request with its prompt replaced by the token ids (validated with the
    same field names ``Router.submit`` uses), so ``submit`` does no tokenizing on the loop. Text and
    chat prompts are tokenized (and rendered) in ``threads`` spawned processes that load the model
    directory's tokenizer and template (``router.config.model``), so not under the router's GIL;
    without a model directory, or once a prompt process died, in ``threads`` threads.
    """

    def __init__(self, router: Router, threads: int, max_pending: int) -> None:
        self.router = router
        self.max_pending = max_pending
        self.pending = 0
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kvserve-prompt")
        self._processes: ProcessPoolExecutor | None = None
        if router.tokenizer is not None:
            longest_token_bytes(router.tokenizer)  # NOTE: once, at start-up, not in a request's path
            model_dir = getattr(getattr(router, "config", None), "model", None)
            if model_dir:
                # NOTE: spawn, not fork: the router's process runs gRPC and Ray threads.
                self._processes = ProcessPoolExecutor(threads, multiprocessing.get_context("spawn"),
                                                      initializer=child_init, initargs=(str(model_dir),))  # fmt: skip
                self._processes.submit(int)  # NOTE: start one now, not on the first chat request

    async def prepare(self, request: spb.GenerateRequest) -> spb.GenerateRequest:
        """Raises:
        LimitExceeded: RESOURCE_EXHAUSTED, ``max_pending_prompts`` prompts already wait.
        ValidationError: a bad prompt (``Router.submit`` would say the same).
        """
        r = self.router
        if request.WhichOneof("prompt") not in ("text", "messages") or r.limits is None or r.tokenizer is None:
            return request  # NOTE: ids are checked in submit (cheap); no kvserve/workers/tokenizer: submit says why
        check_prompt_size(request, r.limits, r.tokenizer)  # NOTE: cheap, before the pool: a prompt that
        # cannot fit is refused without waiting for (or costing) a tokenizer pass
        if self.pending >= self.max_pending:
            raise LimitExceeded(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                "max_pending_prompts",
                f"{self.pending} prompts are waiting to be tokenized; at most {self.max_pending}",
            )
        self.pending += 1
        try:
            loop = asyncio.get_running_loop()
            ids = None
            if self._processes is not None:
                try:
                    ids = await loop.run_in_executor(self._processes, child_prompt_ids, request.SerializeToString(),
                                                     r.limits)  # fmt: skip
                except BrokenProcessPool as e:  # NOTE: a prompt process died (OOM-killed...): threads from now on
                    logger.error("the prompt processes broke (%s); tokenizing in threads from now on", e)
                    self._processes = None
            if ids is None:
                ids = await loop.run_in_executor(self._pool, prompt_ids, request, r.limits, r.tokenizer,
                                                 r.chat_template)  # fmt: skip
        finally:
            self.pending -= 1
        return with_token_ids(request, ids)

    def close(self) -> None:
        pools: list[Executor] = [self._pool, *([self._processes] if self._processes is not None else [])]
        for pool in pools:
            pool.shutdown(wait=False, cancel_futures=True)


class Bounds:
    """Every bound of this module over one router, shared by the gRPC and the HTTP API (a client's
    streams count across both)."""

    def __init__(self, router: Router, limits: InputLimits | None = None, tenancy: Tenancy | None = None) -> None:
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
        self.prompts = PromptPreparer(router, self.limits.prompt_threads, self.limits.max_pending_prompts)

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
    ) -> list[RouterRequest]:
        """Check, tokenize (off the loop) and submit every request, or none.

        Args:
            client: the caller's key for ``max_streams_per_client`` (``client_of_peer``); a
                caller with an API key is counted by its key instead.
            time_remaining_s: seconds left of the caller's deadline, asked at submit time.
            who: the caller's API key: its tenant, id scope, priority bound and rate apply.
            mux: the GenerateStream the requests' responses go to (``Router.submit``'s ``mux``).

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
                        admitted.append(self.router.submit(r, time_remaining_s(), *((mux,) if mux is not None else ())))
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
