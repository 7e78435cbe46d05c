"""The Router: request table, placement, admission, cluster-level pressure, health and status.

It decides nothing about policy itself: placement (router/placement.py), admission
(router/admission.py), migration and priority preemption (router/rebalance.py) are pure modules
over ``WorkerView``s; output ordering and de-duplication is router/demux.py. The Router builds
their inputs from its tables and carries out what they return.

Everything here runs on one asyncio loop (the Ray actor's, or a test's), so the tables need no
locks. Workers are Ray actor handles (requests go in by Ray calls); what comes back (outputs,
pressure, block events) arrives over WorkerLink and is handled in ``on_message``.

Lifecycle of a request: ``submit`` validates and either places it (Ray ``add_request``) or queues
it (only if it is projected to start within its deadline and ``max_queue_wait_s``) or refuses it
(RouterError with a gRPC status). ``stream`` yields its responses until the final one. ``cancel``
(client gone, deadline, Abort) aborts it on its worker, which frees its blocks at the next step
boundary; the request id is free again at once.

Failure handling (README "Failure behaviour"): a worker is *down* from the first sign of its death
(its WorkerLink breaks, a health probe or a call finds the actor dead); each request it held is
replayed once per death on a healthy worker (``_replay``: the prompt plus the tokens already
streamed, the same sampling parameters; the worker fast-forwards the text state and the seeded
RNG), at most ``migration_limit`` times, then UNAVAILABLE. Ray restarts the worker process
(``max_restarts``); its new incarnation's Hello makes it *up* again with an empty pool, unless it
restarted more than ``worker_restart_limit`` times within ``worker_restart_window_s``: then the
router kills it for good (*retired*) and says so once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc

from protos.kvserve.v1 import serving_pb2 as spb
from protos.kvserve.v1 import worker_pb2 as pb
from router import metrics
from router.admission import AdmissionQueue, RejectReason
from router.config import RouterConfig
from router.demux import demux_output, merge_responses
from router.placement import Placement, PlacementRequest, WorkerView
from router.prefix_index import AllBlocksCleared, BlockRemoved, BlockStored, PrefixIndex
from router.prompts import prompt_ids
from router.rebalance import (
    Migration,
    MigrationLedger,
    RunningRequest,
    WaitingRequest,
    Watermarks,
    plan_migration,
    plan_preemption,
)
from router.request import WORKER_DOWN, WORKER_RETIRED, WORKER_UP, RouterError, RouterRequest
from router.status import build_cluster_status
from router.validation import ModelLimits, ValidationError, sampling_params, validate_ids
from router.worker_link import WorkerLinkHandler, WorkerLinkService
from workers.core.block_hash import cache_extra, hash_blocks
from workers.core.identity import WorkerIdentity
from workers.core.sizes import blocks_for
from workers.text.chat_template import ChatTemplate

__all__ = ["Router", "RouterError", "RouterRequest", "WorkerEntry"]

logger = logging.getLogger(__name__)


_ACTOR_DEAD_ERRORS = ("RayActorError", "ActorDiedError", "ActorUnavailableError")


def _actor_dead(e: BaseException) -> bool:
    """The Ray error says the actor process is gone (dead or being restarted)."""
    return any(c.__name__ in _ACTOR_DEAD_ERRORS for c in type(e).__mro__)


@dataclass
class WorkerEntry:
    """The router's table row for one worker. Link state (connected or not) lives in the
    WorkerLinkService only; ``healthy`` is the health checks' verdict."""

    identity: WorkerIdentity
    handle: Any  # Ray actor handle of workers.transport.worker.Worker
    report: pb.PressureReport | None = None
    report_time: float = 0.0
    healthy: bool = True
    in_flight: dict[str, int] = field(default_factory=dict)  # request id -> blocks promised, not yet reported
    # Requests whose first output arrived: the next pressure report (same ordered stream) counts
    # their blocks, so their promise is dropped then, not earlier.
    started: set[str] = field(default_factory=set)
    migrations_out: int = 0
    state: str = WORKER_UP  # WORKER_UP, WORKER_DOWN (dead or restarting) or WORKER_RETIRED
    restart_times: deque[float] = field(default_factory=deque)  # monotonic, within the restart window
    restarts_total: int = 0

    @property
    def worker_id(self) -> str:
        return self.identity.worker_id


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
        self.workers: dict[str, WorkerEntry] = {}
        self.requests: dict[str, RouterRequest] = {}
        self._by_worker_rid: dict[str, RouterRequest] = {}  # current dispatches only
        self._orphans: OrderedDict[str, None] = OrderedDict()  # a previous router's requests, aborted
        # NOTE: worker-side ids carry this router's incarnation, so outputs of requests a previous
        # router placed (orphans after a router restart) are recognised and aborted.
        self._incarnation = uuid.uuid4().hex[:8]
        self._dispatch_seq = itertools.count(1)
        self.replays_total = 0
        self.queue: AdmissionQueue[RouterRequest] = AdmissionQueue(
            config.max_queue_requests, config.max_queue_blocks, max_wait_s=config.max_queue_wait_s
        )
        self._expiry: asyncio.TimerHandle | None = None
        self.placement = Placement(config.placement_policy)
        self.prefix_index = PrefixIndex()
        self.link = WorkerLinkService(self)
        self.model_id = ""
        self.block_size = 16
        self.watermarks = Watermarks(config.high_watermark, config.low_watermark)
        self.ledger = MigrationLedger()
        self._migrating: set[str] = set()  # workers in a migration now (source or destination)
        self._tasks: set[asyncio.Task] = set()
        self._worker_ready = asyncio.Event()  # set once a registered worker said Hello (readiness)

    # ---- workers ---------------------------------------------------------------------------
    def add_worker(self, worker_id: str, handle: Any, identity: WorkerIdentity) -> None:
        """Register a worker actor (``identity`` = its ``ready()``); it serves once its WorkerLink
        says Hello.

        Raises:
            ValueError: the identity names another worker, or its block size differs from the
                cluster's.
        """
        if identity.worker_id != worker_id:
            raise ValueError(f"worker {worker_id}: its identity says {identity.worker_id!r}")
        if self.workers and identity.block_size != self.block_size:
            raise ValueError(f"worker {worker_id}: block size {identity.block_size} != cluster's {self.block_size}")
        self.block_size = identity.block_size
        self.model_id = identity.model_id
        limits = ModelLimits(identity.vocab_size, identity.max_model_len, self.config.default_max_tokens)
        self.limits = limits if self.limits is None else self.limits
        entry = self.workers.get(worker_id)
        if entry is None:
            entry = self.workers[worker_id] = WorkerEntry(identity, handle)
        else:
            entry.handle, entry.identity = handle, identity
        # Its WorkerLink may have said Hello before this registration.
        metrics.WORKER_UP.labels(worker_id).set(1 if self.link.connected(worker_id) else 0)
        if self.link.connected(worker_id):
            self._worker_ready.set()

    def ready_event(self) -> asyncio.Event:
        """Set once a registered worker has said Hello: the cluster can serve (readiness)."""
        return self._worker_ready

    async def wait_for_workers(self, worker_ids: list[str], timeout: float) -> None:
        """Until every listed worker is registered and has connected its WorkerLink; TimeoutError otherwise."""
        deadline = time.monotonic() + timeout
        while missing := [w for w in worker_ids if w not in self.workers or not self.link.connected(w)]:
            if time.monotonic() > deadline:
                raise TimeoutError(f"workers never connected their WorkerLink: {missing}")
            await asyncio.sleep(0.05)

    def on_hello(self, worker_id: str, hello: pb.Hello, restarted: bool) -> None:
        entry = self.workers.get(worker_id)
        if entry is None:
            logger.info("Hello from %s before its registration", worker_id)
            return
        if entry.state == WORKER_RETIRED:
            return
        if restarted:
            # A new process: its pool is empty, our requests there are gone (replayed elsewhere
            # unless its death went unnoticed until now), its counters start from 0 again.
            self._worker_down(entry, "restarted")
            entry.restarts_total += 1
            metrics.WORKER_RESTARTS.labels(worker_id).inc()
            now = time.monotonic()
            entry.restart_times.append(now)
            while entry.restart_times and now - entry.restart_times[0] > self.config.worker_restart_window_s:
                entry.restart_times.popleft()
            if len(entry.restart_times) > self.config.worker_restart_limit:
                self._retire(entry)
                return
        entry.healthy = True
        was_down = entry.state == WORKER_DOWN
        entry.state = WORKER_UP
        self._worker_ready.set()
        metrics.WORKER_UP.labels(worker_id).set(1)
        if was_down or restarted:
            logger.warning("worker %s is up again (restart %d, %d blocks)", worker_id, entry.restarts_total,
                           hello.total_blocks)  # fmt: skip
        else:
            logger.info("worker %s connected (%d blocks)", worker_id, hello.total_blocks)
        self._pump()

    def on_disconnect(self, worker_id: str) -> None:
        entry = self.workers.get(worker_id)
        if entry is not None:
            self._worker_down(entry, "its WorkerLink broke")

    def _worker_down(self, entry: WorkerEntry, why: str) -> None:
        """First sign of a worker's death: mark it down (logged once per state change) and replay
        every request it held on the others. Idempotent."""
        metrics.WORKER_UP.labels(entry.worker_id).set(0)
        if entry.state == WORKER_UP:
            entry.state = WORKER_DOWN
            logger.warning("worker %s is down: %s", entry.worker_id, why)
        entry.healthy = False
        entry.report = None
        entry.in_flight.clear()
        entry.started.clear()
        self.prefix_index.remove_worker(entry.worker_id)
        self.ledger.forget(entry.worker_id)
        for r in [r for r in self.requests.values() if r.worker_id == entry.worker_id]:
            self._replay(r, entry.worker_id)

    def _retire(self, entry: WorkerEntry) -> None:
        """A crash-looping worker stays down: kill its actor for good (no more restarts)."""
        entry.state = WORKER_RETIRED
        entry.healthy = False
        metrics.WORKER_UP.labels(entry.worker_id).set(0)
        logger.error(
            "worker %s restarted %d times within %.0fs: it stays down (retired); fix it and restart serve",
            entry.worker_id, len(entry.restart_times), self.config.worker_restart_window_s,
        )  # fmt: skip
        try:
            import ray

            ray.kill(entry.handle, no_restart=True)
        except Exception:  # noqa: BLE001 - not a Ray actor (tests) or already gone
            logger.debug("killing retired worker %s failed", entry.worker_id, exc_info=True)

    def _replay(self, r: RouterRequest, dead_worker_id: str) -> None:
        """Continue ``r`` (its worker died) on a healthy worker after the tokens already streamed,
        or end it UNAVAILABLE beyond ``migration_limit`` replays."""
        if r.finished:
            return
        self._by_worker_rid.pop(r.worker_rid, None)
        # NOTE: if the worker only lost its link (same process), this stops the old dispatch
        # when it reconnects; a new incarnation never gets it.
        self.link.send(dead_worker_id, pb.RouterCommand(abort=pb.Abort(request_id=r.worker_rid)))
        r.worker_id = None
        r.held.clear()
        if r.cancelled:
            self._finish(r)
            return
        if r.replays >= self.config.migration_limit:
            self._fail(r, grpc.StatusCode.UNAVAILABLE,
                       f"worker {dead_worker_id} died; request {r.request_id} was already replayed "
                       f"{r.replays} times (migration limit {self.config.migration_limit})")  # fmt: skip
            return
        r.replays += 1
        r.migrations += 1
        self.replays_total += 1
        metrics.REPLAYS.inc()
        logger.info("replaying %s after %d tokens (worker %s died)", r.request_id, len(r.output_ids), dead_worker_id)
        if not self._place(r) and not self.queue.offer(r, first=True):
            self._fail(r, grpc.StatusCode.UNAVAILABLE, f"worker {dead_worker_id} died and no worker can take over")

    def serving(self, entry: WorkerEntry) -> bool:
        """Whether ``entry`` takes requests now: up, healthy and its WorkerLink connected."""
        return entry.state == WORKER_UP and entry.healthy and self.link.connected(entry.worker_id)

    def _view(self, entry: WorkerEntry) -> WorkerView:
        r, ident = entry.report, entry.identity
        return WorkerView(
            worker_id=ident.worker_id,
            healthy=self.serving(entry),
            block_size=ident.block_size,
            total_blocks=ident.total_blocks,
            free_blocks=int(r.free_blocks) if r else ident.total_blocks,
            cached_evictable_blocks=int(r.cached_evictable_blocks) if r else 0,
            running=int(r.num_running) if r else 0,
            waiting=int(r.num_waiting) if r else 0,
            blocks_in_flight=sum(entry.in_flight.values()),
            used_blocks=int(r.used_blocks) if r else 0,
            reported=r is not None,
            blocks_migrating_in=self.ledger.blocks_in(ident.worker_id),
            blocks_migrating_out=self.ledger.blocks_out(ident.worker_id),
            swap_blocks=ident.swap_blocks,
        )

    def _views(self) -> list[WorkerView]:
        return [self._view(w) for w in self.workers.values()]

    def on_message(self, worker_id: str, msg: pb.WorkerMessage) -> None:
        kind = msg.WhichOneof("body")
        if kind == "step_outputs":
            for out in msg.step_outputs.outputs:
                self._on_output(worker_id, out)
            self._pump()
        elif kind == "pressure":
            self._on_pressure(worker_id, msg.pressure)
        elif kind == "block_events":
            events = [_event(e) for e in msg.block_events.events]
            if self.prefix_index.apply(worker_id, events):
                self.link.send(worker_id, pb.RouterCommand(request_snapshot=pb.RequestSnapshot()))
        elif kind == "block_snapshot":
            self.prefix_index.load_snapshot(worker_id, msg.block_snapshot.seq, msg.block_snapshot.hashes)

    def _on_pressure(self, worker_id: str, report: pb.PressureReport) -> None:
        entry = self.workers.get(worker_id)
        if entry is None or (entry.report is not None and report.seq <= entry.report.seq):
            return
        entry.report, entry.report_time, entry.healthy = report, time.monotonic(), True
        for rid in entry.started:
            entry.in_flight.pop(rid, None)
        entry.started.clear()
        self.ledger.reported(worker_id, report.num_imports_total, report.num_exports_total)
        metrics.observe_pressure(report)
        self._pump()
        self._rebalance(entry)

    # ---- requests --------------------------------------------------------------------------
    def submit(self, request: spb.GenerateRequest, time_remaining_s: float | None = None) -> RouterRequest:
        """Validate and place or queue a request.

        Args:
            request: the client's request.
            time_remaining_s: seconds left of the client's deadline (None: no deadline); a request
                is queued only if it is projected to start within it.

        Raises:
            RouterError: with the status to return (INVALID_ARGUMENT, ALREADY_EXISTS, UNAVAILABLE,
                RESOURCE_EXHAUSTED with a ``retry-after-ms`` trailer).
        """
        if self.limits is None or not self.workers:
            raise RouterError(grpc.StatusCode.UNAVAILABLE, "no workers registered yet")
        try:
            validate_ids(request)
            prompt_ids = self._prompt_ids(request)
            params = sampling_params(request.sampling, len(prompt_ids), self.limits)
        except ValidationError as e:
            metrics.REJECTIONS.labels("invalid").inc()
            raise RouterError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from e
        rid = request.request_id or f"req-{uuid.uuid4().hex[:12]}"
        if rid in self.requests:
            raise RouterError(grpc.StatusCode.ALREADY_EXISTS, f"request_id {rid!r} is in use")
        hashes = tuple(hash_blocks(prompt_ids, self.block_size, cache_extra(self.model_id, request.tenant or None)))
        r = RouterRequest(
            request_id=rid,
            prompt_ids=prompt_ids,
            params=params,
            priority=request.priority,
            tenant=request.tenant,
            block_hashes=hashes,
            num_blocks=blocks_for(len(prompt_ids), self.block_size),
        )
        views = self._views()
        shape = self._shape(r)
        if not any(v.healthy for v in views):
            raise RouterError(grpc.StatusCode.UNAVAILABLE, "no healthy worker")
        if not Placement.fits_anywhere_ever(shape, views):
            metrics.REJECTIONS.labels(RejectReason.NEVER_FITS.value).inc()
            raise RouterError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) "
                "can never fit any worker's KV pool",
            )
        if not self._queue_has_precedence(r) and self._place(r):
            self.requests[rid] = r
            metrics.PROMPT_TOKENS.inc(len(prompt_ids))
            return r
        deadline = None if time_remaining_s is None else time.monotonic() + max(time_remaining_s, 0.0)
        refusal = self.queue.admit(r, deadline=deadline)
        if refusal is not None:
            metrics.REJECTIONS.labels(refusal.reason.value).inc()
            wait = "unknown" if refusal.projected_wait_s is None else f"{refusal.projected_wait_s:.1f} s"
            raise RouterError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"router busy ({refusal.reason.value}, projected wait {wait}); retry in {refusal.retry_after_ms} ms",
                (("retry-after-ms", str(refusal.retry_after_ms)),),
            )
        self.requests[rid] = r
        metrics.PROMPT_TOKENS.inc(len(prompt_ids))
        if deadline is not None:
            self._arm_expiry()
        self._maybe_preempt_for(r)
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
            self._fail(r, grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed while queued at the router")
        self._arm_expiry()

    def _prompt_ids(self, request: spb.GenerateRequest) -> list[int]:
        assert self.limits is not None
        return prompt_ids(request, self.limits, self.tokenizer, self.chat_template)

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

    def _choose(self, r: RouterRequest) -> str | None:
        # NOTE: affinity counts prefixes placed but not yet reported stored, so same-prefix requests that
        # arrive close together follow each other instead of being placed by load alone.
        return self.placement.choose(self._shape(r), self._views(), self.prefix_index.affinity)

    def _place(self, r: RouterRequest) -> bool:
        worker_id = self._choose(r)
        if worker_id is None:
            return False
        entry = self.workers[worker_id]
        cached = min(self.prefix_index.overlap(worker_id, r.block_hashes), (len(r.prompt_ids) - 1) // self.block_size)
        self._new_dispatch(r)
        blocks = blocks_for(len(r.prompt_ids) + len(r.output_ids), self.block_size)
        entry.in_flight[r.worker_rid] = blocks - cached + 1
        self._pend(r, worker_id)
        r.target = worker_id
        self._spawn(self._dispatch(r, entry, r.worker_rid))
        return True

    def _new_dispatch(self, r: RouterRequest) -> None:
        """Give ``r`` a fresh worker-side id (see RouterRequest)."""
        self._by_worker_rid.pop(r.worker_rid, None)
        r.worker_rid = f"{r.request_id}#{self._incarnation}.{next(self._dispatch_seq)}"
        self._by_worker_rid[r.worker_rid] = r

    async def _dispatch(self, r: RouterRequest, entry: WorkerEntry, worker_rid: str) -> None:
        metrics.QUEUE_TIME.observe(time.monotonic() - r.arrival)
        resume = list(r.output_ids) or None
        try:
            await entry.handle.add_request.remote(
                worker_rid, r.prompt_ids, r.params, r.priority, r.tenant or None, resume_output_ids=resume
            )
        except Exception as e:  # noqa: BLE001 - Ray wraps the worker's exception
            entry.in_flight.pop(worker_rid, None)
            if r.worker_rid != worker_rid or r.finished:
                return  # superseded meanwhile (its worker died and it was replayed, or it ended)
            r.target = None
            cause = getattr(e, "cause", e)
            if isinstance(cause, ValueError):
                self._fail(r, grpc.StatusCode.INVALID_ARGUMENT, str(cause))
            elif _actor_dead(e):
                r.worker_id = entry.worker_id
                self._worker_down(entry, f"a call found its actor dead ({type(e).__name__})")
            else:
                logger.warning("dispatch of %s to %s failed: %r", r.request_id, entry.worker_id, e)
                entry.healthy = False
                self._fail(r, grpc.StatusCode.UNAVAILABLE, f"worker {entry.worker_id} failed: {cause}")
            return
        if r.worker_rid != worker_rid:  # superseded while the call was in flight: stop this one
            self.link.send(entry.worker_id, pb.RouterCommand(abort=pb.Abort(request_id=worker_rid)))
            return
        r.target = None
        r.worker_id = entry.worker_id
        if r.cancelled:  # the client left while the call was in flight
            self._send_abort(r)
            self._finish(r)
        elif entry.state != WORKER_UP:  # it died while the call was in flight
            self._replay(r, entry.worker_id)

    def _pump(self) -> None:
        """Place queued requests that fit now (called whenever blocks may have freed)."""
        if not len(self.queue):
            return
        for r in self.queue.pop_ready(lambda r: self._choose(r) is not None):
            self._place(r)

    async def stream(self, r: RouterRequest) -> AsyncIterator[spb.GenerateResponse]:
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

    def cancel(self, r: RouterRequest) -> None:
        """Client gone (cancel, deadline) or Abort: free everything the request holds. Its id is
        free at once; its worker frees the blocks at its next step boundary."""
        if r.finished:
            return
        r.cancelled = True
        self.queue.remove(r.request_id)
        if r.worker_id is not None:
            self._send_abort(r)
        # NOTE: a dispatch still in flight sees ``cancelled`` (or a superseded id) and aborts itself.
        self._finish(r)

    def abort(self, request_id: str) -> bool:
        r = self.requests.get(request_id)
        if r is None or r.finished or r.cancelled:
            return False
        self.cancel(r)
        r.responses.put_nowait(RouterError(grpc.StatusCode.CANCELLED, "aborted by Abort RPC"))
        return True

    def _send_abort(self, r: RouterRequest) -> None:
        assert r.worker_id is not None
        self.link.send(r.worker_id, pb.RouterCommand(abort=pb.Abort(request_id=r.worker_rid)))

    def _on_output(self, worker_id: str, out: pb.RequestOutput) -> None:
        r = self._by_worker_rid.get(out.request_id)
        if r is None:
            # An earlier dispatch (aborted, or its worker was given up), or an orphan a previous
            # router placed: that one nobody will ever read, so stop it.
            tag = out.request_id.rpartition("#")[2]
            if out.finish_reason or tag.startswith(self._incarnation + ".") or out.request_id in self._orphans:
                return
            self._orphans[out.request_id] = None  # NOTE: one abort per orphan, not one per step
            while len(self._orphans) > 4096:
                self._orphans.popitem(last=False)
            self.link.send(worker_id, pb.RouterCommand(abort=pb.Abort(request_id=out.request_id)))
            return
        entry = self.workers.get(worker_id)
        if entry is not None and r.worker_rid in entry.in_flight:
            entry.started.add(r.worker_rid)
        for d in demux_output(r, worker_id, out, time.monotonic()):
            if d.time_to_first_token_s is not None:
                metrics.TTFT.observe(d.time_to_first_token_s)
            if d.inter_token_s is not None:
                metrics.ITL.observe(d.inter_token_s)
            if d.num_new_tokens:
                metrics.GENERATION_TOKENS.inc(d.num_new_tokens)
            if d.e2e_s is not None:
                metrics.E2E.observe(d.e2e_s)
            if d.finished:
                self._finish(r)
            if d.response is None:
                continue
            if not d.finished and r.responses.qsize() >= self.config.max_buffered_responses:
                self._overflow(r)
                return
            r.responses.put_nowait(d.response)

    def _overflow(self, r: RouterRequest) -> None:
        """The client left ``max_buffered_responses`` unread: abort the request (its blocks are
        freed on its worker) and drop what it did not read; it ends RESOURCE_EXHAUSTED."""
        logger.warning("request %s: client stopped reading (%d responses unread); aborted",
                       r.request_id, r.responses.qsize())  # fmt: skip
        if r.worker_id is not None:
            self._send_abort(r)
        self._finish(r)
        while not r.responses.empty():
            r.responses.get_nowait()
        r.responses.put_nowait(RouterError(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"client did not read its stream ({self.config.max_buffered_responses} responses unread); aborted",
        ))  # fmt: skip

    def _pend(self, r: RouterRequest, worker_id: str) -> None:
        """Record ``r``'s prompt blocks as about to be on ``worker_id`` (placement affinity).

        NOTE: keyed by the dispatch's worker-side id: a request id is reusable as soon as its stream
        ended, and the old request's late clean-up must not drop the new one's entry.
        """
        self.prefix_index.drop_pending(r.worker_rid)
        self.prefix_index.add_pending(worker_id, r.worker_rid, r.block_hashes)

    def _finish(self, r: RouterRequest) -> None:
        r.finished = True
        if self.requests.get(r.request_id) is r:
            del self.requests[r.request_id]
        self._by_worker_rid.pop(r.worker_rid, None)
        self.prefix_index.drop_pending(r.worker_rid)
        for entry in self.workers.values():
            entry.in_flight.pop(r.worker_rid, None)

    def _fail(self, r: RouterRequest, code: grpc.StatusCode, message: str) -> None:
        if r.finished:
            return
        self.queue.remove(r.request_id)
        self._finish(r)
        r.responses.put_nowait(RouterError(code, message))

    # ---- cluster-level pressure ------------------------------------------------------------------
    def _running(self) -> list[RunningRequest]:
        # NOTE: generation also stops at max_model_len, so that bounds the tokens still to come.
        max_len = self.limits.max_model_len if self.limits is not None else 0
        return [
            RunningRequest(
                r.request_id,
                r.worker_id,
                r.priority,
                r.arrival,
                len(r.prompt_ids) + r.tokens_received,
                r.tokens_received,
                preemptible=not r.router_preempted,
                remaining_tokens=max(min(r.params.max_tokens, max_len - len(r.prompt_ids)) - r.tokens_received, 0),
            )  # fmt: skip
            for r in self.requests.values()
            if r.worker_id is not None
        ]

    def _rebalance(self, src: WorkerEntry) -> None:
        """Carry out the migration off ``src`` that ``plan_migration`` decides, if any."""
        if not self.config.enable_migration:
            return
        move = plan_migration(
            src.worker_id, self._views(), self._running(), self.watermarks, frozenset(self._migrating)
        )
        if move is not None:
            self._migrating.update((move.src, move.dst))
            self._spawn(self._migrate(self.requests[move.request_id], move))

    async def _migrate(self, r: RouterRequest, move: Migration) -> bool:
        """Export from ``move.src`` at a step boundary, import into ``move.dst``; resume on the
        source if it does not fit. The caller has put both workers in ``_migrating``."""
        src, dst = self.workers[move.src], self.workers[move.dst]
        try:
            state = await src.handle.export_request.remote(r.worker_rid)
            if state is None:
                return False
            ok = await dst.handle.import_request.remote(state)
            await src.handle.finish_export.remote(r.worker_rid, bool(ok))
            if not ok:
                return False
            r.worker_id = dst.worker_id
            self._pend(r, dst.worker_id)
            r.migrations += 1
            src.migrations_out += 1
            # NOTE: the blocks it holds as exported (it may have grown since the decision).
            self.ledger.moved(dataclasses.replace(move, blocks=blocks_for(state.num_tokens, self.block_size)))
            metrics.MIGRATIONS.inc()
            logger.info("migrated %s from %s to %s (%d tokens)", r.request_id, src.worker_id, dst.worker_id,
                        state.num_tokens)  # fmt: skip
            return True
        except Exception:  # noqa: BLE001 - a failed migration leaves the request where it was
            logger.exception("migration of %s failed", r.request_id)
            return False
        finally:
            self._migrating.difference_update((move.src, move.dst))

    async def migrate(self, request_id: str, dst_worker_id: str) -> bool:
        """Operator/test entry point: move one running request to another worker (no watermark
        rule); False if the request, the worker or the pair is not eligible now."""
        r = self.requests.get(request_id)
        if r is None or r.worker_id is None or dst_worker_id not in self.workers or r.worker_id == dst_worker_id:
            return False
        if self._migrating & {r.worker_id, dst_worker_id}:
            return False
        blocks = blocks_for(len(r.prompt_ids) + r.tokens_received, self.block_size)
        move = Migration(request_id, r.worker_id, dst_worker_id, blocks)
        self._migrating.update((move.src, move.dst))
        return await self._migrate(r, move)

    def _maybe_preempt_for(self, waiting: RouterRequest) -> None:
        """Carry out the preemption ``plan_preemption`` decides for a queued request, if any: the
        victim's worker gets a Preempt command and the newcomer at once."""
        if not self.config.enable_priority_preemption:
            return
        shape = WaitingRequest(waiting.request_id, waiting.priority, waiting.num_blocks + 1)
        decision = plan_preemption(shape, self._views(), self._running())
        if decision is None:
            return
        victim = self.requests[decision.victim_id]
        victim.router_preempted = True
        mode = pb.Preempt.SWAP if decision.swap else pb.Preempt.RECOMPUTE
        metrics.PREEMPTIONS.labels("router_" + pb.Preempt.Mode.Name(mode).lower()).inc()
        command = pb.Preempt(request_id=victim.worker_rid, mode=mode)
        self.link.send(decision.worker_id, pb.RouterCommand(preempt=command))
        entry = self.workers[decision.worker_id]
        self.queue.remove(waiting.request_id)
        self._new_dispatch(waiting)
        entry.in_flight[waiting.worker_rid] = decision.blocks_needed
        self._pend(waiting, entry.worker_id)
        waiting.target = entry.worker_id
        self._spawn(self._dispatch(waiting, entry, waiting.worker_rid))

    # ---- health ----------------------------------------------------------------------------------
    async def health_loop(self) -> None:
        """Probe every worker that is up: a stale report or a failing ``check_health`` makes it
        unhealthy (no new work), a dead actor makes it down (its requests replayed). Logged once
        per state change; workers already down wait for their new incarnation's Hello."""
        while True:
            await asyncio.sleep(self.config.health_check_interval_s)
            await asyncio.gather(*(self._probe(e) for e in list(self.workers.values()) if e.state == WORKER_UP))

    async def _probe(self, entry: WorkerEntry) -> None:
        stale = entry.report is not None and time.monotonic() - entry.report_time > self.config.stale_report_s
        try:
            await asyncio.wait_for(entry.handle.check_health.remote(), timeout=self.config.stale_report_s)
            problem = f"no pressure report for {self.config.stale_report_s:.0f}s" if stale else None
        except Exception as e:  # noqa: BLE001 - Ray errors of many kinds
            if _actor_dead(e):
                self._worker_down(entry, f"health probe: {type(e).__name__}")
                return
            problem = f"health probe failed: {e!r}"
        if entry.state != WORKER_UP:
            return
        if problem is not None and entry.healthy:
            logger.warning("worker %s unhealthy: %s", entry.worker_id, problem)
        elif problem is None and not entry.healthy:
            logger.warning("worker %s healthy again", entry.worker_id)
        entry.healthy = problem is None
        up = entry.healthy and self.link.connected(entry.worker_id)
        metrics.WORKER_UP.labels(entry.worker_id).set(1 if up else 0)

    # ---- status ----------------------------------------------------------------------------------
    def cluster_status(self) -> spb.ClusterStatus:
        return build_cluster_status(self)

    # ---- plumbing --------------------------------------------------------------------------------
    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def _event(e: pb.BlockEvent) -> BlockStored | BlockRemoved | AllBlocksCleared:
    kind = e.WhichOneof("kind")
    if kind == "stored":
        return BlockStored(e.seq, tuple(e.stored.hashes))
    if kind == "removed":
        return BlockRemoved(e.seq, tuple(e.removed.hashes))
    return AllBlocksCleared(e.seq)
