"""The Router: the request pipeline — submit, place or queue, dispatch, stream, cancel, replay.

Policy lives in pure modules over ``WorkerView``s (kvserve/router/policy/placement/, kvserve/router/policy/admission.py,
router/policy/rebalance.py), output ordering in router/requests/demux.py; the worker table and its lifecycle in
router/table/workers.py, migrations and router preemptions in router/requests/migrations.py. Everything runs on
one asyncio loop (the Ray actor's, or a test's), so the tables need no locks. Requests go to
workers as AddRequests on their WorkerLinks (a Ray call to a worker whose Hello does not take them);
what comes back (acks, outputs, pressure, block events) arrives over WorkerLink (``on_message``).

Lifecycle of a request: ``submit`` validates and either places it (``place``: the dispatcher's
one dispatch path) or queues it (only if it is projected to start within its deadline and
``max_queue_wait_s``) or refuses it (RouterError with a gRPC status); its responses stream from
``r.responses`` (kvserve/router/requests/demux.py ``stream_responses``). How it ends or leaves a
worker (finish, fail, cancel, abort, hand-off) is ``RequestLifecycle``'s alone
(kvserve/router/requests/lifecycle.py).

Failure handling (README "Failure behaviour"): when the worker table marks a worker down, each
request it held is replayed (kvserve/router/requests/dispatch.py), at most ``migration_limit`` times.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

import grpc

from kvserve.protos.kvserve.v1 import serving_pb2 as spb
from kvserve.protos.kvserve.v1 import worker_pb2 as pb
from kvserve.router.config import RouterConfig
from kvserve.router.gate.prompts import prompt_ids
from kvserve.router.gate.validation import ModelLimits, ValidationError, sampling_params, validate_ids
from kvserve.router.observe.metrics import RouterMetrics
from kvserve.router.observe.status import build_cluster_status
from kvserve.router.policy.admission import AdmissionQueue, RejectReason
from kvserve.router.policy.placement import Decision, Placement, PlacementRequest, WorkerView, fits_anywhere_ever
from kvserve.router.policy.prefix_index import PrefixIndex
from kvserve.router.policy.rebalance import MigrationLedger, Watermarks
from kvserve.router.requests.columns import deliver_columns
from kvserve.router.requests.demux import demux_output
from kvserve.router.requests.dispatch import Dispatcher
from kvserve.router.requests.drain import Drainer
from kvserve.router.requests.lifecycle import RequestLifecycle
from kvserve.router.requests.migrations import Mover
from kvserve.router.requests.mux import StreamMux
from kvserve.router.requests.owned import OwnedRequests
from kvserve.router.requests.request import WORKER_DOWN, WORKER_RETIRED, WORKER_UP, RouterError, RouterRequest
from kvserve.router.table.supervision import WorkerSupervision
from kvserve.router.table.worker_link import WorkerLinkHandler, WorkerLinkService, block_event
from kvserve.router.table.workers import WorkerState, WorkerTable
from kvserve.workers.core.block_hash import cache_extra, hash_blocks
from kvserve.workers.core.identity import WorkerIdentity
from kvserve.workers.core.sizes import blocks_for
from kvserve.workers.text.chat_template import ChatTemplate

__all__ = ["WORKER_DOWN", "WORKER_RETIRED", "WORKER_UP", "Router", "RouterError", "RouterRequest", "WorkerState"]

logger = logging.getLogger(__name__)


class Router(WorkerLinkHandler):
    def __init__(
        self,
        config: RouterConfig,
        limits: ModelLimits | None = None,
        tokenizer: Any = None,
        chat_template: ChatTemplate | None = None,
    ) -> None:
        self.config = config
        self.limits = limits
        self.tokenizer = tokenizer
        self.chat_template = chat_template  # None: chat prompts are refused (INVALID_ARGUMENT)
        self.requests: dict[str, RouterRequest] = {}
        self.replays_total = 0
        self.queue: AdmissionQueue[RouterRequest] = AdmissionQueue(
            config.max_queue_requests, config.max_queue_blocks, max_wait_s=config.max_queue_wait_s,
            cold_capacity=lambda: self.table.cold_capacity(tuple(  # what each running request may still generate
                r.params.max_tokens - max(len(r.output_ids), r.tokens_received)
                for r in self.requests.values() if r.request_id not in self.queue
            )),
            pace=lambda: self.table.pace(),  # read per completion: not cold_capacity (a walk of the requests)
        )  # fmt: skip
        self._expiry: asyncio.TimerHandle | None = None
        self.placement = Placement(config.placement_policy, weights=config.placement_weights())
        self.prefix_index = PrefixIndex()
        self.link = WorkerLinkService(self)
        self.metrics = RouterMetrics()
        self.ledger = MigrationLedger()
        self.dispatcher = Dispatcher(self)
        self.lifecycle = RequestLifecycle(self)
        self.table = WorkerTable(config, self.link, self.prefix_index, self.ledger, self.metrics,
                                 self.dispatcher.replay_all, self.dispatcher.holds_requests)  # fmt: skip
        self.mover = Mover(self)
        self.drainer = Drainer(self)
        self.owned = OwnedRequests(self, owner_grace_s=config.owner_grace_s)
        self.model_id = ""
        self.block_size = 16
        self.watermarks = Watermarks(config.high_watermark, config.low_watermark)
        self._tasks: set[asyncio.Task] = set()

    # ---- workers ---------------------------------------------------------------------------------
    def add_worker(
        self, worker_id: str, handle: Any, identity: WorkerIdentity, supervision: WorkerSupervision | None = None
    ) -> None:
        """Register a worker actor (``identity`` = its ``ready()``); see ``WorkerTable.register``."""
        self.table.register(worker_id, handle, identity, supervision)
        self.block_size, self.model_id = identity.block_size, identity.model_id
        if self.limits is None:
            self.limits = ModelLimits(identity.vocab_size, identity.max_model_len, self.config.default_max_tokens)

    def ready_event(self) -> asyncio.Event:
        """Set once a registered worker has said Hello: the cluster can serve (readiness)."""
        return self.table.ready

    def on_hello(self, worker_id: str, hello: pb.Hello, restarted: bool) -> None:
        if self.table.hello(worker_id, hello, restarted):
            self.pump()

    def on_disconnect(self, worker_id: str) -> None:
        entry = self.table.get(worker_id)
        if entry is not None:
            self.table.link_lost(entry)  # down after the grace period, or at once if its process is gone

    def on_message(self, worker_id: str, msg: pb.WorkerMessage) -> None:
        kind = msg.WhichOneof("body")
        if kind == "step":  # one step's outputs, block events and pressure, in that order
            step = msg.step
            if step.HasField("outputs"):
                self._on_outputs(worker_id, step.outputs)
            if step.HasField("events"):
                self._on_block_events(worker_id, step.events)
            if step.HasField("pressure"):
                self._on_pressure(worker_id, step.pressure)
        elif kind == "step_outputs":  # one output outside a step (a request the engine refused)
            self._on_outputs(worker_id, msg.step_outputs)
        elif kind == "heartbeat":
            self.table.heartbeat(worker_id, msg.heartbeat)
        elif kind == "request_table":
            self.owned.adopt(worker_id, msg.request_table)
        elif kind == "ack":  # NOTE: adds (link_adds.py) and take-overs' Reowns (takeover.py) await their acks
            if not self.dispatcher.link_adds.on_ack(worker_id, msg.ack):
                self.owned.takeovers.on_ack(worker_id, msg.ack)
        elif kind == "drain_me":
            self._drain_requested(worker_id, msg.drain_me.reason or "the worker asked")
        elif kind == "block_snapshot":
            snap = msg.block_snapshot
            tiers = {t: h for t, h in (("host", snap.host_hashes), ("disk", snap.disk_hashes)) if h}
            self.prefix_index.load_snapshot(worker_id, snap.seq, snap.hashes, tiers)

    def _on_outputs(self, worker_id: str, step: pb.StepOutputs) -> None:
        now = time.monotonic()  # NOTE: one clock read per step message, not per token
        if step.HasField("columns"):  # NOTE: first: a request's entries precede its output (worker.proto)
            deliver_columns(self, worker_id, step.columns, now, self._on_output)
        for out in step.outputs:
            self._on_output(worker_id, out, now)
        self.pump()

    def _on_pressure(self, worker_id: str, report: pb.PressureReport) -> None:
        entry = self.table.reported(worker_id, report)
        if entry is not None:
            self.pump()
            self.mover.rebalance(entry)

    def _on_block_events(self, worker_id: str, events: pb.BlockEvents) -> None:
        if self.prefix_index.apply(worker_id, [block_event(e) for e in events.events]):
            self.link.send(worker_id, pb.RouterCommand(request_snapshot=pb.RequestSnapshot()))

    def _drain_requested(self, worker_id: str, reason: str) -> None:
        """A worker asked to be drained (SIGTERM): as ``kvserve drain`` with the default deadline."""
        try:
            self.drainer.start(worker_id, None, reason)
        except RouterError as e:
            logger.error("worker %s asked to be drained (%s): refused: %s", worker_id, reason, e.message)

    # ---- requests ----------------------------------------------------------------------------------
    def submit(
        self, request: spb.GenerateRequest, time_remaining_s: float | None = None, mux: StreamMux | None = None,
        owner: spb.Owner | None = None,
    ) -> RouterRequest:
        """Validate and place or queue a request.

        Args:
            request: the client's request.
            time_remaining_s: seconds left of the client's deadline (None: no deadline); a request
                is queued only if it is projected to start within it.
            mux: the multiplexed stream it arrived on (its responses go there; None: its own stream).
            owner: the frontend that owns it (its outputs go there, docs/architecture.md 2a); the caller
                checked that the stream may name one.

        Raises:
            RouterError: with the status to return (INVALID_ARGUMENT, ALREADY_EXISTS, UNAVAILABLE,
                RESOURCE_EXHAUSTED with a ``retry-after-ms`` trailer).
        """
        if self.limits is None or not self.table.entries:
            raise RouterError(grpc.StatusCode.UNAVAILABLE, "no workers registered yet")
        try:
            validate_ids(request)
            ids = prompt_ids(request, self.limits, self.tokenizer, self.chat_template)
            params = sampling_params(request.sampling, len(ids), self.limits)
        except ValidationError as e:
            self.metrics.rejected("invalid")
            raise RouterError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from e
        rid = request.request_id or f"req-{uuid.uuid4().hex[:12]}"
        if rid in self.requests:
            raise RouterError(grpc.StatusCode.ALREADY_EXISTS, f"request_id {rid!r} is in use")
        hashes = tuple(hash_blocks(ids, self.block_size, cache_extra(self.model_id, request.tenant or None)))
        num_blocks = blocks_for(len(ids), self.block_size)
        r = RouterRequest(rid, ids, params, request.priority, request.tenant, hashes, num_blocks)
        if mux is not None:
            r.responses = mux.slot(rid)
            if mux.columns:
                r.columns = mux
        views = self.table.views()
        if not any(v.healthy for v in views):
            raise RouterError(grpc.StatusCode.UNAVAILABLE, "no healthy worker")
        if not fits_anywhere_ever(self._shape(r), views):
            self.metrics.rejected(RejectReason.NEVER_FITS.value)
            raise RouterError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) can never fit any worker's KV pool",
            )
        if owner is not None and owner.key:
            self.owned.own(r, owner.address, owner.key)
        if not self._queue_has_precedence(r) and self.place(r, views):
            self.requests[rid] = r
            self.metrics.admitted(len(ids))
            return r
        deadline = None if time_remaining_s is None else time.monotonic() + max(time_remaining_s, 0.0)
        refusal = self.queue.admit(r, deadline=deadline, max_tokens=params.max_tokens,
                                   blocks_ever=blocks_for(len(ids) + params.max_tokens, self.block_size))
        if refusal is not None:
            if r.owner_key:
                self.owned.forget(r)
            self.metrics.rejected(refusal.reason.value)
            wait = "unknown" if refusal.projected_wait_s is None else f"{refusal.projected_wait_s:.1f} s"
            raise RouterError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"router busy ({refusal.reason.value}, projected wait {wait}); retry in {refusal.retry_after_ms} ms",
                (("retry-after-ms", str(refusal.retry_after_ms)),),
            )
        self.requests[rid] = r
        self.metrics.admitted(len(ids))
        if deadline is not None:
            self._arm_expiry()
        self.mover.preempt_for(r)
        return r

    def _arm_expiry(self) -> None:
        """Schedule ``_expire`` for the earliest deadline among queued requests."""
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None
        deadline = self.queue.next_deadline()
        if deadline is not None:
            loop = asyncio.get_running_loop()
            self._expiry = loop.call_later(max(deadline - time.monotonic(), 0.0) + 0.001, self._expire)

    def _expire(self) -> None:
        """Queued requests whose deadline passed leave the queue without touching a worker."""
        self._expiry = None
        for r in self.queue.expired():
            self.lifecycle.fail(r, grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed while queued at the router")
        self._arm_expiry()

    def _shape(self, r: RouterRequest) -> PlacementRequest:
        # Generation stops at max_model_len ("length"), as the worker's own fit check assumes. A
        # replay's prompt is the prompt plus the tokens already streamed.
        assert self.limits is not None
        done = len(r.output_ids)
        room = max(self.limits.max_model_len - len(r.prompt_ids) - done, 1)
        return PlacementRequest(len(r.prompt_ids) + done, r.block_hashes, min(max(r.params.max_tokens - done, 1), room))

    def _queue_has_precedence(self, r: RouterRequest) -> bool:
        """FIFO within priority: a newcomer never overtakes a queued request as important or more."""
        return any(q.priority >= r.priority for q in self.queue)

    def decide(self, r: RouterRequest, views: list[WorkerView] | None = None) -> Decision | None:
        """Where placement would put ``r`` now (None: nowhere has room); nothing is dispatched. ``views``: the
        workers as ``table.views()`` shows them now, when the caller just made them (one build per request)."""
        # NOTE: affinity counts prefixes placed but not yet reported stored, so same-prefix requests that
        # arrive close together follow each other instead of being placed by load alone.
        return self.placement.decide(self._shape(r), views or self.table.views(), self.prefix_index.affinity)

    def place(self, r: RouterRequest, views: list[WorkerView] | None = None) -> bool:
        decision = self.decide(r, views)
        if decision is not None:
            self.dispatcher.dispatch(r, decision.worker_id, decision.promised_blocks)
        return decision is not None

    def pump(self) -> None:
        """Place queued requests that fit now (called whenever blocks may have freed)."""
        if len(self.queue):
            for r in self.queue.pop_ready(lambda r: self.decide(r) is not None):
                self.place(r)

    def _on_output(self, worker_id: str, out: pb.RequestOutput, now: float | None = None) -> None:
        r = self.dispatcher.current(out.request_id)
        if r is None:
            self.dispatcher.stop_stray(worker_id, out)
            return
        if worker_id not in r.dispatch_workers:
            self.dispatcher.foreign(worker_id, out, r)
            return
        if r.owner_key:  # NOTE: its tokens went to its owner; this is its progress (kvserve/router/requests/owned.py)
            self.owned.on_progress(worker_id, out, r, time.monotonic() if now is None else now)
            return
        entry = self.table.get(worker_id)
        if entry is not None and r.worker_rid in entry.in_flight:
            entry.started.add(r.worker_rid)
        for d in demux_output(r, worker_id, out, time.monotonic() if now is None else now):
            self.metrics.streamed(d.time_to_first_token_s, d.inter_token_s, d.num_new_tokens, d.e2e_s)
            if d.finished:
                if r.started_at is not None and out.finish_reason in ("length", "stop"):
                    held = blocks_for(len(r.prompt_ids) + len(r.output_ids), self.block_size)
                    self.queue.service.observe(time.monotonic() - r.started_at, len(r.output_ids), held,
                                               stopped=out.finish_reason == "stop")
                self.lifecycle.finish(r)
            if d.response is None:
                continue
            if not d.finished and r.responses.qsize() >= self.config.max_buffered_responses:
                self.lifecycle.overflow(r)
                return
            r.responses.put_nowait(d.response)

    def cluster_status(self) -> spb.ClusterStatus:
        in_flight = sum(1 for r in self.requests.values() if r.worker_id is not None)
        rows = self.table.status_rows()
        return build_cluster_status(rows, self.queue, in_flight, self.replays_total, self.watermarks)

    def spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
