"""The router's worker table: one ``WorkerState`` per worker and its lifecycle (register, hello,
down, retire, health probes), apart from the request pipeline (kvserve/router/requests/router.py).

States (``ClusterStatus.workers[].state``): *up* (serving once healthy and its link is connected),
*down* (dead or restarting: its requests were handed to ``on_down`` to replay) and *retired* (it
restarted more than ``worker_restart_limit`` times within ``worker_restart_window_s``: killed for
good, said once). Status shows *draining* while a drain (kvserve/router/requests/drain.py) runs on a worker: it
takes no new work, and the restart that ends the drain does not count toward retirement. A worker
whose circuit breaker is open (kvserve/router/table/breaker.py) takes no new work either. Everything runs on the
router's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvserve.protos.kvserve.v1 import serving_pb2 as spb
from kvserve.protos.kvserve.v1 import worker_pb2 as pb
from kvserve.router.config import RouterConfig
from kvserve.router.observe.metrics import CounterDeltas, RouterMetrics
from kvserve.router.policy.admission import ColdCapacity
from kvserve.router.policy.placement import WorkerView
from kvserve.router.policy.prefix_index import PrefixIndex
from kvserve.router.policy.rebalance import MigrationLedger
from kvserve.router.requests.request import WORKER_DOWN, WORKER_DRAINING, WORKER_RETIRED, WORKER_UP
from kvserve.router.table.breaker import CircuitBreaker
from kvserve.router.table.liveness import LivenessInputs, down_reason
from kvserve.router.table.supervision import WorkerSupervision
from kvserve.router.table.worker_link import WorkerLinkService
from kvserve.workers.core.identity import WorkerIdentity
from kvserve.workers.core.liveness import EngineDeadError, stall_threshold_s
from kvserve.workers.core.sizes import pool_usage

logger = logging.getLogger(__name__)

LIVENESS_TICK_S = 0.25  # how often the liveness rule is applied (pure table reads: cheap)
_ACTOR_DEAD_ERRORS = ("RayActorError", "ActorDiedError", "ActorUnavailableError")


def actor_dead(e: BaseException) -> bool:
    """The Ray error says the actor process is gone (dead or being restarted)."""
    return any(c.__name__ in _ACTOR_DEAD_ERRORS for c in type(e).__mro__)


def object_lost(e: BaseException) -> bool:
    """The Ray error says an object a call needed is gone (``ObjectLostError`` and its kinds: the node that held
    it died, its owner died): for a migration's import, the source's failure, never the destination's."""
    return any(c.__name__ == "ObjectLostError" for c in type(e).__mro__)


# Every running total a report carries: PressureReport's ``*_total`` fields that count events or tokens
# (``*_blocks_total`` are pool sizes, not counters).
_TOTALS = tuple(
    f.name for f in pb.PressureReport.DESCRIPTOR.fields if f.name.endswith("_total") and "_blocks_" not in f.name
)


def _credit(load_ratio: float) -> float:
    """What a tier hit saves, as a fraction of a recompute: ``1 - load/recompute`` as the worker
    measured it (docs/architecture.md §3a); 0 when unmeasured (0.0 in the report) or loading loses."""
    return max(0.0, 1.0 - load_ratio) if load_ratio > 0 else 0.0


@dataclass
class DrainMark:
    """A drain in progress on a worker (kvserve/router/requests/drain.py runs it; the table only reads it).

    Attributes:
        killed_incarnation: set once the drain killed that process: the next new incarnation's
            Hello is the drain's restart (not counted toward retirement) and sets ``back``.
        back: set when that Hello arrived (the worker is up again with a fresh process).
    """

    killed_incarnation: str | None = None
    back: asyncio.Event = field(default_factory=asyncio.Event)
    new_incarnation: str = ""


