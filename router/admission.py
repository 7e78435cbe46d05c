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
"""

from __future__ import annotations

import enum
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from typing import Generic, Protocol, TypeVar


class QueueItem(Protocol):
    """What the queue needs from an item (the router's own request record)."""

    @property
    def request_id(self) -> str: ...

    @property
    def priority(self) -> int: ...

    @property
    def num_blocks(self) -> int: ...


T = TypeVar("T", bound=QueueItem)


class RejectReason(str, enum.Enum):
    """Why an offer was refused; the value is the metric / status label."""

    QUEUE_FULL_REQUESTS = "queue_full_requests"
    QUEUE_FULL_BLOCKS = "queue_full_blocks"
    NEVER_FITS = "never_fits"


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

    Raises:
        ValueError: a negative bound or a non-positive window.
    """

    def __init__(
        self,
        max_requests: int,
        max_blocks: int,
        *,
        clock: Callable[[], float] = time.monotonic,
        drain_window_s: float = 30.0,
    ) -> None:
        if max_requests < 0 or max_blocks < 0:
            raise ValueError(f"queue bounds must be >= 0, got {max_requests=} {max_blocks=}")
        if drain_window_s <= 0:
            raise ValueError(f"drain_window_s must be positive, got {drain_window_s}")
        self.max_requests = max_requests
        self.max_blocks = max_blocks
        self._clock = clock
        self._window_s = drain_window_s
        self._created = clock()
        self._classes: dict[int, OrderedDict[str, T]] = {}
        self._priority_of: dict[str, int] = {}
        self._num_blocks = 0
        self._drains: deque[tuple[float, int]] = deque()  # (time, blocks) per item popped
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

    def offer(self, item: T, *, fits_ever: bool = True) -> bool:
        """Queue ``item`` if the bounds allow; count the reason if not.

        Returns:
            True if queued; False if refused (``check`` gives the reason; ``rejections_total``
            counts it).

        Raises:
            ValueError: as ``check``.
        """
        reason = self.check(item, fits_ever=fits_ever)
        if reason is not None:
            self._rejections[reason] += 1
            return False
        self._classes.setdefault(item.priority, OrderedDict())[item.request_id] = item
        self._priority_of[item.request_id] = item.priority
        self._num_blocks += item.num_blocks
        return True

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
        cls = self._classes[priority]
        item = cls.pop(request_id)
        if not cls:
            del self._classes[priority]
        self._num_blocks -= item.num_blocks
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
