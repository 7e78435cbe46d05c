"""Admission policy: the router's bounded wait queue (pure: no Ray, no gRPC, no torch).

A request that no worker can take now (``Placement.choose`` returned None), or that arrives while
others are already waiting, is ``offer``-ed to the ``AdmissionQueue``. The queue is bounded both in
requests and in KV blocks (the blocks the queued requests will need), so a burst costs bounded
memory and a bounded wait. A refused offer becomes RESOURCE_EXHAUSTED (with ``retry_after_ms``) or,
for ``NEVER_FITS``, INVALID_ARGUMENT.

Service order: higher ``priority`` first; FIFO within a priority.

``pop_ready`` is head-of-line blocking *per priority class*: within a class nothing overtakes the
oldest request (no starvation inside a class, big requests included), but when a class's head
does not fit, lower classes may still be served.
NOTE: this keeps the cluster busy behind one large high-priority request at the price that small
lower-priority requests can delay it while blocks are scarce; a strict global head-of-line queue
would instead idle every worker until the big one fits.

Admission that answers in time (``admit``): besides the bounds, a request is queued only if its
projected start is within ``max_wait_s`` and its projected start plus its expected service time
(``ServiceTimes``: recent completions at the workers' current pace,
kvserve/router/policy/service_times.py) is within its own deadline;
otherwise it is refused at once with a ``retry_after_ms`` no shorter than the projected start.
NOTE: the service time counts because a deadline covers the whole generation: a request admitted
to start just before its deadline would fail DEADLINE_EXCEEDED mid-stream instead. The projection
(``projected_wait_s``) is the work queued ahead of it divided by the recent drain rate:

    wait = max((requests ahead + 1) / requests drained per s, (blocks ahead + its blocks) / blocks drained per s)

"Ahead" is every queued request of its priority or higher (they are served first). The drain rate
counts what ``pop_ready`` took off the queue over the last ``drain_window_s``. NOTE: pops happen
only when running work completes and frees blocks, so under saturation the rate is the cluster's
real completion rate, and a burst of arrivals cannot inflate it (direct placements are not
pops); when the queue is only briefly used it under-estimates capacity, which errs on refusing.
With no drain observed (a cold start, or nothing finished for a whole window), or fewer than
``MIN_TRUSTED_DRAINS`` pops in the window (a rate from the first few completions after a start,
over the queue's whole age, badly under-estimates capacity), there is no rate to trust, and a
cold cluster is exactly when clients burst, so admission does not guess:
it refuses only what *provably* (or, once completions are measured, *measurably*) cannot start
in time (``ColdCapacity``, from what is known: the
fastest recent engine step, the serving pools and their free blocks, the work queued ahead). A
queued request needs the blocks of everything ahead of it plus its own; those beyond the free
blocks must be freed by running work, and a whole pool's turnover takes at least one engine step
(a request must run a step before it can finish and free its blocks), so it cannot start before
``ceil(excess blocks / pool blocks)`` steps (0 before any step was measured: nothing bounds it
then). Once a few requests completed (``ServiceTimes``), the start is estimated from them instead
(``ColdCapacity.estimated_start_s``: the pools hold so many typical requests, turned over once per
typical service time, and all running and queued work goes first): a burst after a quiet spell
has no rate to trust yet known request lengths, and is then refused by what the cluster really
does, not admitted to miss its deadline in the queue. Only a request whose deadline (or
``max_wait_s``) falls before that start (plus its service time) is refused; the rest are queued
within the bounds. Without a ``ColdCapacity`` (no serving pool) the wait is
unknown: only a request with nobody ahead of it is queued, the others are refused with the
"unknown" retry hint.
Queued requests whose deadline passes are taken out by ``expired`` without ever reaching a worker.

The work ahead (``work_start_s``), whenever a step time or completions are measured, cold or warm: the
estimates above see blocks and rates, not how long what is already running will keep its blocks. A
burst of long generations at a saturated cluster (each request holding most of a pool for hundreds
of steps) passes every bound above while the queue grows past what can start before the deadline
(admitted requests that never get a token). So the start is also projected from the decode work
ahead: the pools run ``pool_blocks // blocks per request`` requests at once (the newcomer's whole
sequence, or the typical measured request), each for its expected tokens (what it may still
generate, capped at the typical completion once one is measured) at the measured seconds per token
(``ServiceTimes``, else the workers' current step time); the running requests go first, then the
queued ones ahead, list-scheduled on those slots. The projected start is the later of that and the
estimate above. NOTE: it errs on refusing (a request may end early at EOS), never on queueing what
cannot start: the refusal carries the projected start as its retry hint.
"""