@dataclass
class WorkerState:
    """The router's row for one worker: its last report, the blocks promised since, supervision.

    Link state (connected or not) lives in the WorkerLinkService only; ``healthy`` is the health
    checks' verdict.
    """

    identity: WorkerIdentity
    handle: Any  # Ray actor handle of workers.transport.worker.Worker
    report: pb.PressureReport | None = None
    report_time: float = 0.0
    # NOTE: a worker reports pressure between steps only; during one long step (a large prefill on a
    # CPU) its heartbeats are what say it is alive, and its last report still holds (nothing freed or
    # allocated mid-step), so the staleness check counts them: else a 5-s prefill marked it unhealthy
    # and, with every worker in one, flipped readiness to 503.
    heard_time: float = 0.0  # the last pressure report or step heartbeat
    healthy: bool = True
    in_flight: dict[str, int] = field(default_factory=dict)  # dispatch id -> blocks promised, not yet reported
    # Requests whose first output arrived: the next pressure report (same ordered stream) counts
    # their blocks, so their promise is dropped then, not earlier.
    started: set[str] = field(default_factory=set)
    migrations_out: int = 0
    state: str = WORKER_UP
    restart_times: deque[float] = field(default_factory=deque)  # monotonic, within the restart window
    restarts_total: int = 0
    totals: dict[str, int] = field(default_factory=dict)  # the last report's running totals
    # Liveness (kvserve/router/table/liveness.py): the last engine progress seen, and when; the slowest step
    # reported; when its WorkerLink broke (None while connected or not yet known broken).
    progress: tuple[int, int] = (0, 0)  # (decode_steps, prefill_tokens_total) of the last report
    progress_time: float = field(default_factory=time.monotonic)
    slowest_step_s: float = 0.0
    # Seconds per token-producing step over the last report interval it was busy throughout (0.0: none yet):
    # the pace its running requests get tokens at, every step of the interval counted (prefills included), not
    # the one step a report carries (reports follow block changes, so they over-sample prefill steps).
    decode_step_s: float = 0.0
    link_lost_at: float | None = None
    # The process its current WorkerLink Hello came from. NOTE: evidence from a Ray call (a dead
    # actor, a timeout) concerns the process the call went to; it must not take down a fresh
    # incarnation that said Hello meanwhile (``down``/``give_up`` take the call's incarnation).
    incarnation: str = ""
    breaker: CircuitBreaker = field(default_factory=CircuitBreaker)
    drain: DrainMark | None = None
    # Its Hello says it takes requests as AddRequests on the link (kvserve/router/requests/link_adds.py), not
    # only by the Ray call.
    takes_adds: bool = False

    @property
    def worker_id(self) -> str:
        return self.identity.worker_id

    @property
    def promised_blocks(self) -> int:
        return sum(self.in_flight.values())

    # NOTE: ``placed``/``released`` are the only writers of ``in_flight`` besides ``forget_promises``:
    # a promise lives from the dispatch until the worker's report counts its blocks or it stops.
    def placed(self, worker_rid: str, promised_blocks: int) -> None:
        """A dispatch to this worker is under way: its blocks are promised here until reported."""
        self.in_flight[worker_rid] = promised_blocks

    def released(self, worker_rid: str) -> None:
        """The dispatch's blocks are counted by a report now, or it no longer runs here."""
        self.in_flight.pop(worker_rid, None)

    def forget_promises(self) -> None:
        """The worker went down: nothing promised there holds."""
        self.in_flight.clear()
        self.started.clear()

    def deltas(self, report: pb.PressureReport) -> CounterDeltas:
        """The counts ``report`` adds to the previous one's (a total that went down means a new
        incarnation whose totals began again: all of it is new)."""
        now = {name: getattr(report, name) for name in _TOTALS}
        prev = self.totals
        if any(now[name] < prev.get(name, 0) for name in _TOTALS):
            prev = {}
        self.totals = now
        return {name: now[name] - prev.get(name, 0) for name in _TOTALS}

    def supervision(self) -> WorkerSupervision:
        """This row's restarts and retirement, for the next router (kvserve/router/table/supervision.py)."""
        return WorkerSupervision.now(self.restarts_total, self.restart_times, self.state == WORKER_RETIRED)

    def restore(self, record: WorkerSupervision) -> None:
        """Carry a previous router's record into this row: its restart history and retirement."""
        self.restarts_total = max(self.restarts_total, record.restarts_total)
        self.restart_times.clear()
        self.restart_times.extend(record.restart_times())
        if record.retired:
            self.state = WORKER_RETIRED
            self.healthy = False

    def view(self, serving: bool, ledger: MigrationLedger) -> WorkerView:
        """What placement and rebalancing see of this worker."""
        r, ident = self.report, self.identity
        return WorkerView(
            worker_id=ident.worker_id,
            healthy=serving,
            block_size=ident.block_size,
            total_blocks=ident.total_blocks,
            free_blocks=int(r.free_blocks) if r else ident.total_blocks,
            cached_evictable_blocks=int(r.cached_evictable_blocks) if r else 0,
            running=int(r.num_running) if r else 0,
            waiting=int(r.num_waiting) if r else 0,
            blocks_in_flight=self.promised_blocks,
            used_blocks=int(r.used_blocks) if r else 0,
            reported=r is not None,
            blocks_migrating_in=ledger.blocks_in(ident.worker_id),
            blocks_migrating_out=ledger.blocks_out(ident.worker_id),
            swap_blocks=ident.swap_blocks,
            host_credit=_credit(r.host_load_ratio) if r else 0.0,
            disk_credit=_credit(r.disk_load_ratio) if r else 0.0,
        )

    def status_row(self, serving: bool, now: float) -> spb.WorkerStatus:
        """This worker as ``ClusterStatus`` shows it (``kvserve top``, ``GetClusterStatus``): the router's own
        facts beside the worker's last report as sent; before its first, the pool its Hello described."""
        ident = self.identity
        r = self.report or pb.PressureReport(worker_id=ident.worker_id, total_blocks=ident.total_blocks,
                                             free_blocks=ident.total_blocks, swap_blocks_total=ident.swap_blocks,
                                             swap_blocks_free=ident.swap_blocks)  # fmt: skip
        return spb.WorkerStatus(
            worker_id=self.worker_id,
            healthy=serving,
            state=WORKER_DRAINING if self.drain is not None and self.state != WORKER_RETIRED else self.state,
            incarnation=self.incarnation,
            restarts_total=self.restarts_total,
            num_migrations_total=self.migrations_out,
            blocks_in_flight=self.promised_blocks,
            model_id=ident.model_id,
            node_id=ident.node_id,
            tensor_parallel_size=ident.tensor_parallel_size,
            last_report_age_s=now - self.report_time if self.report else -1.0,
            usage=pool_usage(r.used_blocks, r.total_blocks),
            report=r,
        )


