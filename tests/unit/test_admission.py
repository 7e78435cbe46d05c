"""Admission queue: bounds, service order, removal, retry hint."""

from __future__ import annotations

import pytest

from kvserve.router.policy.admission import AdmissionQueue, AdmissionState, RejectReason, estimate_retry_after_ms
from tests.unit.admission_doubles import Clock, Item


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
    expected = {reason: 2 if reason is RejectReason.QUEUE_FULL_BLOCKS else 0 for reason in RejectReason}
    assert q.rejections_total == expected


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


# --- admission that answers in time ----------------------------------------------------------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from kvserve.router.policy.admission import Refusal  # noqa: E402


def _drained_queue(clock: Clock, blocks_each: int = 4, n: int = 10, **kw) -> AdmissionQueue:
    """A queue that drained n items of ``blocks_each`` blocks over the last 10 s: 1 req/s."""
    q = AdmissionQueue(max_requests=100, max_blocks=1000, clock=clock, drain_window_s=10.0, **kw)
    for i in range(n):
        q.offer(Item(f"old{i}", blocks_each))
    clock.t += 10.0
    assert len(list(q.pop_ready(lambda _: True))) == n
    return q


def test_projected_wait_counts_queue_ahead_by_priority():
    clock = Clock()
    q = _drained_queue(clock)  # 1 request/s, 4 blocks/s
    assert q.drain_rate() == pytest.approx((1.0, 4.0))
    assert q.projected_wait_s(0) == 0.0  # nothing ahead, nothing needed
    assert q.projected_wait_s(4) == pytest.approx(1.0)  # one completion's worth
    assert q.admit(Item("a", 8)) is None
    assert q.admit(Item("b", 4, priority=5)) is None
    assert q.projected_wait_s(4, priority=0) == pytest.approx(max(3 / 1.0, 16 / 4.0))
    assert q.projected_wait_s(4, priority=5) == pytest.approx(max(2 / 1.0, 8 / 4.0))  # "a" is behind it
    assert q.projected_wait_s(4, priority=9) == pytest.approx(1.0)
    assert q.projected_wait_s() == pytest.approx(max(3 / 1.0, 12 / 4.0))  # back of the queue


def test_admit_refuses_past_deadline_and_max_wait_with_retry_after_the_projection():
    clock = Clock()
    q = _drained_queue(clock, max_wait_s=5.0)
    assert q.admit(Item("a", 4), deadline=clock.t + 0.5) == Refusal(RejectReason.WAIT_EXCEEDS_DEADLINE, 1000, 1.0)
    assert q.admit(Item("b", 4), deadline=clock.t + 1.0) is None
    for i in range(3):
        assert q.admit(Item(f"c{i}", 4)) is None  # waits 2, 3, 4 s
    refusal = q.admit(Item("d", 8))  # 5 ahead requests, 24 blocks: 6 s > max_wait_s
    assert refusal is not None and refusal.reason is RejectReason.WAIT_EXCEEDS_MAX
    assert refusal.retry_after_ms >= 6000 and refusal.projected_wait_s == pytest.approx(6.0)
    assert q.rejections_total[RejectReason.WAIT_EXCEEDS_MAX] == 1
    assert "d" not in q and len(q) == 4


def test_admit_with_unknown_rate_queues_only_the_head():
    clock = Clock()
    q = AdmissionQueue(max_requests=100, max_blocks=1000, clock=clock, unknown_retry_ms=700)
    assert q.projected_wait_s(3) is None
    assert q.admit(Item("head", 3)) is None
    assert q.admit(Item("second", 3)) == Refusal(RejectReason.WAIT_UNKNOWN, 700, None)
    assert q.admit(Item("urgent", 3, priority=1)) is None  # nobody ahead of its class
    assert q.admit(Item("late", 3), deadline=clock.t) == Refusal(RejectReason.WAIT_EXCEEDS_DEADLINE, 700, None)


def test_expired_takes_out_only_passed_deadlines():
    clock = Clock()
    q = AdmissionQueue(max_requests=10, max_blocks=100, clock=clock)
    assert q.admit(Item("a"), deadline=clock.t + 5) is None  # head: admitted with unknown rate
    assert q.admit(Item("b", priority=2), deadline=clock.t + 1) is None
    assert q.admit(Item("c", priority=3)) is None  # no deadline: never expires
    assert q.next_deadline() == clock.t + 1
    assert q.expired() == []
    clock.t += 1
    assert ids(q.expired()) == ["b"]
    q.remove("a")
    clock.t += 10
    assert q.expired() == [] and ids(q) == ["c"] and q.num_blocks == 1
    assert q.next_deadline() is None


_ops = st.lists(
    st.tuples(
        st.sampled_from(["admit", "pop", "tick", "expire"]),
        st.integers(0, 12),  # blocks
        st.integers(-1, 2),  # priority
        st.one_of(st.none(), st.floats(-1.0, 60.0)),  # deadline offset (s)
        st.floats(0.0, 8.0),  # tick (s)
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(ops=_ops, max_wait=st.floats(0.5, 40.0), max_requests=st.integers(0, 20), max_blocks=st.integers(0, 60))
def test_admit_never_past_deadline_and_retry_never_below_projection(ops, max_wait, max_requests, max_blocks):
    clock = Clock()
    q = AdmissionQueue(max_requests, max_blocks, clock=clock, drain_window_s=20.0, max_wait_s=max_wait)
    deadlines: dict[str, float | None] = {}
    for n, (op, blocks, priority, offset, tick) in enumerate(ops):
        if op == "admit":
            item = Item(f"r{n}", blocks, priority)
            deadline = None if offset is None else clock.t + offset
            wait = q.projected_wait_s(blocks, priority)
            refusal = q.admit(item, deadline=deadline)
            if refusal is None:
                assert item.request_id in q
                deadlines[item.request_id] = deadline
                if wait is not None:
                    assert wait <= max_wait
                    assert deadline is None or clock.t + wait <= deadline
                else:  # unknown wait: only with nobody ahead
                    assert all(i.priority < priority for i in q if i.request_id != item.request_id)
                assert deadline is None or deadline > clock.t
            else:
                assert item.request_id not in q
                assert refusal.projected_wait_s == wait
                if wait is not None:
                    assert refusal.retry_after_ms >= wait * 1000
                assert refusal.retry_after_ms >= 0
        elif op == "pop":
            list(q.pop_ready(lambda i, limit=blocks: i.num_blocks <= limit))
        elif op == "tick":
            clock.t += tick
        else:
            gone = q.expired()
            assert all(deadlines[i.request_id] is not None and deadlines[i.request_id] <= clock.t for i in gone)
            assert all(deadlines.get(i.request_id) is None or deadlines[i.request_id] > clock.t for i in q)
        assert q.num_blocks == sum(i.num_blocks for i in q)