from __future__ import annotations

import enum
import heapq
import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from kvserve.router.policy.service_times import ServiceTimes


class QueueItem(Protocol):
    """What the queue needs from an item (the router's own request record)."""

    @property
    def request_id(self) -> str: ...

    @property
    def priority(self) -> int: ...

    @property
    def num_blocks(self) -> int: ...


T = TypeVar("T", bound=QueueItem)


# A drain rate measured from fewer pops than this (within the window) is not trusted for refusing:
# with a ``ColdCapacity`` admission stays cold (refusals by ``ColdCapacity`` only) until then.
MIN_TRUSTED_DRAINS = 8


class RejectReason(str, enum.Enum):
    """Why an offer was refused; the value is the metric / status label."""

    QUEUE_FULL_REQUESTS = "queue_full_requests"
    QUEUE_FULL_BLOCKS = "queue_full_blocks"
    NEVER_FITS = "never_fits"
    WAIT_EXCEEDS_DEADLINE = "wait_exceeds_deadline"  # projected start after the client's deadline
    WAIT_EXCEEDS_MAX = "wait_exceeds_max"  # projected start beyond max_wait_s
    WAIT_UNKNOWN = "wait_unknown"  # no drain observed yet and others already waiting


@dataclass(frozen=True)
class Refusal:
    """Why ``admit`` refused a request and when to retry.

    Attributes:
        reason: The rule that refused it (metric label).
        retry_after_ms: For the "retry-after-ms" trailer: never shorter than the projected wait.
        projected_wait_s: The projected wait before it could start; None when unknown.
    """

    reason: RejectReason
    retry_after_ms: int
    projected_wait_s: float | None