class WorkerTable:
    """Every registered worker and its lifecycle.

    Args:
        config: the router's knobs (restart limit and window, health interval, stale report age).
        link: the WorkerLink service (connection state, commands).
        prefix_index: forgets a worker that went down.
        ledger: migrations not yet reflected by reports.
        metrics: the router's metrics.
        on_down: called with a worker that just went down (the request pipeline replays its requests).
    """

    def __init__(
        self,
        config: RouterConfig,
        link: WorkerLinkService,
        prefix_index: PrefixIndex,
        ledger: MigrationLedger,
        metrics: RouterMetrics,
        on_down: Callable[[WorkerState], None],
        holds_requests: Callable[[str], bool] = lambda worker_id: False,
    ) -> None:
        self.config = config
        self.link = link
        self.prefix_index = prefix_index
        self.ledger = ledger
        self.metrics = metrics
        self.on_down = on_down
        self.holds_requests = holds_requests
        self.entries: dict[str, WorkerState] = {}
        self.ready = asyncio.Event()  # set once a registered worker said Hello (readiness)
        self.kills_total = 0  # actors killed by the liveness rule (Ray restarts them)
        self.closed = False  # the router is stopping: no worker is called down or killed any more
        self._tasks: set[asyncio.Task] = set()

    def __getitem__(self, worker_id: str) -> WorkerState:
        return self.entries[worker_id]

    def get(self, worker_id: str) -> WorkerState | None:
        return self.entries.get(worker_id)

    def register(
        self, worker_id: str, handle: Any, identity: WorkerIdentity, supervision: WorkerSupervision | None = None
    ) -> WorkerState:
        """Add (or refresh after a router restart) a worker; it serves once its WorkerLink says Hello.

        ``supervision`` carries its restarts and retirement over from a previous router
        (kvserve/router/table/supervision.py): a retired worker stays retired, and its restarts keep counting
        towards the limit within the window.

        Raises:
            ValueError: the identity names another worker, or its block size differs from the cluster's.
        """
        if identity.worker_id != worker_id:
            raise ValueError(f"worker {worker_id}: its identity says {identity.worker_id!r}")
        sizes = {e.identity.block_size for e in self.entries.values() if e.worker_id != worker_id}
        if sizes and identity.block_size not in sizes:
            raise ValueError(f"worker {worker_id}: block size {identity.block_size} != cluster's {sizes.pop()}")
        entry = self.entries.get(worker_id)
        if entry is None:
            c = self.config
            breaker = CircuitBreaker(c.breaker_failures, c.breaker_backoff_s, c.breaker_max_backoff_s)
            entry = self.entries[worker_id] = WorkerState(identity, handle, breaker=breaker)
        else:
            entry.handle, entry.identity = handle, identity
        self.prefix_index.set_node(worker_id, identity.node_id)  # its host/disk tiers are its node's
        if supervision is not None:
            carried = entry.restarts_total
            entry.restore(supervision)
            self.metrics.worker_restarted(worker_id, entry.restarts_total - carried)
        # Its WorkerLink may have said Hello before this registration.
        connected = self.link.connected(worker_id) and entry.state != WORKER_RETIRED
        self.metrics.worker_up(worker_id, connected)
        if connected:
            # NOTE: a Hello before the registration was not applied (``hello``): its process is the
            # link session's.
            entry.incarnation = entry.incarnation or self.link.sessions[worker_id].incarnation
            self.ready.set()
        return entry

    def supervision(self) -> dict[str, WorkerSupervision]:
        """Every worker's supervision record now (for the next router, should this one die)."""
        return {worker_id: entry.supervision() for worker_id, entry in self.entries.items()}

    async def wait_connected(self, worker_ids: list[str], timeout: float) -> None:
        """Until every listed worker is registered and has connected its WorkerLink; TimeoutError otherwise."""
        deadline = time.monotonic() + timeout
        while missing := [w for w in worker_ids if w not in self.entries or not self.link.connected(w)]:
            if time.monotonic() > deadline:
                raise TimeoutError(f"workers never connected their WorkerLink: {missing}")
            await asyncio.sleep(0.05)

    def serving(self, entry: WorkerState) -> bool:
        """Whether ``entry`` takes requests now: up, healthy, its WorkerLink connected, not
        draining and its circuit breaker not open."""
        return (
            entry.state == WORKER_UP
            and entry.healthy
            and entry.drain is None
            and entry.breaker.allows(time.monotonic())
            and self.link.connected(entry.worker_id)
        )

    def any_serving(self) -> bool:
        return any(self.serving(e) for e in self.entries.values())

    def cold_capacity(self, running_tokens: tuple[int, ...] = ()) -> ColdCapacity:
        """What admission may rely on before any drain is measured (kvserve/router/policy/admission.py): the
        fastest and the current (mean) step, the pool blocks and the blocks free now of the serving
        workers, the requests running (placed, not finished: the tokens each may still generate), and
        their mean seconds per token-producing step (``WorkerState.decode_step_s``)."""
        serving = [e for e in self.entries.values() if self.serving(e)]
        steps = [e.report.step_latency_ms / 1000 for e in serving if e.report and e.report.step_latency_ms > 0]
        views = [e.view(True, self.ledger) for e in serving]
        free = sum(max(v.free_blocks + v.cached_evictable_blocks - v.blocks_in_flight, 0) for v in views)
        now = sum(steps) / len(steps) if steps else 0.0
        return ColdCapacity(min(steps, default=0.0), sum(v.total_blocks for v in views), free, len(running_tokens),
                            now, running_tokens, self._pace(serving))  # fmt: skip

    def pace(self) -> float:
        """The serving workers' mean ``decode_step_s`` (those that measured one), seconds; 0.0: none."""
        return self._pace([e for e in self.entries.values() if self.serving(e)])

    @staticmethod
    def _pace(serving: list[WorkerState]) -> float:
        paces = [e.decode_step_s for e in serving if e.decode_step_s > 0]
        return sum(paces) / len(paces) if paces else 0.0

    def views(self) -> list[WorkerView]:
        return [e.view(self.serving(e), self.ledger) for e in self.entries.values()]

    def status_rows(self) -> list[spb.WorkerStatus]:
        now = time.monotonic()
        return [e.status_row(self.serving(e), now) for e in self.entries.values()]

    # ---- lifecycle -------------------------------------------------------------------------------
    def hello(self, worker_id: str, hello: pb.Hello, restarted: bool) -> bool:
        """A worker's WorkerLink said Hello; True if it is up now (its pool may take work)."""
        entry = self.entries.get(worker_id)
        if entry is None:
            logger.info("Hello from %s before its registration", worker_id)
            return False
        if entry.state == WORKER_RETIRED:
            return False
        entry.progress_time = time.monotonic()
        entry.incarnation = hello.incarnation
        entry.takes_adds = hello.takes_adds
        lost_at, entry.link_lost_at = entry.link_lost_at, None
        if restarted:
            entry.slowest_step_s = 0.0
            # A new process: its pool is empty, our requests there are gone (replayed elsewhere
            # unless its death went unnoticed until now), its counters start from 0 again.
            self.down(entry, "restarted")
            entry.restarts_total += 1
            self.metrics.worker_restarted(worker_id)
            entry.breaker.success()  # a fresh process starts with a closed breaker
            now = time.monotonic()
            drain = entry.drain
            if drain is not None and drain.killed_incarnation is not None:
                # NOTE: the restart a drain asked for (kvserve/router/requests/drain.py) is no crash: it does not
                # count toward retirement.
                drain.new_incarnation = hello.incarnation
                drain.back.set()
            else:
                entry.restart_times.append(now)
            while entry.restart_times and now - entry.restart_times[0] > self.config.worker_restart_window_s:
                entry.restart_times.popleft()
            if len(entry.restart_times) > self.config.worker_restart_limit:
                self.retire(entry)
                return False
        entry.healthy = True
        was_down = entry.state == WORKER_DOWN
        entry.state = WORKER_UP
        self.ready.set()
        self.metrics.worker_up(worker_id, True)
        if was_down or restarted:
            logger.warning("worker %s is up again (restart %d, %d blocks)", worker_id, entry.restarts_total,
                           hello.total_blocks)  # fmt: skip
        elif lost_at is not None:
            # NOTE: a blip within the grace period: its requests stayed put, its outbox resends.
            logger.warning("worker %s: WorkerLink back after %.2fs; its requests continue there", worker_id,
                           time.monotonic() - lost_at)  # fmt: skip
        else:
            logger.info("worker %s connected (%d blocks)", worker_id, hello.total_blocks)
        return True

    def down(self, entry: WorkerState, why: str, incarnation: str | None = None) -> None:
        """First sign of a worker's death: mark it down (logged once per state change), forget its
        pool, and hand it to ``on_down`` (its requests are replayed on the others). Idempotent.

        ``incarnation``: the process the evidence concerns (a Ray call's target when it was made);
        evidence about an earlier process than the one now connected is ignored.
        """
        if self.closed:
            return
        if incarnation is not None and incarnation != entry.incarnation:
            logger.info("worker %s: ignoring stale evidence about an earlier process (%s)", entry.worker_id, why)
            return
        self.metrics.worker_up(entry.worker_id, False)
        if entry.state == WORKER_UP:
            entry.state = WORKER_DOWN
            logger.warning("worker %s is down: %s", entry.worker_id, why)
        entry.healthy = False
        entry.report = None
        entry.forget_promises()
        self.prefix_index.remove_worker(entry.worker_id)
        self.ledger.forget(entry.worker_id)
        self.on_down(entry)

    def link_lost(self, entry: WorkerState) -> None:
        """Its WorkerLink broke: no new work; down if it stays broken past ``link_grace_s``
        (``check_liveness``) or at once if Ray says the process is gone or was replaced."""
        if entry.state != WORKER_UP or self.closed:
            return
        entry.link_lost_at = time.monotonic()
        self.metrics.worker_up(entry.worker_id, False)
        logger.warning("worker %s: WorkerLink broke; down unless it is back within %.1fs", entry.worker_id,
                       self.config.link_grace_s)  # fmt: skip
        self._spawn(self._check_process(entry, self.link.sessions[entry.worker_id].incarnation))

    async def _check_process(self, entry: WorkerState, incarnation: str) -> None:
        """Whether the process behind a broken link is still the one we knew (bounded by the grace)."""
        try:
            now_incarnation = await asyncio.wait_for(entry.handle.incarnation.remote(), self.config.link_grace_s)
        except TimeoutError:
            return  # hung or slow: the grace rule decides
        except Exception as e:  # noqa: BLE001 - Ray errors of many kinds
            if actor_dead(e) and entry.link_lost_at is not None and entry.state == WORKER_UP:
                self.down(entry, f"its WorkerLink broke and its actor is gone ({type(e).__name__})", incarnation)
            return
        if now_incarnation != incarnation and entry.link_lost_at is not None and entry.state == WORKER_UP:
            self.down(entry, "its WorkerLink broke and Ray restarted its process", incarnation)

    def close(self) -> None:
        """The router is stopping (an operator's stop, not a failure): from now on no evidence calls a worker
        down, replays its requests or kills it, so the workers' own shutdown after the router's is quiet."""
        self.closed = True

    def check_liveness(self, now: float) -> None:
        """Apply the liveness rule (kvserve/router/table/liveness.py) to every worker that is up."""
        for entry in list(self.entries.values()):
            if entry.state != WORKER_UP:
                continue
            why = down_reason(LivenessInputs(
                now=now, busy=self.busy(entry), progress_time=entry.progress_time,
                slowest_step_s=entry.slowest_step_s, stall_timeout_s=self.config.stall_timeout_s,
                link_lost_at=entry.link_lost_at, link_grace_s=self.config.link_grace_s,
            ))  # fmt: skip
            if why is not None:
                self.give_up(entry, why)

    def busy(self, entry: WorkerState) -> bool:
        """It has work: requests placed there, dispatches in flight, or work in its last report."""
        r = entry.report
        reported = r is not None and r.num_running + r.num_waiting + r.num_swapped > 0
        return bool(entry.in_flight) or reported or self.holds_requests(entry.worker_id)

    def stall_threshold_s(self, entry: WorkerState) -> float:
        """How long a call that needs the worker's engine may take before the worker is stalled."""
        return stall_threshold_s(self.config.stall_timeout_s, entry.slowest_step_s)

    async def bounded(self, entry: WorkerState, call: Any) -> object:
        """Await a worker ``call`` that runs between two of its steps (a request's add, a
        migration's export or import, an abort): TimeoutError once the worker shows no progress (no
        step, no ``StepHeartbeat``) for its stall threshold while it is pending. A worker that keeps
        computing a long step (an overloaded CPU) is slow, not hung (kvserve/workers/core/liveness.py), so
        the wait goes on while it makes progress."""
        fut = asyncio.ensure_future(call)
        since = time.monotonic()
        while True:
            try:
                return await asyncio.wait_for(asyncio.shield(fut), self.stall_threshold_s(entry))
            except TimeoutError:
                if entry.state != WORKER_UP or entry.progress_time <= since:
                    fut.cancel()
                    raise
                since = time.monotonic()

    def give_up(self, entry: WorkerState, why: str, incarnation: str | None = None) -> None:
        """The liveness rule says ``entry`` is down: replay its requests elsewhere (``down``) and
        kill its actor so Ray starts a fresh process (counting toward retirement). Idempotent;
        ``incarnation`` as for ``down``."""
        if self.closed or entry.state != WORKER_UP or (incarnation is not None and incarnation != entry.incarnation):
            return
        self.down(entry, why)
        self.kills_total += 1
        logger.warning("killing worker %s so that Ray restarts it", entry.worker_id)
        try:
            import ray

            ray.kill(entry.handle, no_restart=False)
        except Exception:  # noqa: BLE001 - not a Ray actor (tests) or already gone
            logger.debug("killing worker %s failed", entry.worker_id, exc_info=True)

    def retire(self, entry: WorkerState) -> None:
        """A crash-looping worker stays down: kill its actor for good (no more restarts)."""
        entry.state = WORKER_RETIRED
        entry.healthy = False
        self.metrics.worker_up(entry.worker_id, False)
        logger.error(
            "worker %s restarted %d times within %.0fs: it stays down (retired); fix it and restart serve",
            entry.worker_id, len(entry.restart_times), self.config.worker_restart_window_s,
        )  # fmt: skip
        try:
            import ray

            ray.kill(entry.handle, no_restart=True)
        except Exception:  # noqa: BLE001 - not a Ray actor (tests) or already gone
            logger.debug("killing retired worker %s failed", entry.worker_id, exc_info=True)

    def heartbeat(self, worker_id: str, beat: pb.StepHeartbeat) -> None:
        """A long step is computing (``kvserve/workers/core/liveness.py``): progress, not a stall."""
        entry = self.entries.get(worker_id)
        if entry is not None:
            entry.progress_time = entry.heard_time = time.monotonic()

    def dispatch_ok(self, entry: WorkerState) -> None:
        """A dispatch to ``entry`` (``add_request``, a migration's import) succeeded: its breaker closes."""
        if entry.breaker.success():
            logger.warning("worker %s: a dispatch succeeded; its circuit breaker is closed", entry.worker_id)
            self.metrics.worker_up(entry.worker_id, self.serving(entry))

    def dispatch_failed(self, entry: WorkerState, why: str) -> None:
        """A dispatch to ``entry`` failed while the worker lives (its breaker counts it, and opens
        after ``breaker_failures`` in a row: out of placement for the backoff)."""
        backoff = entry.breaker.failure(time.monotonic())
        if backoff is not None:
            logger.warning("worker %s: %d dispatches failed in a row (last: %s); out of placement for %.1fs "
                           "(circuit breaker open)", entry.worker_id, entry.breaker.failures, why, backoff)  # fmt: skip
            self.metrics.worker_up(entry.worker_id, False)

    def reported(self, worker_id: str, report: pb.PressureReport) -> WorkerState | None:
        """Apply a pressure report; the worker's row if it was newer than the last one applied."""
        entry = self.entries.get(worker_id)
        if entry is None or (entry.report is not None and report.seq <= entry.report.seq):
            return None
        # NOTE: the series are named by the link's authenticated id, never by what the report says
        # (a worker cannot write another's metrics, nor mint label values).
        report.worker_id = worker_id
        now = time.monotonic()
        last, last_time = entry.report, entry.report_time
        if last is not None and min(last.num_running, report.num_running) > 0:  # busy at both ends of the interval
            if (stepped := report.decode_steps - last.decode_steps) > 0:
                entry.decode_step_s = (now - last_time) / stepped
        entry.report, entry.report_time, entry.heard_time, entry.healthy = report, now, now, True
        marker = (report.decode_steps, report.prefill_tokens_total)
        if marker != entry.progress or report.num_running + report.num_waiting + report.num_swapped == 0:
            entry.progress, entry.progress_time = marker, now  # it stepped, or it is idle (never stalled)
        entry.slowest_step_s = max(entry.slowest_step_s, report.step_latency_ms / 1000)
        for rid in entry.started:
            entry.released(rid)
        entry.started.clear()
        self.ledger.reported(worker_id, report.num_imports_total, report.num_exports_total)
        self.metrics.observe_pressure(report, entry.deltas(report), node=entry.identity.node_id)
        return entry

    # ---- health ----------------------------------------------------------------------------------
    async def health_loop(self) -> None:
        """Probe every worker that is up (``probe``, every ``health_check_interval_s``) and apply
        the liveness rule (``check_liveness``, every ``LIVENESS_TICK_S``) until cancelled.

        NOTE: an exception in one round is logged and the next round runs: health checking must
        never stop silently.
        """
        await asyncio.gather(self._probe_loop(), self._liveness_loop())

    async def _probe_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_check_interval_s)
            try:
                up = [e for e in list(self.entries.values()) if e.state == WORKER_UP]
                await asyncio.gather(*(self.probe(e) for e in up))
            except Exception:  # noqa: BLE001 - see health_loop
                logger.exception("worker health probe round failed")

    async def _liveness_loop(self) -> None:
        while True:
            await asyncio.sleep(LIVENESS_TICK_S)
            try:
                self.check_liveness(time.monotonic())
            except Exception:  # noqa: BLE001 - see health_loop
                logger.exception("liveness check failed")

    async def probe(self, entry: WorkerState) -> None:
        incarnation = entry.incarnation
        stale = entry.report is not None and time.monotonic() - entry.heard_time > self.config.stale_report_s
        try:
            await asyncio.wait_for(entry.handle.check_health.remote(), timeout=self.config.stale_report_s)
            problem = f"no pressure report or step heartbeat for {self.config.stale_report_s:.0f}s" if stale else None
        except Exception as e:  # noqa: BLE001 - Ray errors of many kinds
            if actor_dead(e):
                self.down(entry, f"health probe: {type(e).__name__}", incarnation)
                return
            if isinstance(getattr(e, "cause", e), EngineDeadError):
                self.give_up(entry, f"its engine thread died ({getattr(e, 'cause', e)})", incarnation)
                return
            problem = f"health probe failed: {e!r}"
        if entry.state != WORKER_UP:
            return
        if problem is not None and entry.healthy:
            logger.warning("worker %s unhealthy: %s", entry.worker_id, problem)
        elif problem is None and not entry.healthy:
            logger.warning("worker %s healthy again", entry.worker_id)
        entry.healthy = problem is None
        self.metrics.worker_up(entry.worker_id, self.serving(entry))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
