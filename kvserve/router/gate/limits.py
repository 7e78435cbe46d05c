"""Bounds on what one call or one client can make the router do (README "Security"): the pure pieces,
shared by the router and its frontends.

The router runs on one event loop that also carries every worker's WorkerLink and the health
probes; a request that costs it seconds starves them all. So, on both APIs (gRPC and HTTP):

- size bounds are checked before the work they bound (``check_request``; the HTTP body size and
  prompts x n before parsing and building, see ``kvserve/router/api/http_api.py``): INVALID_ARGUMENT (HTTP
  400/413) naming the knob;
- concurrency bounds (``ClientStreams``: streams per client; ``WatcherSlots``: WatchBlockPressure
  subscribers; ``kvserve/router/gate/prompt_preparer.py``: prompts waiting to be tokenized) answer
  RESOURCE_EXHAUSTED (HTTP 429) naming the knob;
- a text or chat prompt that cannot fit ``max_model_len`` by its byte size alone is refused before
  any tokenizing (``check_prompt_size``), and a key's request rate is charged before any work;
- tokenization and chat-template rendering run off the loop and its GIL
  (``kvserve/router/gate/prompt_preparer.py``). A huge prompt delays only itself.

``kvserve/router/gate/bounds.py`` ``Bounds`` applies them all to one router's submits. Every bound
is a ``RouterConfig`` knob (``kvserve/router/config.py``).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc

from kvserve.protos.kvserve.v1 import serving_pb2 as spb

if TYPE_CHECKING:
    from kvserve.router.config import RouterConfig


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