@dataclass(frozen=True)
class ColdCapacity:
    """What is known of the serving workers before any drain is measured (for ``admit``).

    Attributes:
        step_s: the fastest recent engine step among them, seconds (0 = none measured yet).
        pool_blocks: the blocks of their pools together.
        free_blocks: blocks free for new work now (free and evictable, less those promised).
        running: requests placed and not finished.
        step_now_s: their current step time, seconds (0 = none measured): the work estimate's
            seconds per token before any completion is measured.
        running_tokens: for each running request, the tokens it may still generate (empty: unknown,
            then ``running`` requests of the typical length).
        decode_step_s: their mean seconds per token-producing step over their last busy report
            interval (0 = none measured): the pace running requests get tokens at now, what the
            service times are scaled by (kvserve/router/policy/service_times.py).
    """

    step_s: float
    pool_blocks: int
    free_blocks: int
    running: int = 0
    step_now_s: float = 0.0  # the serving workers' current step time (mean of their last reports)
    running_tokens: tuple[int, ...] = ()  # tokens each running request may still generate
    decode_step_s: float = 0.0  # their mean seconds per token-producing step of late (0 = none measured)

    def estimated_start_s(self, requests_ahead: int, typical_s: float, typical_blocks: int) -> float:
        """When a newcomer behind ``requests_ahead`` queued ones could start, from measured
        completions: the pools hold ``pool_blocks // typical_blocks`` typical requests at once and
        turn them over once per ``typical_s``; everything running and queued ahead goes first.

        NOTE: counting the running ones (``running``): placement admits on prompt blocks, so more
        may be running than the pools can hold at their longest, and they are ahead of any newcomer.
        """
        per_turnover = max(1, self.pool_blocks // max(typical_blocks, 1))
        excess = self.running + requests_ahead + 1 - per_turnover
        return 0.0 if excess <= 0 else math.ceil(excess / per_turnover) * typical_s

    def earliest_start_s(self, blocks_needed: int) -> float | None:
        """A lower bound on when work needing ``blocks_needed`` blocks (its own and all ahead of it)
        can start (see the module doc); None when there is no pool to start on.

        NOTE: with no step measured yet (a cluster that never ran one) nothing bounds it from below
        but 0: a burst at a cluster that just started is queued, not refused.
        """
        if self.pool_blocks <= 0:
            return None
        excess = blocks_needed - self.free_blocks
        if excess <= 0:
            return 0.0
        return math.ceil(excess / self.pool_blocks) * self.step_s


def work_start_s(slots: int, running_s: Sequence[float], ahead_s: Sequence[float]) -> float:
    """When a newcomer could start if ``slots`` requests run at once: the running requests (their
    remaining seconds, ``running_s``) hold slots first, then the queued ones ahead of it
    (``ahead_s``, in service order) take each slot as it frees (list scheduling).

    Returns 0.0 when a slot is free for it now.

    Raises:
        ValueError: ``slots`` < 1.
    """
    if slots < 1:
        raise ValueError(f"slots must be >= 1, got {slots}")
    jobs = [*sorted(running_s), *ahead_s]
    if len(jobs) < slots:
        return 0.0
    heap = jobs[:slots]
    heapq.heapify(heap)
    for job in jobs[slots:]:
        heapq.heappush(heap, heapq.heappop(heap) + job)
    return heap[0]


class AdmissionState(str, enum.Enum):
    """Coarse queue state for status displays."""

    OPEN = "open"  # queue empty: requests go straight to placement
    QUEUEING = "queueing"  # requests wait, room left
    REJECTING = "rejecting"  # at its request or block bound: new offers are refused


def estimate_retry_after_ms(
    excess_requests: int,
    excess_blocks: int,
    requests_per_s: float,
    blocks_per_s: float,
    *,
    floor_ms: int = 100,
    ceiling_ms: int = 30_000,
    unknown_ms: int = 1_000,
) -> int:
    """Time until enough of the queue drains for a refused request to fit, in ms.

    ``max(excess_requests / requests_per_s, excess_blocks / blocks_per_s)``, clamped to
    ``[floor_ms, ceiling_ms]``. An excess with no observed drain (rate 0) gives ``unknown_ms``:
    NOTE: not the ceiling, since a cold start or a quiet spell has no rate yet, and a client told
    to wait 30 s then idles needlessly; clients back off further if refused again. No excess gives
    ``floor_ms``.
    """
    seconds = 0.0
    for excess, rate in ((excess_requests, requests_per_s), (excess_blocks, blocks_per_s)):
        if excess > 0:
            if rate <= 0:
                return min(ceiling_ms, max(floor_ms, unknown_ms))
            seconds = max(seconds, excess / rate)
    return int(min(ceiling_ms, max(floor_ms, round(seconds * 1000))))


class AdmissionQueue(Generic[T]):
    """Bounded priority queue of waiting requests, measured in requests and in blocks.

    Args:
        max_requests: most requests queued at once (0 disables queueing).
        max_blocks: most blocks (sum of ``item.num_blocks``) queued at once. NOTE: an item larger
            than ``max_blocks`` is accepted into an *empty* queue, so every request that fits some
            worker can eventually wait its turn; the real bound is ``max(max_blocks, one item)``.
        clock: monotonic seconds (injectable for tests).
        drain_window_s: how far back ``pop_ready`` drains count towards the drain rate.
        max_wait_s: ``admit`` refuses a request whose projected wait exceeds this.
        unknown_retry_ms: the retry hint when the wait cannot be projected (no drain observed).
        cold_capacity: what is known of the workers, for admission before any drain is observed
            (module doc); None: refuse what has others ahead of it then.
        pace: ``ColdCapacity.decode_step_s`` alone, read with each completion (``self.service``); None:
            from ``cold_capacity``.

    Raises:
        ValueError: a negative bound or a non-positive window or wait.
    """

    def __init__(
        self,
        max_requests: int,
        max_blocks: int,
        *,
        clock: Callable[[], float] = time.monotonic,
        drain_window_s: float = 30.0,
        max_wait_s: float = 30.0,
        unknown_retry_ms: int = 1_000,
        cold_capacity: Callable[[], ColdCapacity] | None = None,
        pace: Callable[[], float] | None = None,
    ) -> None:
        if max_requests < 0 or max_blocks < 0:
            raise ValueError(f"queue bounds must be >= 0, got {max_requests=} {max_blocks=}")
        if drain_window_s <= 0:
            raise ValueError(f"drain_window_s must be positive, got {drain_window_s}")
        if not max_wait_s > 0 or unknown_retry_ms <= 0:
            raise ValueError(f"max_wait_s and unknown_retry_ms must be positive, got {max_wait_s=} {unknown_retry_ms=}")
        self.max_wait_s = max_wait_s
        self.unknown_retry_ms = unknown_retry_ms
        self.cold_capacity = cold_capacity
        # The router reports each completion to it; it scales them to the workers' current pace (its module doc).
        self.service = ServiceTimes(clock=clock, step_now=pace or self._step_now_s)
        self._deadlines: list[tuple[float, int, str]] = []  # heap of (deadline, tie, request_id)
        self._deadline_of: dict[str, float] = {}
        self._tie = 0
        self.max_requests = max_requests
        self.max_blocks = max_blocks
        self._clock = clock
        self._window_s = drain_window_s
        self._created = clock()
        self._classes: dict[int, OrderedDict[str, T]] = {}
        self._priority_of: dict[str, int] = {}
        self._class_blocks: dict[int, int] = {}  # sum of num_blocks per priority class
        self._num_blocks = 0
        self._drains: deque[tuple[float, int]] = deque()  # (time, blocks) per item popped
        self._tokens: dict[str, int] = {}  # max_tokens of each item queued by ``admit``
        self._rejections = {reason: 0 for reason in RejectReason}

    # ------------------------------------------------------------------ admission

    def check(self, item: T, *, fits_ever: bool = True) -> RejectReason | None:
        """Why ``item`` would be refused now, or None if ``offer`` would accept it (no change).

        Args:
            item: the request record.
            fits_ever: ``Placement.fits_anywhere_ever`` for it; False gives ``NEVER_FITS``.

        Raises:
            ValueError: ``item.request_id`` is already queued, or ``item.num_blocks < 0``.
        """
        if item.request_id in self._priority_of:
            raise ValueError(f"request {item.request_id!r} is already queued")
        if item.num_blocks < 0:
            raise ValueError(f"request {item.request_id!r}: num_blocks must be >= 0, got {item.num_blocks}")
        if not fits_ever:
            return RejectReason.NEVER_FITS
        if len(self) >= self.max_requests:
            return RejectReason.QUEUE_FULL_REQUESTS
        if self._num_blocks + item.num_blocks > self.max_blocks and len(self) > 0:
            return RejectReason.QUEUE_FULL_BLOCKS
        return None

    def offer(self, item: T, *, fits_ever: bool = True, first: bool = False) -> bool:
        """Queue ``item`` if the bounds allow; count the reason if not.

        ``first`` puts it at the head of its priority class, past the queue's bounds (a failover
        replay: it was admitted long ago, its client is mid-stream, and refusing it now would end
        a stream the cluster accepted; the bounds only refuse newcomers). NOTE: so the bounds can
        be exceeded by at most the requests of the workers that died, which were running already.

        Returns:
            True if queued; False if refused (``check`` gives the reason; ``rejections_total``
            counts it; never for ``first`` unless it can never fit).

        Raises:
            ValueError: as ``check``.
        """
        reason = self.check(item, fits_ever=fits_ever)
        if first and reason in (RejectReason.QUEUE_FULL_REQUESTS, RejectReason.QUEUE_FULL_BLOCKS):
            reason = None
        if reason is not None:
            self._rejections[reason] += 1
            return False
        cls = self._classes.setdefault(item.priority, OrderedDict())
        cls[item.request_id] = item
        if first:
            cls.move_to_end(item.request_id, last=False)
        self._priority_of[item.request_id] = item.priority
        self._num_blocks += item.num_blocks
        self._class_blocks[item.priority] = self._class_blocks.get(item.priority, 0) + item.num_blocks
        return True

    def admit(
        self, item: T, *, fits_ever: bool = True, deadline: float | None = None, max_tokens: int = 0,
        blocks_ever: int = 0,
    ) -> Refusal | None:  # fmt: skip
        """Queue ``item`` only if it fits the bounds and is projected to start in time, and, with a
        deadline, to finish by it (its start plus its expected service time, ``self.service``).

        Args:
            item: the request record (not yet queued).
            fits_ever: as ``check``.
            deadline: the client's deadline on this queue's clock (monotonic seconds), or None for
                no deadline; the item leaves the queue through ``expired`` once it passes.
            max_tokens: the tokens it may still generate (its expected service time scales with
                them, capped at the typical completion).
            blocks_ever: the blocks its whole sequence holds at its longest (prompt + max_tokens;
                0: its ``num_blocks``), how much of a pool it takes in the work estimate.

        Returns:
            None if queued; else the ``Refusal`` (counted in ``rejections_total``). NOTE: a refusal
            by the bounds also carries a retry hint no shorter than the projected wait, since
            retrying sooner than work can start only earns another refusal.

        Raises:
            ValueError: as ``check``.
        """
        now = self._clock()
        reason = self.check(item, fits_ever=fits_ever)
        wait = self.projected_wait_s(item.num_blocks, item.priority)
        if reason is None:
            if deadline is not None and deadline <= now:
                reason = RejectReason.WAIT_EXCEEDS_DEADLINE
            else:
                # NOTE: one snapshot for the estimates below (a walk of the running requests), and only here:
                # a request the bounds refuse costs none
                cap = self.cold_capacity() if self.cold_capacity is not None else None
                step = cap.decode_step_s if cap is not None else 0.0
                service = self.service.expected_s(max_tokens, step_s=step) if deadline is not None else 0.0
                if wait is None or (len(self._drains) < MIN_TRUSTED_DRAINS and self.cold_capacity is not None):
                    # NOTE: cold: no rate, or one from a handful of pops over an arbitrary span (the
                    # first completions after a start), which would refuse what can start in time.
                    wait = self._cold_start_s(item, cap)
                # NOTE: the decode work ahead (``work``) guards the client's deadline: a request that cannot start
                # by it is refused now rather than queued to expire. The operator's queue-wait cap keeps the
                # drain-rate projection: the work estimate is an upper bound (every request at its max_tokens
                # unless most stop early), and on a slow machine it refused a burst whose generous deadlines
                # it would have met.
                work = self._work_start_s(item, max_tokens, blocks_ever, cap)
                if wait is None:
                    wait = work
                start = wait if work is None or wait is None else max(wait, work)
                if wait is None:
                    if self._requests_ahead(item.priority) > 0:
                        reason = RejectReason.WAIT_UNKNOWN
                elif deadline is not None and start + service > deadline - now:
                    reason, wait = RejectReason.WAIT_EXCEEDS_DEADLINE, start
                elif wait > self.max_wait_s:
                    reason = RejectReason.WAIT_EXCEEDS_MAX
        if reason is None:
            self.offer(item, fits_ever=fits_ever)
            self._tokens[item.request_id] = max_tokens
            if deadline is not None:
                self._tie += 1
                heapq.heappush(self._deadlines, (deadline, self._tie, item.request_id))
                self._deadline_of[item.request_id] = deadline
            return None
        self._rejections[reason] += 1
        if wait is None:
            retry = self.unknown_retry_ms if reason is not RejectReason.NEVER_FITS else 0
            if reason in (RejectReason.QUEUE_FULL_REQUESTS, RejectReason.QUEUE_FULL_BLOCKS):
                retry = self.retry_after_ms(item.num_blocks)
        else:
            retry = max(self.retry_after_ms(item.num_blocks), math.ceil(wait * 1000))
        return Refusal(reason, retry, wait)

    def _step_now_s(self) -> float:
        """The serving workers' current pace (``ColdCapacity.decode_step_s``), 0.0 when unknown."""
        return self.cold_capacity().decode_step_s if self.cold_capacity is not None else 0.0

    def _cold_start_s(self, item: T, cap: ColdCapacity | None) -> float | None:
        """With no drain rate to trust: when ``item`` could start (``cap``), or None."""
        if cap is None:
            return None
        typical = self.service.typical_s(step_s=cap.decode_step_s)
        if typical is not None and cap.pool_blocks > 0:
            ahead = self._requests_ahead(item.priority)
            return cap.estimated_start_s(ahead, typical, self.service.typical_blocks())
        return cap.earliest_start_s(self._blocks_ahead(item.priority) + item.num_blocks)

    def _work_start_s(self, item: T, max_tokens: int, blocks_ever: int, cap: ColdCapacity | None) -> float | None:
        """When ``item`` could start given the decode work ahead of it (module doc), or None when
        nothing measured gives a time per token (or there is no pool)."""
        if cap is None:
            return None
        # NOTE: the completions' time per token (at the workers' current pace) or the bare step if slower.
        per_token = max(self.service.per_token_s(step_s=cap.decode_step_s) or 0.0, cap.step_now_s) or cap.step_s
        if per_token <= 0 or cap.pool_blocks <= 0:
            return None
        typical = self.service.typical_tokens()
        size = self.service.typical_blocks() if typical is not None else max(blocks_ever, item.num_blocks, 1)
        slots = max(1, cap.pool_blocks // size)

        def seconds(tokens: int) -> float:
            tokens = max(tokens, 1)
            return per_token * (tokens if typical is None else min(tokens, typical))

        running = cap.running_tokens or (typical or 1,) * cap.running
        ahead = [seconds(self._tokens.get(q.request_id, 0))
                 for p in sorted(self._classes, reverse=True) if p >= item.priority
                 for q in self._classes[p].values()]  # fmt: skip
        return work_start_s(slots, [seconds(t) for t in running], ahead)

    def expired(self) -> list[T]:
        """Take out, and return, queued items whose deadline (given to ``admit``) has passed.

        Oldest deadline first. Items already gone (popped, removed) are skipped.
        """
        now = self._clock()
        out: list[T] = []
        while self._deadlines and self._deadlines[0][0] <= now:
            deadline, _, rid = heapq.heappop(self._deadlines)
            if self._deadline_of.get(rid) == deadline and rid in self._priority_of:
                out.append(self._take(rid))
        return out

    def next_deadline(self) -> float | None:
        """The earliest deadline among queued items (when to call ``expired`` next), or None."""
        while self._deadlines and self._deadline_of.get(self._deadlines[0][2]) != self._deadlines[0][0]:
            heapq.heappop(self._deadlines)
        return self._deadlines[0][0] if self._deadlines else None

    def projected_wait_s(self, num_blocks: int = 0, priority: int | None = None) -> float | None:
        """Projected seconds before a newcomer of ``num_blocks`` blocks and ``priority`` could start.

        Args:
            num_blocks: the newcomer's blocks.
            priority: its priority; None for the back of the whole queue (the wait any newcomer of
                the lowest priority faces: what the projected-wait metric shows).

        Returns:
            0.0 when nothing is queued ahead and it needs no blocks; None when the wait cannot be
            projected (no drain observed in the window); else the projection (module doc).
        """
        ahead_requests = self._requests_ahead(priority)
        ahead_blocks = self._blocks_ahead(priority)
        if ahead_requests == 0 and num_blocks == 0:
            return 0.0
        requests_per_s, blocks_per_s = self.drain_rate()
        if requests_per_s <= 0:
            return None
        wait = (ahead_requests + 1) / requests_per_s
        if ahead_blocks + num_blocks > 0:
            if blocks_per_s <= 0:
                return None
            wait = max(wait, (ahead_blocks + num_blocks) / blocks_per_s)
        return wait

    def _requests_ahead(self, priority: int | None) -> int:
        return sum(len(c) for p, c in self._classes.items() if priority is None or p >= priority)

    def _blocks_ahead(self, priority: int | None) -> int:
        if priority is None:
            return self._num_blocks
        return sum(b for p, b in self._class_blocks.items() if p >= priority)

    def pop_ready(self, fits: Callable[[T], bool]) -> Iterator[T]:
        """Yield, and remove, queued items that fit now, in service order.

        Priority classes are visited highest first; in each, items are tried oldest first and
        the class stops at the first one that does not fit (head-of-line per class, see the
        module doc). Each item is removed before it is yielded, so the caller can dispatch it
        (and add its blocks to the worker's in-flight count) before ``fits`` judges the next.
        Stopping the iteration early leaves the rest queued. Items offered during the
        iteration are considered on the next call.

        Args:
            fits: whether an item can be placed now (e.g. ``Placement.choose(...) is not None``).
        """
        for priority in sorted(self._classes, reverse=True):
            while (cls := self._classes.get(priority)) is not None:
                item = next(iter(cls.values()))
                if not fits(item):
                    break
                self._take(item.request_id)
                self._drains.append((self._clock(), item.num_blocks))
                yield item

    def remove(self, request_id: str) -> T | None:
        """Take a queued request out (abort, timeout); None if it is not queued."""
        if request_id not in self._priority_of:
            return None
        return self._take(request_id)

    def _take(self, request_id: str) -> T:
        priority = self._priority_of.pop(request_id)
        self._deadline_of.pop(request_id, None)
        self._tokens.pop(request_id, None)
        cls = self._classes[priority]
        item = cls.pop(request_id)
        if not cls:
            del self._classes[priority]
        self._num_blocks -= item.num_blocks
        self._class_blocks[priority] -= item.num_blocks
        if not cls:
            del self._class_blocks[priority]
        return item

    # ------------------------------------------------------------------ counts

    def __len__(self) -> int:
        return len(self._priority_of)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._priority_of

    def __iter__(self) -> Iterator[T]:
        """Queued items in service order (highest priority first, FIFO within)."""
        for priority in sorted(self._classes, reverse=True):
            yield from list(self._classes[priority].values())

    @property
    def num_requests(self) -> int:
        return len(self)

    @property
    def num_blocks(self) -> int:
        """Sum of ``num_blocks`` over queued items."""
        return self._num_blocks

    def counts_by_priority(self) -> dict[int, int]:
        """Queued requests per priority class (classes with none are absent)."""
        return {p: len(cls) for p, cls in self._classes.items()}

    @property
    def rejections_total(self) -> dict[RejectReason, int]:
        """Refused offers since creation, by reason (every reason present)."""
        return dict(self._rejections)

    @property
    def state(self) -> AdmissionState:
        if len(self) == 0:
            return AdmissionState.REJECTING if self.max_requests == 0 else AdmissionState.OPEN
        if len(self) >= self.max_requests or self._num_blocks >= self.max_blocks:
            return AdmissionState.REJECTING
        return AdmissionState.QUEUEING

    # ------------------------------------------------------------------ retry hint

    def drain_rate(self) -> tuple[float, float]:
        """(requests/s, blocks/s) popped by ``pop_ready`` over the last ``drain_window_s``.

        The window is shortened to the queue's age while it is younger than the window.
        """
        now = self._clock()
        while self._drains and self._drains[0][0] < now - self._window_s:
            self._drains.popleft()
        span = min(self._window_s, now - self._created)
        if span <= 0 or not self._drains:
            return 0.0, 0.0
        return len(self._drains) / span, sum(b for _, b in self._drains) / span

    def retry_after_ms(self, num_blocks: int = 0, *, floor_ms: int = 100, ceiling_ms: int = 30_000) -> int:
        """Estimated wait before an offer of ``num_blocks`` blocks would be accepted, in ms.

        The excess (requests and blocks that must leave the queue first) divided by the recent
        drain rate (``drain_rate``), clamped to ``[floor_ms, ceiling_ms]``; the "unknown" default of
        ``estimate_retry_after_ms`` when nothing has drained recently. Meant for the
        "retry-after-ms" trailer of RESOURCE_EXHAUSTED; aborts also free room, so it errs long.
        """
        if num_blocks > self.max_blocks:  # oversize: only an empty queue takes it
            excess_requests, excess_blocks = len(self), self._num_blocks
        else:
            excess_requests = max(0, len(self) + 1 - self.max_requests)
            excess_blocks = max(0, self._num_blocks + num_blocks - self.max_blocks)
        requests_per_s, blocks_per_s = self.drain_rate()
        return estimate_retry_after_ms(
            excess_requests,
            excess_blocks,
            requests_per_s,
            blocks_per_s,
            floor_ms=floor_ms,
            ceiling_ms=ceiling_ms,
        )
