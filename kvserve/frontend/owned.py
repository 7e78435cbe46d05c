"""A frontend's data plane: the outputs of the requests it owns, straight from their workers
(docs/architecture.md section 2a).

Each relayed request the router dispatches with ``Owner{address, key}`` streams its outputs from its
worker to this frontend's data service (``kvserve/frontend/data_service.py``: the WorkerLink service, with
this object as its handler) as ``"<key>#<dispatch tag>"``. Its output state is a ``RouterRequest`` run
through the router's own ``demux_output`` (kvserve/router/requests/demux.py), so ordering by
``num_output_tokens``, duplicate drops (a worker's resend after a reconnect, a migration's two sources) and
gap holds are exactly the router's.

Rules beside the demux:

* a key this frontend does not know (a request it forgot: finished, cancelled, or a frontend restart) is
  answered with an ``Abort`` on that data link, so its worker stops spending on it;
* after a ``Resume`` (the router replays the request elsewhere) every dispatch tag seen before is fenced:
  its outputs are dropped (a stale, partitioned incarnation's), a new tag's are delivered;
* the same tag from a worker not seen for it before is a migration (counted in ``num_migrations``).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Protocol

from kvserve.protos.kvserve.v1 import serving_pb2 as spb
from kvserve.protos.kvserve.v1 import worker_pb2 as pb
from kvserve.router.requests.demux import demux_output
from kvserve.router.requests.request import RouterRequest
from kvserve.router.table.worker_link import WorkerLinkHandler, WorkerLinkService
from kvserve.workers.core.sampling_params import SamplingParams
from kvserve.workers.core.step_columns import column_entries, entry_output

logger = logging.getLogger(__name__)

_MAX_REMEMBERED_ABORTS = 4096  # NOTE: bounds the (worker, key) pairs already aborted (one Abort each, not per step)


class RelayedRequest(Protocol):
    """What an owned request's relay (kvserve/frontend/link.py ``RelayedRequest``) offers here.
    NOTE: a Protocol, not an import: link.py imports this module (no import cycle, tests/unit/test_structure.py)."""

    request_id: str
    finished: bool

    def put(self, item: spb.GenerateResponse) -> None:
        """Deliver a response (the slow-consumer cut may end the request)."""

    def ended(self) -> None:
        """It ended on its data link: its id is free on its stream."""


@dataclass(eq=False)
class OwnedState:
    """One owned request: its relay (where its responses go) and its output state.

    Attributes:
        relayed: the client's handle (``RelayedRequest.put`` keeps the slow-consumer cut).
        request: the demux's state: ``request_id`` = the client's id, ``prompt_ids`` = the prepared
            prompt (so the final usage is right), ``output_ids`` = every token delivered (a Resume's ids).
        placed: the router said it is on a worker (``GenerateBatch.placed``): it outlives the router's stream.
        workers: dispatch tag -> the workers that sent outputs of it (a new one for a known tag: a migration).
        fenced: tags whose outputs are dropped (every tag seen before a Resume).
        worker_id: the last worker that sent an output of a live tag (where a cancel's Abort goes).
        cursor: taken over from a dead frontend (its client resumes here): (tokens, text characters) the client
            has; what the worker resends below it is not delivered again (``trim``). None: not taken over.
        text_seen: text characters of the request's output this frontend has seen (for the cursor's cut).
    """

    relayed: RelayedRequest
    request: RouterRequest
    placed: bool = False
    workers: dict[str, set[str]] = field(default_factory=dict)
    fenced: set[str] = field(default_factory=set)
    worker_id: str | None = None
    cursor: tuple[int, int] | None = None
    text_seen: int = 0


def trim(state: OwnedState, resp: dict, end: int) -> dict | None:
    """``resp`` (response fields whose tokens end at output token ``end``) less what the client of a taken-over
    request already has: the tokens below ``cursor[0]`` and the text below ``cursor[1]`` characters. None: nothing
    is left and it does not finish the request. The worker's catch-up starts at token 0 and text 0 (reown.py),
    and later outputs follow it in order (the demux), so both cuts fall inside the span seen so far."""
    text = resp.get("text_delta", "")
    start_text = state.text_seen
    state.text_seen += len(text)
    if state.cursor is None:
        return resp
    ids = resp["token_ids"]
    n_tokens, n_chars = state.cursor
    drop = min(max(n_tokens - (end - len(ids)), 0), len(ids))
    cut = min(max(n_chars - start_text, 0), len(text))
    if end >= n_tokens and state.text_seen >= n_chars:
        state.cursor = None  # NOTE: past the cursor: from here on every output is delivered as it comes
    if drop or cut:
        resp = {**resp, "token_ids": ids[drop:], "text_delta": text[cut:]}
        if "logprobs" in resp:
            resp["logprobs"] = resp["logprobs"][drop:]
    if not resp["token_ids"] and not resp["text_delta"] and "finish_reason" not in resp:
        return None
    return resp


def split_owned_id(request_id: str) -> tuple[str, str]:
    """``"<key>#<tag>"`` as (key, tag); an id without ``#`` is all key (tag "")."""
    key, sep, tag = request_id.rpartition("#")
    return (key, tag) if sep else (request_id, "")


class OwnedRequests(WorkerLinkHandler):
    """Every request this frontend owns, by owner key; the handler of its data service's WorkerLink.

    ``service`` (set by ``kvserve/frontend/data_service.py``) sends the data links' commands (Abort).
    Runs on the frontend's event loop (no locks), as the router's handler does on its own.
    """

    def __init__(self) -> None:
        self.states: dict[str, OwnedState] = {}
        self.service: WorkerLinkService | None = None
        self._aborted: OrderedDict[tuple[str, str], None] = OrderedDict()
        self.dropped_fenced = 0  # outputs of fenced tags dropped (tests, logs)

    # ---- the relay's side (kvserve/frontend/link.py) ----------------------------------------------------
    def register(self, key: str, relayed: RelayedRequest, prompt_ids: list[int]) -> OwnedState:
        """Own ``key`` (before its request is sent: its first output may beat the router's ``placed``)."""
        r = RouterRequest(request_id=relayed.request_id, prompt_ids=prompt_ids, params=SamplingParams(), priority=0,
                          tenant="", block_hashes=(), num_blocks=0)  # fmt: skip
        state = OwnedState(relayed, r)
        self.states[key] = state
        return state

    def placed(self, key: str) -> None:
        """The router dispatched ``key`` to a worker."""
        state = self.states.get(key)
        if state is not None:
            state.placed = True

    def is_placed(self, key: str) -> bool:
        """The router placed ``key``, or a worker already sent for it (its first output may beat ``placed``)."""
        state = self.states.get(key)
        return state is not None and (state.placed or bool(state.workers))

    def replayed(self, key: str) -> list[int] | None:
        """The router replays ``key`` elsewhere (its worker died): count it, fence every tag seen so far and
        return the ids its client has (the ``Resume``'s); None: the key is not owned here."""
        state = self.states.get(key)
        if state is None:
            return None
        r = state.request
        r.replays += 1
        r.migrations += 1
        state.fenced.update(state.workers)
        # NOTE: outputs held past a gap are all of fenced tags now: the new dispatch resends from the resume point.
        r.held.clear()
        state.worker_id = None
        return list(r.output_ids)

    def cancel(self, key: str) -> None:
        """The client left: abort ``key`` on the data link of the worker that last sent for it (works while the
        router is away; the worker aborts at its next step) and forget it."""
        state = self.states.pop(key, None)
        if state is not None and state.placed and state.worker_id is not None:
            self._abort(state.worker_id, key)

    def forget(self, key: str) -> None:
        """Stop owning ``key`` (it ended: later outputs for it are answered with an Abort)."""
        self.states.pop(key, None)

    # ---- the data links' side (WorkerLinkHandler) -----------------------------------------------------
    def on_message(self, worker_id: str, msg: pb.WorkerMessage) -> None:
        """Deliver a step's outputs; other messages (hello, heartbeats, acks, events) carry nothing for a
        frontend."""
        kind = msg.WhichOneof("body")
        if kind == "step":
            if msg.step.HasField("outputs"):
                self.on_outputs(worker_id, msg.step.outputs)
        elif kind == "step_outputs":
            self.on_outputs(worker_id, msg.step_outputs)

    def on_outputs(self, worker_id: str, step: pb.StepOutputs) -> None:
        """One step's outputs from ``worker_id``: the columns first (a request's entries precede its output,
        worker.proto), then the outputs."""
        now = time.monotonic()  # NOTE: one clock read per step message
        if step.HasField("columns"):
            for rid, new, total, text in column_entries(step.columns):
                self.on_output(worker_id, entry_output(rid, new, total, text), now)
        for out in step.outputs:
            self.on_output(worker_id, out, now)

    def on_output(self, worker_id: str, out: pb.RequestOutput, now: float) -> None:
        """One output of ``"<key>#<tag>"``: to its relay in order, once; an unknown key is aborted."""
        key, tag = split_owned_id(out.request_id)
        state = self.states.get(key)
        if state is None:
            self._abort(worker_id, key)
            return
        if tag in state.fenced:
            self.dropped_fenced += 1
            return
        seen = state.workers.setdefault(tag, set())
        if worker_id not in seen:
            if seen:  # NOTE: the same dispatch from another worker: the request migrated
                state.request.migrations += 1
            seen.add(worker_id)
        state.worker_id = worker_id
        rr = state.relayed
        r = state.request
        if not r.prompt_ids and out.num_prompt_tokens:
            # NOTE: taken over: this frontend never saw the prompt; only its length is used (the final usage)
            r.prompt_ids = [0] * out.num_prompt_tokens
        end = r.tokens_received
        for d in demux_output(r, worker_id, out, now):
            end += d.num_new_tokens
            if d.response is not None and (resp := trim(state, d.response, end)) is not None:
                rr.put(spb.GenerateResponse(**resp))
            if d.finished:
                self._ended(key, state)
                return
            if rr.finished:  # NOTE: the slow-consumer cut: its cancel already aborted and forgot it
                return

    def _ended(self, key: str, state: OwnedState) -> None:
        if self.states.get(key) is state:
            del self.states[key]
        state.relayed.ended()

    def _abort(self, worker_id: str, key: str) -> None:
        """One ``Abort(key)`` per (worker, key) on that worker's data link."""
        if self.service is None or (worker_id, key) in self._aborted:
            return
        self._aborted[(worker_id, key)] = None
        while len(self._aborted) > _MAX_REMEMBERED_ABORTS:
            self._aborted.popitem(last=False)
        self.service.abort(worker_id, key)
