"""Worker outputs -> client responses: in order, each token once (pure: no Ray, no gRPC).

A request's outputs can arrive from two workers (a migration: the destination's first tokens may
overtake the source's last ones, on two streams) and more than once (a worker resends after a
reconnect). Every ``RequestOutput`` says where its tokens start (``num_output_tokens -
len(new_token_ids)``), so the demux:

* holds an output that starts past the tokens delivered so far until the gap closes;
* drops the tokens of an output that were already delivered (a replay, or tokens from before a
  migration), and the output itself when nothing new is left and it does not finish the request;
* ends a cancelled request silently on its worker's ``abort`` (the client already has its status).

``demux_output`` updates the request's output fields and returns the ``Delivery``s the router
hands to the client and to its metrics. A delivery carries its ``GenerateResponse`` as the
message's fields (a dict), not as a message: a multiplexed stream builds its whole batch from the
dicts at once (kvserve/router/requests/mux.py), which costs less than building each response and copying it into
the batch; a request's own queue (kvserve/router/requests/request.py ``ResponseQueue``) builds each message.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvserve.protos.kvserve.v1 import serving_pb2 as spb
from kvserve.protos.kvserve.v1 import worker_pb2 as pb
from kvserve.router.requests.request import RouterError

if TYPE_CHECKING:
    from kvserve.router.requests.request import RouterRequest


ResponseFields = dict[str, Any]  # a GenerateResponse's fields, as its constructor takes them


@dataclass(slots=True)
class Delivery:
    """One step of a request's output stream.

    Attributes:
        response: what the client gets (a GenerateResponse's fields); None when the request ends
            without one (the worker's abort of a request the client cancelled).
        num_new_tokens: tokens ``response`` adds.
        time_to_first_token_s: set on the response that carries the first token.
        inter_token_s: mean gap per token since the previous tokens, on later responses.
        e2e_s: arrival to final response, set on the final one.
        finished: the request is over (the router forgets it).
    """

    response: ResponseFields | None
    num_new_tokens: int = 0
    time_to_first_token_s: float | None = None
    inter_token_s: float | None = None
    e2e_s: float | None = None
    finished: bool = False


def demux_output(r: RouterRequest, worker_id: str, out: pb.RequestOutput, now: float) -> list[Delivery]:
    """Fold one worker output into ``r``; returns what to deliver, in order (maybe nothing).

    Args:
        r: the request (its ``tokens_received``, ``held`` and counts are updated).
        worker_id: the worker that sent ``out``.
        out: the output.
        now: monotonic time, for the token timings.

    NOTE: this runs once per request per worker step on the router's loop (the data plane's hot
    path): each upb field is read once, and nothing is built that the common case (the next
    tokens, in order) does not send.
    """
    new = list(out.new_token_ids)
    start = out.num_output_tokens - len(new)
    if start > r.tokens_received and not (r.cancelled and out.finish_reason == "abort"):
        r.held.append((worker_id, out))
        return []
    first = _deliver(r, worker_id, out, new, start, now)
    deliveries = [] if first is None else [first]
    while r.held and not (deliveries and deliveries[-1].finished):
        ready = next((h for h in r.held if _start(h[1]) <= r.tokens_received), None)
        if ready is None:
            break
        r.held.remove(ready)
        held_out = ready[1]
        d = _deliver(r, ready[0], held_out, list(held_out.new_token_ids), _start(held_out), now)
        if d is not None:
            deliveries.append(d)
    return deliveries


def next_in_order(r: RouterRequest, worker_id: str, total: int, n: int) -> bool:
    """``n`` tokens ending at ``total`` from ``worker_id`` are exactly ``r``'s next ones, from a worker
    it runs on, past its first token, with nothing held before them: the in-order case, which a
    step's column entry (kvserve/router/requests/columns.py) may deliver without a ``RequestOutput``."""
    return (
        not r.held and r.last_token_time is not None and r.tokens_received == total - n
        and worker_id in r.dispatch_workers
    )


def advance(r: RouterRequest, new: list[int], now: float) -> tuple[float | None, float | None]:
    """Append ``new`` (non-empty, in order) to ``r``'s output; returns (time to first token if these
    are its first, mean inter-token gap otherwise)."""
    ttft = itl = None
    if r.first_token_time is None:
        r.first_token_time = now
        ttft = now - r.arrival
    elif r.last_token_time is not None:
        itl = (now - r.last_token_time) / len(new)
    r.last_token_time = now
    r.tokens_received += len(new)
    r.output_ids.extend(new)
    return ttft, itl


def _start(out: pb.RequestOutput) -> int:
    return out.num_output_tokens - len(out.new_token_ids)


def _deliver(
    r: RouterRequest, worker_id: str, out: pb.RequestOutput, new: list[int], start: int, now: float
) -> Delivery | None:
    logprobs = list(out.logprobs) if out.logprobs else None  # None, or one per new token
    finish = out.finish_reason
    skip = r.tokens_received - start
    if skip > 0:  # already delivered (a replay, or tokens from before a migration)
        if skip >= len(new) and not finish:
            return None
        new = new[skip:]
        logprobs = logprobs[skip:] if logprobs else None
    ttft = itl = None
    n = len(new)
    if n:
        ttft, itl = advance(r, new, now)
    if (p := out.num_preemptions) > r.preemptions:  # NOTE: the most any worker reported (counts restart after a move)
        r.preemptions = p
    if (w := out.num_swaps) > r.swaps:
        r.swaps = w
    resp = {"request_id": r.request_id, "token_ids": new, "text_delta": out.text_delta, "worker_id": worker_id}
    if logprobs:
        resp["logprobs"] = logprobs
    if not finish:
        return Delivery(resp, n, ttft, itl)
    if r.cancelled and finish == "abort":
        return Delivery(None, n, ttft, itl, finished=True)
    resp["finish_reason"] = finish
    resp["usage"] = {"prompt_tokens": len(r.prompt_ids), "cached_tokens": out.num_cached_tokens,
                     "completion_tokens": r.tokens_received}  # fmt: skip
    resp.update(num_preemptions=r.preemptions, num_swaps=r.swaps, num_migrations=r.migrations,
                num_replays=r.replays)  # fmt: skip
    return Delivery(resp, n, ttft, itl, e2e_s=now - r.arrival, finished=True)


def merge_responses(first: spb.GenerateResponse, then: spb.GenerateResponse) -> spb.GenerateResponse:
    """One response carrying ``first``'s tokens, text and logprobs followed by ``then``'s (and
    ``then``'s final fields, if it is the final one)."""
    merged = spb.GenerateResponse()
    merged.CopyFrom(then)
    del merged.token_ids[:], merged.logprobs[:]
    merged.token_ids.extend([*first.token_ids, *then.token_ids])
    merged.logprobs.extend([*first.logprobs, *then.logprobs])
    merged.text_delta = first.text_delta + then.text_delta
    return merged


def merge_fields(first: ResponseFields, then: ResponseFields) -> ResponseFields:
    """``first`` extended by ``then`` (as ``merge_responses``, on fields); ``first`` is reused."""
    first["token_ids"] = [*first["token_ids"], *then["token_ids"]]
    if "logprobs" in first or "logprobs" in then:
        first["logprobs"] = [*first.get("logprobs", ()), *then.get("logprobs", ())]
    first["text_delta"] += then["text_delta"]
    for key, value in then.items():
        if key not in ("token_ids", "logprobs", "text_delta"):
            first[key] = value
    return first


async def stream_responses(r: RouterRequest) -> AsyncIterator[spb.GenerateResponse]:
    """Responses of one request until its final one; RouterError if it ended abnormally.

    Responses already waiting when the client reads are merged into one (same worker only, so
    ``worker_id`` stays exact): a client that keeps up gets one message per step, one that
    falls behind gets fewer, larger ones instead of paying per-message costs for every token
    (vLLM's output collector does the same).
    """
    while True:
        item = await r.responses.get()
        if isinstance(item, RouterError):
            raise item
        while not item.finish_reason and not r.responses.empty():
            nxt = r.responses._queue[0]  # NOTE: peek; asyncio.Queue has no public one
            if isinstance(nxt, RouterError) or nxt.worker_id != item.worker_id:
                break
            item = merge_responses(item, r.responses.get_nowait())
        yield item
        if item.finish_reason:
            return
