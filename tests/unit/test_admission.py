"""Admission queue: bounds, service order, removal, retry hint."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from router.admission import AdmissionQueue, AdmissionState, RejectReason, estimate_retry_after_ms


@dataclass(frozen=True)
class Item:
    request_id: str
    num_blocks: int = 1
    priority: int = 0


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def ids(items) -> list[str]:
    return [i.request_id for i in items]


def test_limit_by_requests():
    q = AdmissionQueue(max_requests=2, max_blocks=100)
    assert q.offer(Item("a")) and q.offer(Item("b"))
    assert q.check(Item("c")) is RejectReason.QUEUE_FULL_REQUESTS
    assert not q.offer(Item("c"))
    assert q.rejections_total[RejectReason.QUEUE_FULL_REQUESTS] == 1
    assert len(q) == 2 and "c" not in q


def test_limit_by_blocks():
    q = AdmissionQueue(max_requests=10, max_blocks=10)
    assert q.offer(Item("a", 6))
    assert q.check(Item("b", 5)) is RejectReason.QUEUE_FULL_BLOCKS
    assert not q.offer(Item("b", 5))
    assert q.offer(Item("c", 4))
    assert q.num_blocks == 10 and q.num_requests == 2
    assert not q.offer(Item("d", 1))
    assert q.rejections_total == {
        RejectReason.QUEUE_FULL_REQUESTS: 0,
        RejectReason.QUEUE_FULL_BLOCKS: 2,
        RejectReason.NEVER_FITS: 0,
    }


def test_oversize_item_only_into_empty_queue():
    q = AdmissionQueue(max_requests=10, max_blocks=10)
    assert q.offer(Item("big", 25))
    assert not q.offer(Item("small", 1))
    q.remove("big")
    assert q.offer(Item("small", 1))
    assert q.check(Item("big2", 25)) is RejectReason.QUEUE_FULL_BLOCKS


def test_never_fits():
    q = AdmissionQueue(max_requests=10, max_blocks=10)
    assert q.check(Item("a"), fits_ever=False) is RejectReason.NEVER_FITS
    assert not q.offer(Item("a"), fits_ever=False)
    assert q.rejections_total[RejectReason.NEVER_FITS] == 1 and len(q) == 0


def test_zero_requests_disables_queue():
    q = AdmissionQueue(max_requests=0, max_blocks=10)
    assert q.check(Item("a")) is RejectReason.QUEUE_FULL_REQUESTS
    assert q.state is AdmissionState.REJECTING


def test_priority_order_and_fifo_within_priority():
    q = AdmissionQueue(max_requests=10, max_blocks=100)
    for item in [
        Item("l1", priority=-1),
        Item("n1"),
        Item("h1", priority=5),
        Item("n2"),
        Item("h2", priority=5),
    ]:
        assert q.offer(item)
    assert ids(q) == ["h1", "h2", "n1", "n2", "l1"]
    assert ids(q.pop_ready(lambda item: True)) == ["h1", "h2", "n1", "n2", "l1"]
    assert len(q) == 0 and q.num_blocks == 0 and q.counts_by_priority() == {}


def test_head_of_line_per_priority_class():
    q = AdmissionQueue(max_requests=10, max_blocks=1000)
    for item in [
        Item("h-big", 50, 1),
        Item("h-small", 1, 1),
        Item("n-small", 1),
        Item("n-big", 50),
        Item("n-tail", 1),
    ]:
        assert q.offer(item)
    # The big head of the high class blocks its class (h-small must not overtake it), but the
    # normal class proceeds up to its own big head.
    popped = ids(q.pop_ready(lambda item: item.num_blocks < 10))
    assert popped == ["n-small"]
    assert ids(q) == ["h-big", "h-small", "n-big", "n-tail"]
    assert ids(q.pop_ready(lambda item: True)) == ["h-big", "h-small", "n-big", "n-tail"]


def test_pop_ready_lets_caller_account_between_items():
    q = AdmissionQueue(max_requests=10, max_blocks=100)
    for name in "abcd":
        q.offer(Item(name, 3))
    budget = [7]

    def fits(item):
        return item.num_blocks <= budget[0]

    out = []
    for item in q.pop_ready(fits):
        budget[0] -= item.num_blocks  # dispatched: the worker's room shrinks
        out.append(item.request_id)
    assert out == ["a", "b"] and ids(q) == ["c", "d"]


def test_pop_ready_stopped_early_keeps_rest():
    q = AdmissionQueue(max_requests=10, max_blocks=100)
    for name in "abc":
        q.offer(Item(name))
    gen = q.pop_ready(lambda item: True)
    assert next(gen).request_id == "a"
    gen.close()
    assert ids(q) == ["b", "c"]


def test_remove():
    q = AdmissionQueue(max_requests=10, max_blocks=100)
    q.offer(Item("a", 3))
    q.offer(Item("b", 4, priority=2))
    assert q.remove("missing") is None
    assert q.remove("b") == Item("b", 4, priority=2)
    assert q.num_blocks == 3 and ids(q) == ["a"] and q.counts_by_priority() == {0: 1}
    assert q.remove("b") is None
    assert q.offer(Item("b", 4))  # the id may be reused once gone


def test_duplicate_and_negative_raise():
    q = AdmissionQueue(max_requests=10, max_blocks=100)
    q.offer(Item("a"))
    with pytest.raises(ValueError):
        q.offer(Item("a"))
    with pytest.raises(ValueError):
        q.offer(Item("b", -1))
    with pytest.raises(ValueError):
        AdmissionQueue(max_requests=-1, max_blocks=1)


def test_state():
    q = AdmissionQueue(max_requests=2, max_blocks=10)
    assert q.state is AdmissionState.OPEN
    q.offer(Item("a", 2))
    assert q.state is AdmissionState.QUEUEING
    q.offer(Item("b", 2))
    assert q.state is AdmissionState.REJECTING
    assert AdmissionState.REJECTING.value == "rejecting"


def test_estimate_retry_after_ms():
    assert estimate_retry_after_ms(0, 0, 0.0, 0.0) == 100
    assert estimate_retry_after_ms(2, 0, 4.0, 0.0) == 500
    assert estimate_retry_after_ms(1, 30, 10.0, 10.0) == 3000
    assert estimate_retry_after_ms(1, 0, 0.0, 5.0) == 1_000  # no drain observed yet
    assert estimate_retry_after_ms(1, 0, 0.0, 5.0, unknown_ms=50) == 100  # clamped to the floor
    assert estimate_retry_after_ms(1000, 0, 1.0, 1.0, ceiling_ms=5000) == 5000


def test_retry_after_from_drain_rate():
    clock = Clock()
    q = AdmissionQueue(max_requests=2, max_blocks=100, clock=clock, drain_window_s=10.0)
    q.offer(Item("a", 5))
    q.offer(Item("b", 5))
    assert q.retry_after_ms() == 1_000  # nothing drained yet: the 'unknown' default
    clock.t += 10.0
    list(q.pop_ready(lambda item: True))
    q.offer(Item("c", 5))
    q.offer(Item("d", 5))
    list(q.pop_ready(lambda item: True))
    q.offer(Item("e", 5))
    q.offer(Item("f", 5))
    # Four drains of 5 blocks over the 10 s window -> 0.4 requests/s, 2 blocks/s.
    assert q.drain_rate() == pytest.approx((0.4, 2.0))
    # Full by requests: one must leave -> 1 / 0.4 s.
    assert q.retry_after_ms() == 2500
    # Old drains age out of the window.
    clock.t += 11.0
    assert q.drain_rate() == (0.0, 0.0)
    assert q.retry_after_ms() == 1_000
