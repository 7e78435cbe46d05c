"""A worker's side of a take-over (docs/architecture.md section 2a, "Resuming through another frontend"):
an owned request's client resumed through another frontend, and the router's ``Reown`` re-points the request
there. Engine-thread code (``kvserve/workers/transport/worker.py`` calls it between steps).

* ``catch_up``: the one output that brings a new owner level: every output token of the request so far
  (from token 0, so the owner holds what a later ``Resume`` needs) and all text handed out so far
  (``output_text``, the concatenation of every text delta), with ``num_output_tokens`` = their count. The
  new owner's demux places it like any output; the owner cuts what its client already has. The engine keeps
  no logprobs: the worker keeps an owned request's (those it sent its owner, carried by a migration), and a
  request whose logprobs are not all known there (a replay began it after its first tokens) has no catch-up.
* ``FinishedOwned``: a request that finished while its owner's data link was down may never have reached
  its client; its engine ``Request`` (tokens, text, counts) is kept ``ttl_s`` (``orphan_timeout_s``, the
  router's ``OWNER_GRACE_S``) so a take-over can still resend its end; one take-over uses it up.
"""

from __future__ import annotations

import time
from collections import OrderedDict

from kvserve.workers.engine.outputs import RequestOutput
from kvserve.workers.engine.request import Request


def catch_up(req: Request, request_id: str, logprobs: list[dict[int, float]] | None = None) -> RequestOutput | None:
    """Everything ``req`` has output so far, as one output named ``request_id`` (its final one if it finished),
    with ``logprobs``, its tokens' so far, when it asked for them; None when those do not cover every token."""
    ids = req.output_token_ids
    # NOTE: overlapped scheduling appends a placeholder (< 0) for a token still on the device: not output yet
    n = next((i for i, t in enumerate(ids) if t < 0), len(ids))
    wanted = req.sampling_params.logprobs is not None
    if wanted and (logprobs is None or len(logprobs) < n):
        return None
    return RequestOutput(
        request_id=request_id,
        new_token_ids=tuple(ids[:n]),
        text_delta=req.output_text,
        finish_reason=req.finish_reason,
        num_prompt_tokens=len(req.prompt_token_ids),
        num_cached_tokens=max(req.num_cached_tokens, 0),
        num_output_tokens=n,
        num_preemptions=req.num_preemptions,
        num_swaps=req.num_swaps,
        new_logprobs=tuple(logprobs[:n]) if wanted and logprobs is not None else (),
    )


class FinishedOwned:
    """Finished owned requests whose owner was unreachable at their finish, by worker request id, for ``ttl_s``."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        # in expiry order: (expiry, the request, its logprobs when it asked for them)
        self._kept: OrderedDict[str, tuple[float, Request, list[dict[int, float]] | None]] = OrderedDict()

    def keep(self, request_id: str, req: Request, now: float | None = None,
             logprobs: list[dict[int, float]] | None = None) -> None:  # fmt: skip
        now = time.monotonic() if now is None else now
        self.prune(now)
        self._kept[request_id] = (now + self.ttl_s, req, logprobs)

    def take(self, request_id: str, now: float | None = None) -> tuple[Request, list[dict[int, float]] | None] | None:
        """The kept request and its logprobs (forgotten now), or None: none, or kept past its ``ttl_s``."""
        self.prune(time.monotonic() if now is None else now)
        kept = self._kept.pop(request_id, None)
        return None if kept is None else (kept[1], kept[2])

    def prune(self, now: float) -> None:
        while self._kept:
            rid, (expires, _, _) = next(iter(self._kept.items()))
            if expires > now:
                return
            del self._kept[rid]

    def __len__(self) -> int:
        return len(self._kept)
