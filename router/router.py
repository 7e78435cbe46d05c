"""The Router: request table, placement, admission, cluster-level pressure, health and status.

It decides nothing about policy itself: placement (router/placement.py), admission
(router/admission.py), migration and priority preemption (router/rebalance.py) are pure modules
over ``WorkerView``s; output ordering and de-duplication is router/demux.py. The Router builds
their inputs from its tables and carries out what they return.

Everything here runs on one asyncio loop (the Ray actor's, or a test's), so the tables need no
locks. Workers are Ray actor handles (requests go in by Ray calls); what comes back (outputs,
pressure, block events) arrives over WorkerLink and is handled in ``on_message``.

Lifecycle of a request: ``submit`` validates and either places it (Ray ``add_request``) or queues
it (bounded, in blocks) or refuses it (RouterError with a gRPC status). ``stream`` yields its
responses until the final one. ``cancel`` (client gone, deadline, Abort) aborts it on its worker,
which frees its blocks at the next step boundary.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc

from protos.kvserve.v1 import serving_pb2 as spb
from protos.kvserve.v1 import worker_pb2 as pb
from router import metrics
from router.admission import AdmissionQueue, RejectReason
from router.config import RouterConfig
from router.demux import demux_output
from router.placement import Placement, PlacementRequest, WorkerView
from router.prefix_index import AllBlocksCleared, BlockRemoved, BlockStored, PrefixIndex
from router.rebalance import (
    Migration,
    MigrationLedger,
    RunningRequest,
    WaitingRequest,
    Watermarks,
    plan_migration,
    plan_preemption,
)
from router.request import RouterError, RouterRequest
from router.validation import (
    MAX_TEXT_CHARS,
    ModelLimits,
    ValidationError,
    chat_messages,
    sampling_params,
    validate_ids,
    validate_prompt_ids,
)
from router.worker_link import WorkerLinkHandler, WorkerLinkService
from workers.block_hash import cache_extra, hash_blocks
from workers.block_pool import blocks_for
from workers.chat_template import ChatTemplate, ChatTemplateError
from workers.identity import WorkerIdentity

__all__ = ["Router", "RouterError", "RouterRequest", "WorkerEntry"]

logger = logging.getLogger(__name__)


@dataclass
class WorkerEntry:
    """The router's table row for one worker. Link state (connected or not) lives in the
    WorkerLinkService only; ``healthy`` is the health checks' verdict."""

    identity: WorkerIdentity
    handle: Any  # Ray actor handle of workers.worker.Worker
    report: pb.PressureReport | None = None
    report_time: float = 0.0
    healthy: bool = True
    in_flight: dict[str, int] = field(default_factory=dict)  # request id -> blocks promised, not yet reported
    # Requests whose first output arrived: the next pressure report (same ordered stream) counts
    # their blocks, so their promise is dropped then, not earlier.
    started: set[str] = field(default_factory=set)
    migrations_out: int = 0

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
        self.queue: AdmissionQueue[RouterRequest] = AdmissionQueue(config.max_queue_requests, config.max_queue_blocks)
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
        entry.healthy = True
        self._worker_ready.set()
        if restarted:
            # A new process: its pool is empty, our requests there are gone, and its report and
            # migration counters start from 0 again.
            self.prefix_index.remove_worker(worker_id)
            self.ledger.forget(worker_id)
            entry.report = None
            for r in [r for r in self.requests.values() if r.worker_id == worker_id]:
                self._fail(r, grpc.StatusCode.UNAVAILABLE, f"worker {worker_id} restarted")
        metrics.WORKER_UP.labels(worker_id).set(1)
        logger.info("worker %s connected (%d blocks)", worker_id, hello.total_blocks)

    def on_disconnect(self, worker_id: str) -> None:
        if worker_id in self.workers:
            metrics.WORKER_UP.labels(worker_id).set(0)
            logger.warning("worker %s disconnected", worker_id)

    def _view(self, entry: WorkerEntry) -> WorkerView:
        r, ident = entry.report, entry.identity
        return WorkerView(
            worker_id=ident.worker_id,
            healthy=entry.healthy and self.link.connected(ident.worker_id),
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
    def submit(self, request: spb.GenerateRequest) -> RouterRequest:
        """Validate and place or queue a request. Raises RouterError with the status to return."""
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
        self.requests[rid] = r
        metrics.PROMPT_TOKENS.inc(len(prompt_ids))
        if not self._queue_has_precedence(r) and self._place(r):
            return r
        if not self.queue.offer(r):
            del self.requests[rid]
            reason = self.queue.check(r)
            metrics.REJECTIONS.labels((reason or RejectReason.QUEUE_FULL_REQUESTS).value).inc()
            retry = self.queue.retry_after_ms(r.num_blocks)
            raise RouterError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"router queue full ({reason.value if reason else 'full'}); retry in {retry} ms",
                (("retry-after-ms", str(retry)),),
            )
        self._maybe_preempt_for(r)
        return r

    def _prompt_ids(self, request: spb.GenerateRequest) -> list[int]:
        kind = request.WhichOneof("prompt")
        assert self.limits is not None
        if kind == "token_ids":
            ids = list(request.token_ids.ids)
            validate_prompt_ids(ids, self.limits)
            return ids
        if kind == "text":
            if self.tokenizer is None:
                raise ValidationError("prompt.text", "this model has no tokenizer; send prompt.token_ids")
            if not request.text:
                raise ValidationError("prompt.text", "empty prompt")
            if len(request.text) > MAX_TEXT_CHARS:  # NOTE: before tokenizing it on the event loop
                raise ValidationError("prompt.text", f"longer than {MAX_TEXT_CHARS} characters")
            ids = self.tokenizer.encode(request.text)
            validate_prompt_ids(ids, self.limits, "prompt.text")
            return ids
        if kind == "messages":
            messages = chat_messages(request.messages)
            if self.tokenizer is None or self.chat_template is None:
                raise ValidationError("prompt.messages", "this model has no chat template; send prompt.text")
            try:
                text = self.chat_template.render(messages, add_generation_prompt=True)
            except ChatTemplateError as e:
                raise ValidationError("prompt.messages", str(e)) from e
            # NOTE: the template wrote the special tokens (BOS included), as HF's apply_chat_template.
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            validate_prompt_ids(ids, self.limits, "prompt.messages")
            return ids
        raise ValidationError("prompt", "set prompt.text, prompt.token_ids or prompt.messages")

    def _shape(self, r: RouterRequest) -> PlacementRequest:
        # Generation stops at max_model_len ("length"), as the worker's own fit check assumes.
        assert self.limits is not None
        room = max(self.limits.max_model_len - len(r.prompt_ids), 1)
        return PlacementRequest(len(r.prompt_ids), r.block_hashes, min(r.params.max_tokens, room))

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
        entry.in_flight[r.request_id] = r.num_blocks - cached + 1
        self._pend(r, worker_id)
        r.target = worker_id
        self._spawn(self._dispatch(r, entry))
        return True

    async def _dispatch(self, r: RouterRequest, entry: WorkerEntry) -> None:
        metrics.QUEUE_TIME.observe(time.monotonic() - r.arrival)
        try:
            await entry.handle.add_request.remote(r.request_id, r.prompt_ids, r.params, r.priority, r.tenant or None)
            r.worker_id = entry.worker_id
            if r.cancelled:  # the client left while the call was in flight
                self._send_abort(r)
        except Exception as e:  # noqa: BLE001 - Ray wraps the worker's exception
            entry.in_flight.pop(r.request_id, None)
            cause = getattr(e, "cause", e)
            if isinstance(cause, ValueError):
                self._fail(r, grpc.StatusCode.INVALID_ARGUMENT, str(cause))
            else:
                logger.warning("dispatch of %s to %s failed: %r", r.request_id, entry.worker_id, e)
                entry.healthy = False
                self._fail(r, grpc.StatusCode.UNAVAILABLE, f"worker {entry.worker_id} failed: {cause}")
        finally:
            r.target = None

    def _pump(self) -> None:
        """Place queued requests that fit now (called whenever blocks may have freed)."""
        if not len(self.queue):
            return
        for r in self.queue.pop_ready(lambda r: self._choose(r) is not None):
            self._place(r)

    async def stream(self, r: RouterRequest) -> AsyncIterator[spb.GenerateResponse]:
        """Responses of one request until its final one; RouterError if it ended abnormally."""
        while True:
            item = await r.responses.get()
            if isinstance(item, RouterError):
                raise item
            yield item
            if item.finish_reason:
                return

    def cancel(self, r: RouterRequest) -> None:
        """Client gone (cancel, deadline) or Abort: free everything the request holds."""
        if r.finished:
            return
        r.cancelled = True
        self.queue.remove(r.request_id)
        if r.worker_id is not None:
            self._send_abort(r)
        elif r.target is None:
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
        self.link.send(r.worker_id, pb.RouterCommand(abort=pb.Abort(request_id=r.request_id)))

    def _on_output(self, worker_id: str, out: pb.RequestOutput) -> None:
        r = self.requests.get(out.request_id)
        if r is None:
            return
        entry = self.workers.get(worker_id)
        if entry is not None and r.request_id in entry.in_flight:
            entry.started.add(r.request_id)
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
            if d.response is not None:
                r.responses.put_nowait(d.response)

    def _pend(self, r: RouterRequest, worker_id: str) -> None:
        """Record ``r``'s prompt blocks as about to be on ``worker_id`` (placement affinity)."""
        self.prefix_index.drop_pending(r.request_id)
        self.prefix_index.add_pending(worker_id, r.request_id, r.block_hashes)

    def _finish(self, r: RouterRequest) -> None:
        r.finished = True
        self.requests.pop(r.request_id, None)
        self.prefix_index.drop_pending(r.request_id)
        for entry in self.workers.values():
            entry.in_flight.pop(r.request_id, None)

    def _fail(self, r: RouterRequest, code: grpc.StatusCode, message: str) -> None:
        if r.finished:
            return
        self.queue.remove(r.request_id)
        self._finish(r)
        r.responses.put_nowait(RouterError(code, message))

    # ---- cluster-level pressure ------------------------------------------------------------------
    def _running(self) -> list[RunningRequest]:
        return [
            RunningRequest(
                r.request_id,
                r.worker_id,
                r.priority,
                r.arrival,
                len(r.prompt_ids) + r.tokens_received,
                r.tokens_received,
                preemptible=not r.router_preempted,
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
            state = await src.handle.export_request.remote(r.request_id)
            if state is None:
                return False
            ok = await dst.handle.import_request.remote(state)
            await src.handle.finish_export.remote(r.request_id, bool(ok))
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
        self.requests[decision.victim_id].router_preempted = True
        mode = pb.Preempt.SWAP if decision.swap else pb.Preempt.RECOMPUTE
        metrics.PREEMPTIONS.labels("router_" + pb.Preempt.Mode.Name(mode).lower()).inc()
        command = pb.Preempt(request_id=decision.victim_id, mode=mode)
        self.link.send(decision.worker_id, pb.RouterCommand(preempt=command))
        entry = self.workers[decision.worker_id]
        self.queue.remove(waiting.request_id)
        entry.in_flight[waiting.request_id] = decision.blocks_needed
        self._pend(waiting, entry.worker_id)
        waiting.target = entry.worker_id
        self._spawn(self._dispatch(waiting, entry))

    # ---- health ----------------------------------------------------------------------------------
    async def health_loop(self) -> None:
        """Mark workers with stale reports or failing ``check_health`` unhealthy; fail their requests
        when the actor is gone."""
        while True:
            await asyncio.sleep(self.config.health_check_interval_s)
            now = time.monotonic()
            for entry in list(self.workers.values()):
                stale = entry.report is not None and now - entry.report_time > self.config.stale_report_s
                try:
                    await asyncio.wait_for(entry.handle.check_health.remote(), timeout=self.config.stale_report_s)
                    entry.healthy = not stale
                except Exception as e:  # noqa: BLE001 - Ray errors of many kinds mean the same here
                    if entry.healthy:
                        logger.warning("worker %s unhealthy: %s", entry.worker_id, e)
                    entry.healthy = False
                    if type(e).__name__ in ("RayActorError", "ActorDiedError"):
                        for r in [r for r in self.requests.values() if r.worker_id == entry.worker_id]:
                            self._fail(r, grpc.StatusCode.UNAVAILABLE, f"worker {entry.worker_id} died")
                up = entry.healthy and self.link.connected(entry.worker_id)
                metrics.WORKER_UP.labels(entry.worker_id).set(1 if up else 0)

    # ---- status ----------------------------------------------------------------------------------
    def cluster_status(self) -> spb.ClusterStatus:
        now = time.monotonic()
        status = spb.ClusterStatus(timestamp_ms=int(time.time() * 1000))
        for entry in self.workers.values():
            r, ident = entry.report, entry.identity
            w = status.workers.add(
                worker_id=entry.worker_id,
                healthy=entry.healthy and self.link.connected(entry.worker_id),
                total_blocks=ident.total_blocks,
                num_migrations_total=entry.migrations_out,
                blocks_in_flight=sum(entry.in_flight.values()),
                model_id=ident.model_id,
                node_id=ident.node_id,
                last_report_age_s=now - entry.report_time if r else -1.0,
            )
            if r is not None:
                w.free_blocks, w.used_blocks = r.free_blocks, r.used_blocks
                w.cached_evictable_blocks = r.cached_evictable_blocks
                w.usage = r.used_blocks / r.total_blocks if r.total_blocks else 0.0
                w.num_running, w.num_waiting, w.num_swapped = r.num_running, r.num_waiting, r.num_swapped
                w.swap_blocks_total, w.swap_blocks_free = r.swap_blocks_total, r.swap_blocks_free
                w.num_preemptions_total = r.num_preemptions_total
                w.decode_steps, w.step_latency_ms = r.decode_steps, r.step_latency_ms
                q = r.prefix_cache_query_tokens_total
                w.prefix_cache_hit_rate = r.prefix_cache_hit_tokens_total / q if q else 0.0
            else:
                w.free_blocks = ident.total_blocks
        q = self.queue
        status.router.queue_requests = q.num_requests
        status.router.queue_blocks = q.num_blocks
        status.router.max_queue_requests = q.max_requests
        status.router.max_queue_blocks = q.max_blocks
        status.router.admission_state = q.state.value
        for reason, n in q.rejections_total.items():
            status.router.rejections_total[reason.value] = n
        status.router.requests_in_flight = sum(1 for r in self.requests.values() if r.worker_id is not None)
        return status

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
