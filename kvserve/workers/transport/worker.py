"""The worker: an engine thread driving ``LLMEngine.step()``, an inbox, and the WorkerLink.

Threading contract (docs/architecture.md): the engine thread owns all engine state. Ray method calls and
the WorkerLink thread only enqueue closures into the inbox (and wait on a Future when they need
an answer) or read immutable snapshots (``stats``). The engine thread runs the inbox between
steps, so every command lands at a step boundary.

``WorkerCore`` is the plain-Python worker (testable without Ray); ``Worker`` is its Ray actor.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from kvserve.protos.kvserve.v1 import serving_pb2 as spb
from kvserve.protos.kvserve.v1 import worker_pb2 as pb
from kvserve.workers.core.add_command import request_from_proto
from kvserve.workers.core.identity import WorkerIdentity
from kvserve.workers.core.kv_events import AllBlocksCleared, BlockEvent, BlockRemoved, BlockStored
from kvserve.workers.core.liveness import (
    HEARTBEAT_S,
    EngineDeadError,
    EngineStalledError,
    WorkerError,
    computing,
    stall_threshold_s,
    step_ceiling_s,
)
from kvserve.workers.core.request import WorkerRequest
from kvserve.workers.core.tls import channel_credentials
from kvserve.workers.engine.config import EngineConfig
from kvserve.workers.engine.engine import make_engine
from kvserve.workers.engine.migration import MigrationState
from kvserve.workers.engine.outputs import RequestOutput
from kvserve.workers.engine.request import Request
from kvserve.workers.transport.data_links import PROGRESS_INTERVAL_S, DataLinks, owner_request_id
from kvserve.workers.transport.options import WorkerOptions
from kvserve.workers.transport.outbox import Outbox
from kvserve.workers.transport.pressure import PressurePolicy, pressure_report
from kvserve.workers.transport.reown import FinishedOwned, catch_up
from kvserve.workers.transport.request_table import owned_request_proto
from kvserve.workers.transport.worker_link import WorkerLinkClient

logger = logging.getLogger(__name__)
T = TypeVar("T")

# NOTE: an owned request's progress on the router's link (docs/architecture.md section 2a) at most this often
# while nothing else calls for it: the router keeps counts and deadlines, the owner gets every token.

_PREEMPT_MODES = {pb.Preempt.RECOMPUTE: "recompute", pb.Preempt.SWAP: "swap", pb.Preempt.MODE_UNSPECIFIED: None}


def _thread_cpu_s(thread: threading.Thread) -> float:
    """CPU seconds ``thread`` has used; the process's where Python cannot read a thread's clock
    (``time.pthread_getcpuclockid`` is POSIX-only). Both ends of a delta read it the same way."""
    if thread.ident is None or not hasattr(time, "pthread_getcpuclockid"):
        return time.process_time()
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


class WorkerCore:
    def __init__(self, worker_id: str, engine_config: EngineConfig, options: WorkerOptions | None = None) -> None:
        self.worker_id = worker_id
        self.options = options or WorkerOptions()
        # NOTE: with tensor_parallel_size N this process is rank 0 of an N-rank group (kvserve/workers/parallel): it
        # starts ranks 1..N-1 on this node; a rank's death kills this engine thread (liveness: the worker restarts).
        self.engine = make_engine(engine_config)
        self.incarnation = uuid.uuid4().hex
        self._inbox: queue.SimpleQueue[tuple[Callable[[], Any], Future]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.outbox = Outbox(hold_s=self.options.router_hold_ms / 1000)
        o = self.options
        self._pressure = PressurePolicy.from_options(o)
        self._report_seq = 0
        self._step_latency_ms = 0.0
        self._slowest_step_s = 0.0  # raises the stall threshold of a slow deployment
        self._last_progress = time.monotonic()
        self._busy = False
        self._decode_steps = 0
        self._num_imports = 0  # NOTE: engine-thread counters, read by _snapshot on that thread
        self._num_exports = 0
        self._report = self._pressure_report()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"engine-{worker_id}", daemon=True)
        # (monotonic, process CPU) when the running step began; None between steps (engine thread writes)
        self._step_began: tuple[float, float] | None = None
        self._heartbeat = threading.Thread(target=self._heartbeat_loop, name=f"heartbeat-{worker_id}", daemon=True)
        self.link: WorkerLinkClient | None = None
        if o.router_address:
            self.link = WorkerLinkClient(
                o.router_address,
                self.outbox,
                hello=self._hello,
                on_connect=lambda: self._submit(self._on_connect),
                on_command=self._on_command,
                credential=o.credential,
                credentials=channel_credentials(o.tls_ca, o.tls_cert, o.tls_key),
            )
        # Owned requests (docs/architecture.md section 2a), engine-thread state: worker rid -> (owner address,
        # owner key), and each one's last progress on the router's link (monotonic, preemptions, swaps).
        self._owners: dict[str, tuple[str, str]] = {}
        self._progress: dict[str, tuple[float, int, int]] = {}
        # Each owned request's engine Request (its whole output, for a take-over's catch-up: reown.py), and the
        # ones that finished while their owner's data link was down (their client may lack the end).
        self._owned_reqs: dict[str, Request] = {}
        # Each owned request's resume grant (WorkerRequest.resume_grant): listed in the RequestTable, so that a
        # restarted router can still let its client resume through another frontend.
        self._grants: dict[str, tuple[str, ...]] = {}
        # Each owned request's logprobs so far, when it asked for them (the engine keeps none): a take-over's
        # catch-up resends them with its tokens (reown.py). Missing the first ones (a replay): not resumable.
        self._owned_logprobs: dict[str, list[dict[int, float]]] = {}
        self._finished_owned = FinishedOwned(o.orphan_timeout_s)
        self.data_links = DataLinks(o, hello=self._hello, submit=self._submit, abort=self._abort_owned)

    # ---- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()
        self._heartbeat.start()
        if self.link is not None:
            self.link.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self.link is not None:
            self.link.stop()
        self.data_links.stop()
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self.engine.close()  # the engine thread is done with it: pending tier writes finish

    # ---- API for any thread (Ray methods) ------------------------------------------------------
    def add_request(self, request: WorkerRequest) -> None:
        """Queue a request, or resume one whose worker died (``resume_output_ids``: the output
        tokens its client already has; see ``LLMEngine.add_request``). Raises ValueError (bad
        input) or WorkerError (draining/dead)."""
        self._call(lambda: self._queue(request))  # NOTE: the engine's Request stays on the engine thread

    def add_requests(self, requests: list[WorkerRequest]) -> list[tuple[str, str] | None] | None:
        """``add_request`` for several in one turn of the engine thread (the router batches a burst).
        None when every one was queued (the common answer, the smallest); else per request None (queued)
        or why it was refused, ``("invalid", message)`` for bad input (a ValueError) or ``("error",
        message)``; one refused never stops the others. Raises WorkerError (dead) for all of them."""

        def add_all() -> list[tuple[str, str] | None] | None:
            refusals = [self._add_one(request) for request in requests]
            return refusals if any(refusals) else None

        return self._call(add_all)

    def _add_one(self, request: WorkerRequest | pb.AddRequest) -> tuple[str, str] | None:
        """Engine thread: queue ``request`` (the Ray call's, or one of an ``AddRequests``); None, or why it was
        refused: ``("invalid", message)`` for bad input (a ValueError), else ``("error", message)``."""
        try:
            self._queue(request if isinstance(request, WorkerRequest) else request_from_proto(request))
        except ValueError as e:
            return ("invalid", str(e))
        except Exception as e:  # noqa: BLE001 - reported for this request alone, as add_request raises it
            return ("error", f"{type(e).__name__}: {e}")
        return None

    def _queue(self, request: WorkerRequest) -> None:
        """Engine thread: the engine takes ``request`` (raising as ``LLMEngine.add_request`` does); an owned one
        streams to its owner from its first output."""
        self.engine.add_request(request)
        if request.owner:
            self._own(request.request_id, (request.owner, request.owner_key), request.resume_grant)

    def abort(self, request_id: str) -> bool:
        return self._call(lambda: self._abort(request_id))

    def preempt(self, request_id: str, mode: str | None = None) -> bool:
        return self._call(lambda: self.engine.preempt_request(request_id, mode))

    def export_request(self, request_id: str) -> MigrationState | None:
        """Pause a request at a step boundary and return its state (see ``finish_export``); an owned
        request's state names its owner, so the destination streams to the same one."""

        def export() -> MigrationState | None:
            state = self.engine.export_request(request_id)
            owner = self._owners.get(request_id)
            if state is None or not owner:
                return state
            return dataclasses.replace(state, owner=owner, resume_grant=self._grants.get(request_id, ()),
                                       logprobs=tuple(self._owned_logprobs.get(request_id, ())))  # fmt: skip

        return self._call(export)

    def finish_export(self, request_id: str, migrated: bool) -> bool:
        """Free an exported request (``migrated``) or resume it here; False if none is exported."""

        def finish() -> bool:
            done = self.engine.finish_export(request_id, migrated)
            self._num_exports += int(done and migrated)
            if done and migrated:
                self._forget(request_id)
            return done

        return self._call(finish)

    def import_request(self, state: MigrationState) -> bool | None:
        """Continue a migrated request here; None ("not now") if it does not fit."""

        def import_() -> bool | None:
            ok = self.engine.import_request(state)
            self._num_imports += int(bool(ok))
            if ok and state.owner:
                self._own(state.request_id, state.owner, state.resume_grant, state.logprobs)
            return ok

        return self._call(import_)

    def stats(self) -> pb.PressureReport:
        """The worker's pressure as of its last step (what its last report said, or would say)."""
        return self._report

    def check_health(self) -> None:
        """Raise EngineDeadError if the engine thread died, EngineStalledError if it has not
        stepped for its stall threshold (``kvserve/workers/core/liveness.py``) while work is pending."""
        if self._error is not None or not self._thread.is_alive():
            raise EngineDeadError(f"worker {self.worker_id}: engine thread is dead ({self._error!r})")
        stalled = time.monotonic() - self._last_progress
        threshold = stall_threshold_s(self.options.stall_timeout_s, self._slowest_step_s)
        if self._busy and stalled > threshold:
            raise EngineStalledError(
                f"worker {self.worker_id}: engine made no progress for {stalled:.1f}s with work pending"
            )

    def identity(self) -> WorkerIdentity:
        """Who this worker is and its pool geometry (what its Hello says)."""
        e = self.engine
        return WorkerIdentity(
            worker_id=self.worker_id,
            model_id=e.model_id,
            block_size=e.config.block_size,
            total_blocks=e.pool.num_blocks,
            max_model_len=e.max_model_len,
            vocab_size=e.model_config.vocab_size,
            swap_blocks=e.swap_pool.num_blocks if e.swap_pool else 0,
            has_tokenizer=e.tokenizer is not None,
            node_id=_ray_node_id(),
            tensor_parallel_size=e.config.tensor_parallel_size,
        )

    # ---- inbox ---------------------------------------------------------------------------
    def _submit(self, fn: Callable[[], T]) -> Future:
        fut: Future = Future()
        self._busy = True
        self._inbox.put((fn, fut))
        self._wake.set()
        return fut

    def _call(self, fn: Callable[[], T], timeout: float | None = None) -> T:
        if not self._thread.is_alive():
            raise WorkerError(f"worker {self.worker_id}: engine thread is not running")
        return self._submit(fn).result(timeout)

    def _drain_inbox(self) -> None:
        while True:
            try:
                fn, fut = self._inbox.get_nowait()
            except queue.Empty:
                return
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - the caller gets the exception
                fut.set_exception(e)
            self._last_progress = time.monotonic()

    # ---- the engine thread -----------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._wake.clear()
                self._drain_inbox()
                engine = self.engine
                self._abort_orphans()
                if engine.has_unfinished_requests():
                    self._busy = True
                    t0 = time.perf_counter()
                    self._step_began = (time.monotonic(), _thread_cpu_s(self._thread))
                    outputs = engine.step()
                    self._step_began = None
                    self._step_latency_ms = (time.perf_counter() - t0) * 1000
                    self._slowest_step_s = max(self._slowest_step_s, self._step_latency_ms / 1000)
                    # engine.step() returns news only for requests that sampled a token this step.
                    self._decode_steps += int(bool(outputs))
                    self._last_progress = time.monotonic()
                    self._publish(outputs)
                else:
                    self._busy = not self._inbox.empty()
                    self._publish([])
                    # NOTE: a change the rate limit held back (the last request just finished) is reported
                    # as soon as the limit allows, not an idle interval later: placement and migration
                    # read it (a worker that looks busy for half a second is passed over).
                    timeout = self.options.idle_report_s / 2
                    pending = self._pressure.wait_s(time.monotonic(), self._report)
                    self._wake.wait(timeout=min(timeout, pending) if pending > 0 else timeout)
                    # NOTE: idle is not a stall: without this, the first command after a long idle
                    # spell (or any add_request racing check_health) looks stalled at once.
                    self._last_progress = time.monotonic()
        except BaseException as e:
            self._error = e
            logger.exception("engine thread of worker %s died", self.worker_id)
            raise

    def _heartbeat_loop(self) -> None:
        """While a step runs past a heartbeat interval and the engine thread computes, that is progress
        (``kvserve/workers/core/liveness.py``): count it here and tell the router (``StepHeartbeat``).

        NOTE: the engine thread's own CPU clock, not the process's: Ray's and gRPC's threads keep a
        process busy enough to look computing while its engine thread sleeps. The engine thread runs
        its share of every parallel op (OpenMP's calling thread is one of the team)."""
        last: tuple[float, float] | None = None  # (monotonic, CPU) at the last check of this step
        # NOTE: well inside the stall threshold, so a beat always lands before it runs out
        interval = min(HEARTBEAT_S, self.options.stall_timeout_s / 4)
        while not self._stop.wait(interval):
            began = self._step_began
            if began is None:
                last = None
                continue
            now, cpu = time.monotonic(), _thread_cpu_s(self._thread)
            if last is None or last[0] < began[0]:
                last = began
            ceiling = step_ceiling_s(self.options.stall_timeout_s, self._slowest_step_s)
            computed = computing(cpu - last[1], now - last[0]) and now - began[0] <= ceiling
            last = (now, cpu)
            if not computed:
                continue
            self._last_progress = now
            beat = pb.StepHeartbeat(step_elapsed_s=now - began[0], step_cpu_s=cpu - began[1])
            self.outbox.put(pb.WorkerMessage(heartbeat=beat))

    def _abort_orphans(self) -> None:
        """Abort the requests nobody reads any more: a router-owned one once the router has been gone for
        ``orphan_timeout_s`` (its client's stream ended with it), an owned one once its *owner's* data link
        has been down that long (docs/architecture.md section 2a: the router's absence does not orphan it,
        its owner still streams it). Their blocks serve no one. A data link down that long that no request
        here uses any more is closed (``DataLinks.close``).

        NOTE: a router (or owner) that comes back sooner gets the outputs replayed and aborts what it no
        longer knows itself (router.py ``_on_output``); this bounds the time without one.
        """
        timeout = self.options.orphan_timeout_s
        if self.link is not None and self.link.disconnected_for() > timeout:
            orphans = [rid for rid in self.engine.requests if rid not in self._owners]
            for rid in orphans:
                self._abort(rid)
            if orphans:
                logger.warning("worker %s: no router for %.0fs; aborted %d orphaned requests", self.worker_id,
                               timeout, len(orphans))  # fmt: skip
        stale = self.data_links.stale(timeout)
        if stale:
            orphans = [rid for rid, (address, _) in self._owners.items() if address in stale]
            for rid in orphans:
                self._abort(rid)
            if orphans:
                logger.warning("worker %s: owners %s unreachable for %.0fs; aborted %d orphaned requests",
                               self.worker_id, sorted(stale), timeout, len(orphans))  # fmt: skip
            # NOTE: an owner down that long with none of its requests left here is dialled no more (a frontend
            # restarted on another port would otherwise keep a link thread redialling it for the worker's life)
            self.data_links.close(stale - {address for address, _ in self._owners.values()})

    def _publish(self, outputs: list[RequestOutput]) -> None:
        """Outputs, then block events, then pressure: one ordered stream (docs/architecture.md).

        The step's messages go to the outbox together (``Outbox.put_step``), which folds them into the
        previous step's while the link has not sent those yet. Owned requests' outputs go to their owners
        first (``_route``); the router's step carries only their progress."""
        step_outputs = self._route(self.engine.num_steps, outputs) if outputs else None
        self.engine.publish_tier_events()  # spills finished while idle reach the router too
        events = self.engine.pool.drain_events()
        block_events = pb.BlockEvents(events=[_event_proto(e) for e in events]) if events else None
        self._report = report = self._pressure_report()
        now = time.monotonic()
        pressure = None
        if self._pressure.due(now, report):
            self._report_seq += 1
            pressure = pb.PressureReport()
            pressure.CopyFrom(report)
            pressure.seq = self._report_seq
        # NOTE: a report dropped while disconnected was not sent: the first _publish after a
        # reconnect then reports at once instead of up to idle_report_s later.
        if self.outbox.put_step(step_outputs, block_events, pressure):
            self._pressure.sent(now, report)

    def _route(self, step: int, outputs: list[RequestOutput]) -> pb.StepOutputs | None:
        """Send owned requests' outputs to their owners (one ``put_step`` per owner, ids rewritten to
        ``<owner_key>#<tag>``); return what the router gets: the router-owned outputs as ever plus the owned
        ones' due progress (None: nothing). Engine thread; forgets the owned requests that finished."""
        if not self._owners:
            return _step_outputs(step, outputs)  # NOTE: the common path without owners, exactly as before
        mine: list[RequestOutput] = []
        owned: dict[str, list[RequestOutput]] = {}
        progress: list[pb.RequestOutput] = []
        now = time.monotonic()
        for o in outputs:
            owner = self._owners.get(o.request_id)
            if owner is None:
                mine.append(o)
                continue
            address, key = owner
            owned.setdefault(address, []).append(dataclasses.replace(o, request_id=owner_request_id(key, o.request_id)))
            if o.new_logprobs and (kept := self._owned_logprobs.get(o.request_id)) is not None:
                kept.extend(o.new_logprobs)
            if (p := self._due_progress(o, now)) is not None:
                progress.append(p)
            if o.finish_reason is not None:
                req = self._owned_reqs.get(o.request_id)
                if req is not None and self.data_links.disconnected_for(address) > 0:
                    self._finished_owned.keep(o.request_id, req, now, self._owned_logprobs.get(o.request_id))
                self._forget(o.request_id)
        for address, outs in owned.items():
            self.data_links.outbox_for(address).put_step(_step_outputs(step, outs), None, None)
        if not mine and not progress:
            return None
        msg = _step_outputs(step, mine)
        msg.outputs.extend(progress)
        return msg

    def _due_progress(self, o: RequestOutput, now: float) -> pb.RequestOutput | None:
        """An owned request's progress for the router, when due: its first output on this worker, its
        finish, a change of its preemption or swap count, or ``PROGRESS_INTERVAL_S`` since the last one.
        So at a token per step the router gets O(1) messages per request per second, never one per token."""
        last = self._progress.get(o.request_id)
        due = (
            last is None
            or o.finish_reason is not None
            or (o.num_preemptions, o.num_swaps) != last[1:]
            or now - last[0] >= PROGRESS_INTERVAL_S
        )
        if not due:
            return None
        self._progress[o.request_id] = (now, o.num_preemptions, o.num_swaps)
        return _progress_message(o)

    def _own(self, request_id: str, owner: tuple[str, str], grant: tuple[str, ...] | None = None,
             logprobs: tuple[dict[int, float], ...] = ()) -> None:  # fmt: skip
        """Engine thread: ``request_id`` streams to ``owner`` = (address, key); its data link is dialled now,
        so it is up by the first token (and an owner that never answers orphans the request in time).
        ``grant``: its resume grant (``WorkerRequest.resume_grant``; None keeps the one it has: a take-over).
        ``logprobs``: those of its tokens so far, when it asked for them (a migration's; kept by a take-over)."""
        self._owners[request_id] = owner
        if grant is not None:
            self._grants[request_id] = grant
        self._progress.pop(request_id, None)
        req = self.engine.requests.get(request_id)
        if req is not None:
            self._owned_reqs[request_id] = req
            if req.sampling_params.logprobs is not None and request_id not in self._owned_logprobs:
                self._owned_logprobs[request_id] = list(logprobs)
        self.data_links.outbox_for(owner[0])

    def _reown(self, request_id: str, address: str, key: str) -> bool:
        """Engine thread: a take-over (reown.py): ``request_id`` streams to (``address``, ``key``) from now on,
        starting with its catch-up (all its output so far); a request that finished unread gets its final
        output there. False: neither here (it moved or ended; the router tells the new owner NOT_FOUND)."""
        req = self.engine.requests.get(request_id) if request_id in self._owners else None
        if req is not None:
            out = catch_up(req, owner_request_id(key, request_id), self._owned_logprobs.get(request_id))
            if out is not None:
                self._own(request_id, (address, key))
        elif (kept := self._finished_owned.take(request_id)) is None:
            return False
        else:
            out = catch_up(kept[0], owner_request_id(key, request_id), kept[1])
        if out is None:  # NOTE: its logprobs are not all here (a replay): it stays its owner's; NOT_FOUND to the new
            return False
        self.data_links.outbox_for(address).put_step(_step_outputs(self.engine.num_steps, [out]), None, None)
        return True

    def _forget(self, request_id: str) -> None:
        """Engine thread: the request left this worker (finished, aborted, migrated away)."""
        self._owners.pop(request_id, None)
        self._progress.pop(request_id, None)
        self._owned_reqs.pop(request_id, None)
        self._grants.pop(request_id, None)
        self._owned_logprobs.pop(request_id, None)

    def _abort_owned(self, address: str, key: str) -> bool:
        """Engine thread: abort what the owner at ``address`` knows as ``key`` (an Abort on its data link);
        another owner's request, even under the same key, is not its to abort. False: none here."""
        rids = [rid for rid, owner in self._owners.items() if owner == (address, key)]
        return any([self._abort(rid) for rid in rids])  # NOTE: a list: abort every one, not the first only

    def _pressure_report(self) -> pb.PressureReport:
        """The engine's stats and this worker's counters: what the router, metrics and ``kvserve top`` see."""
        return pressure_report(self.worker_id, self.engine.make_stats(), decode_steps=self._decode_steps,
                               step_latency_ms=self._step_latency_ms, num_imports_total=self._num_imports,
                               num_exports_total=self._num_exports)  # fmt: skip

    def _abort(self, request_id: str) -> bool:
        out = self.engine.abort_request(request_id)
        if out is None:
            return False
        # NOTE: an owned request's abort goes to its owner; the router gets its (finished) progress
        step_outputs = self._route(self.engine.num_steps, [out])
        if step_outputs is not None:
            self.outbox.put(pb.WorkerMessage(step_outputs=step_outputs))
        return True

    def _hello(self) -> pb.Hello:
        hello = self.identity().to_hello(self.incarnation)
        hello.takes_adds = True  # the router adds requests on the link (``_add_command``), not by a Ray call
        return hello

    def request_drain(self, reason: str) -> None:
        """Ask the router to drain this worker (its requests moved away, then this process
        restarted: kvserve/router/requests/drain.py). Rides the outbox, so a router that is away gets it when the
        link is back. Any thread."""
        logger.warning("worker %s: %s: asking the router to drain this worker", self.worker_id, reason)
        self.outbox.put(pb.WorkerMessage(drain_me=pb.DrainMe(reason=reason)))

    def _on_connect(self) -> None:
        """A (re)connected router gets current pressure and the block snapshot at once, not after
        the next change or idle interval (a restarted router starts from nothing), then the table of
        the owned requests here (docs/architecture.md section 2a: a restarted router adopts them)."""
        self._pressure.reset()
        self._send_snapshot()
        self.outbox.put(pb.WorkerMessage(request_table=self._request_table()))

    def _request_table(self) -> pb.RequestTable:
        """Engine thread: every live owned request (a finished one has left ``_owners`` already), and every
        router-owned one paused by an export (no owner: a restarted router frees it, its client is gone)."""
        live, exporting = self.engine.requests, self.engine.exporting
        owned = [owned_request_proto(live[rid], owner, self._grants.get(rid, ()), rid in exporting)
                 for rid, owner in self._owners.items() if rid in live]  # fmt: skip
        paused = [owned_request_proto(req, ("", ""), exporting=True)
                  for rid, req in exporting.items() if rid not in self._owners]  # fmt: skip
        return pb.RequestTable(requests=owned + paused)

    def _send_snapshot(self) -> None:
        pool = self.engine.pool
        # Pending events are older than the snapshot; ship them first so seqs stay ordered.
        self._publish([])
        tiers = self.engine.tiers.tier_hashes() if self.engine.tiers is not None else {}
        snapshot = pb.BlockSnapshot(seq=pool.event_seq, hashes=pool.cached_hashes(),
                                    host_hashes=tiers.get("host", []), disk_hashes=tiers.get("disk", []))  # fmt: skip
        self.outbox.put(pb.WorkerMessage(block_snapshot=snapshot))

    # ---- router commands (WorkerLink thread -> inbox) ---------------------------------------------
    def _on_command(self, cmd: pb.RouterCommand) -> None:
        self._submit(lambda: self._apply_command(cmd))

    def _apply_command(self, cmd: pb.RouterCommand) -> None:
        kind = cmd.WhichOneof("command")
        rid = ""
        ok = True
        if kind == "abort":
            rid = cmd.abort.request_id
            ok = self._abort(rid)
        elif kind == "preempt":
            rid = cmd.preempt.request_id
            ok = self.engine.preempt_request(rid, _PREEMPT_MODES[cmd.preempt.mode])
        elif kind == "request_snapshot":
            self._send_snapshot()
        elif kind == "reown":
            rid = cmd.reown.request_id
            ok = self._reown(rid, cmd.reown.owner.address, cmd.reown.owner.key)
        elif kind == "add_requests":
            self.outbox.put(pb.WorkerMessage(ack=self._add_command(cmd)))
            return
        if not ok:
            logger.info("worker %s: %s for unknown or inapplicable request %r ignored", self.worker_id, kind, rid)
        self.outbox.put(pb.WorkerMessage(ack=pb.CommandAck(command_seq=cmd.seq, request_id=rid, ok=ok)))

    def _add_command(self, cmd: pb.RouterCommand) -> pb.CommandAck:
        """Engine thread: queue an ``AddRequests``' requests in order; the ack names those refused. It goes on
        the outbox before this step's outputs, so the router learns a request was added before its first token."""
        ack = pb.CommandAck(command_seq=cmd.seq, ok=True)
        for msg in cmd.add_requests.requests:
            refusal = self._add_one(msg)
            if refusal is not None:
                ack.refusals.add(request_id=msg.request_id, kind=refusal[0], message=refusal[1])
        return ack


def _ray_node_id() -> str:
    """The Ray node this worker runs on ("" outside Ray), for ops views and placement checks."""
    try:
        import ray

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""
    except Exception:  # noqa: BLE001 - an ops label is not worth failing a worker over
        return ""


def _step_outputs(step: int, outputs: list[RequestOutput]) -> pb.StepOutputs:
    """One step's outputs: the plain ones (``_is_plain``) as ``DecodeColumns``, the rest as messages.

    NOTE: at one token per step a message object per request was most of what the router's data
    plane paid per token (parse, field reads); a column is read once per step."""
    msg = pb.StepOutputs(decode_step=step)
    plain, other = [], []
    for o in outputs:
        (plain if _is_plain(o) else other).append(o)
    if plain:
        cols = msg.columns
        cols.request_ids.extend([o.request_id for o in plain])
        cols.counts.extend([len(o.new_token_ids) for o in plain])
        cols.token_ids.extend([t for o in plain for t in o.new_token_ids])
        cols.num_output_tokens.extend([o.num_output_tokens for o in plain])
        cols.text_deltas.extend([o.text_delta for o in plain])
    if other:
        msg.outputs.extend([_output_message(o) for o in other])
    return msg


def _progress_message(o: RequestOutput) -> pb.RequestOutput:
    """An owned request's progress on the router's link: its counts and finish, never its tokens, text
    or logprobs (those are the owner's)."""
    return pb.RequestOutput(
        request_id=o.request_id,
        owned=True,
        finish_reason=o.finish_reason or "",
        num_cached_tokens=o.num_cached_tokens,
        num_prompt_tokens=o.num_prompt_tokens,
        num_preemptions=o.num_preemptions,
        num_swaps=o.num_swaps,
        num_output_tokens=o.num_output_tokens,
    )


def _is_plain(o: RequestOutput) -> bool:
    """Tokens and text only: running on, no logprobs, never preempted or swapped (the router keeps
    the most preemptions and swaps any worker reported, so those go as messages)."""
    return bool(o.new_token_ids) and not o.finish_reason and not (o.new_logprobs or o.num_preemptions or o.num_swaps)


def _output_message(o: RequestOutput) -> pb.RequestOutput:
    return pb.RequestOutput(
        request_id=o.request_id,
        new_token_ids=o.new_token_ids,
        text_delta=o.text_delta,
        finish_reason=o.finish_reason or "",
        num_cached_tokens=o.num_cached_tokens,
        num_prompt_tokens=o.num_prompt_tokens,
        num_preemptions=o.num_preemptions,
        num_swaps=o.num_swaps,
        num_output_tokens=o.num_output_tokens,
        logprobs=[
            spb.TokenLogprobs(logprob=entry[token], logprobs=entry)
            for token, entry in zip(o.new_token_ids, o.new_logprobs, strict=False)
        ],
    )


_TIER_PROTO = {"device": pb.TIER_DEVICE, "host": pb.TIER_HOST, "disk": pb.TIER_DISK}


def _event_proto(e: BlockEvent) -> pb.BlockEvent:
    if isinstance(e, BlockStored):
        return pb.BlockEvent(seq=e.seq, stored=pb.BlockStored(hashes=e.hashes, tier=_TIER_PROTO[e.tier]))
    if isinstance(e, BlockRemoved):
        return pb.BlockEvent(seq=e.seq, removed=pb.BlockRemoved(hashes=e.hashes, tier=_TIER_PROTO[e.tier]))
    assert isinstance(e, AllBlocksCleared)
    return pb.BlockEvent(seq=e.seq, cleared=pb.AllBlocksCleared())
