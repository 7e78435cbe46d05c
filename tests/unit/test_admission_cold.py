"""Admission before any drain is measured (a cold cluster): only what provably cannot start within
its deadline (or max_wait_s) is refused; the rest of a burst is queued (kvserve/router/policy/admission.py)."""

from __future__ import annotations

from kvserve.router.policy.admission import AdmissionQueue, ColdCapacity, RejectReason
from tests.unit.admission_doubles import Clock as _Clock
from tests.unit.admission_doubles import Item as _Item


def test_lower_bound_counts_whole_pool_turnovers_of_one_step_each() -> None:
    cap = ColdCapacity(step_s=0.5, pool_blocks=100, free_blocks=20)
    assert cap.earliest_start_s(20) == 0.0  # fits in what is free now
    assert cap.earliest_start_s(21) == 0.5  # one turnover
    assert cap.earliest_start_s(220) == 1.0  # 200 beyond the free ones: two
    assert ColdCapacity(step_s=0.0, pool_blocks=100, free_blocks=0).earliest_start_s(500) == 0.0  # no step yet
    assert ColdCapacity(step_s=0.5, pool_blocks=0, free_blocks=0).earliest_start_s(5) is None  # no pool


def test_a_cold_burst_with_generous_deadlines_is_queued_not_refused() -> None:
    clock = _Clock()
    cap = ColdCapacity(step_s=0.01, pool_blocks=128, free_blocks=0)  # full: the first wave placed
    queue: AdmissionQueue[_Item] = AdmissionQueue(1024, 1 << 20, clock=clock, cold_capacity=lambda: cap)
    refusals = [queue.admit(_Item(f"r{i}", 6), deadline=clock() + 60) for i in range(64)]  # 3x the pool
    assert refusals == [None] * 64 and len(queue) == 64


def test_without_an_estimate_the_same_burst_is_refused_wait_unknown() -> None:
    """What the cold estimate changes (the behaviour it replaces)."""
    clock = _Clock()
    queue: AdmissionQueue[_Item] = AdmissionQueue(1024, 1 << 20, clock=clock)
    refusals = [queue.admit(_Item(f"r{i}", 6), deadline=clock() + 60) for i in range(64)]
    assert refusals[0] is None
    assert {r.reason for r in refusals[1:] if r is not None} == {RejectReason.WAIT_UNKNOWN}


def test_what_provably_cannot_start_in_time_is_still_refused() -> None:
    clock = _Clock()
    cap = ColdCapacity(step_s=1.0, pool_blocks=10, free_blocks=0)  # slow steps, a small pool
    queue: AdmissionQueue[_Item] = AdmissionQueue(1024, 1 << 20, clock=clock, cold_capacity=lambda: cap,
                                                  max_wait_s=30.0)  # fmt: skip
    for i in range(5):  # 50 blocks ahead: 5 turnovers of 1 s at least
        assert queue.admit(_Item(f"q{i}", 10), deadline=clock() + 60) is None
    late = queue.admit(_Item("late", 10), deadline=clock() + 3.0)  # needs >= 6 s
    assert late is not None and late.reason is RejectReason.WAIT_EXCEEDS_DEADLINE
    assert late.projected_wait_s == 6.0 and late.retry_after_ms >= 6000
    assert queue.admit(_Item("in-time", 10), deadline=clock() + 7.0) is None
    huge = queue.admit(_Item("huge", 400))  # 460 blocks: 46 s at least, beyond max_wait_s
    assert huge is not None and huge.reason is RejectReason.WAIT_EXCEEDS_MAX


def test_a_rate_from_a_handful_of_drains_does_not_refuse_while_cold() -> None:
    """The first completions after a start, spread over the queue's age, give a tiny rate; with a
    ColdCapacity admission stays cold (provable refusals only) until the rate rests on enough pops."""
    clock = _Clock()
    cap = ColdCapacity(step_s=0.01, pool_blocks=128, free_blocks=0)
    queue: AdmissionQueue[_Item] = AdmissionQueue(1024, 1 << 20, clock=clock, cold_capacity=lambda: cap)
    for i in range(3):
        assert queue.admit(_Item(f"q{i}", 6)) is None
    clock.t += 29.0  # a slow start: 2 pops in 29 s
    assert len(list(queue.pop_ready(lambda item: item.request_id in ("q0", "q1")))) == 2
    # The untrusted rate (2 pops in 29 s) projects 29 s for one more, far beyond a 20 s deadline.
    assert queue.projected_wait_s(6) is not None and queue.projected_wait_s(6) > 20
    refusals = [queue.admit(_Item(f"r{i}", 6), deadline=clock() + 20) for i in range(40)]
    assert refusals == [None] * 40

def test_once_completions_are_measured_a_cold_burst_is_judged_by_their_service_time() -> None:
    """Requests of 2 s holding 6 blocks each at their end, pools of 128 blocks: 21 run at once,
    turned over every 2 s; 42 were placed already (placement admits on prompt blocks). With a 9 s
    deadline a newcomer must start by 7 s, after at most 3 turnovers: 21 + 3 x 21 = 84 requests,
    of which 42 run: 42 more are queued; the rest are refused, none admitted to miss its deadline."""
    clock = _Clock()
    cap = ColdCapacity(step_s=0.01, pool_blocks=128, free_blocks=0, running=42)
    queue: AdmissionQueue[_Item] = AdmissionQueue(1024, 1 << 20, clock=clock, cold_capacity=lambda: cap)
    for _ in range(4):
        queue.service.observe(2.0, 64, blocks=6)
    refusals = [queue.admit(_Item(f"r{i}", 2), deadline=clock() + 9.0, max_tokens=64) for i in range(200)]
    admitted = [i for i, r in enumerate(refusals) if r is None]
    assert admitted == list(range(42))
    late = refusals[42]
    assert late is not None and late.reason is RejectReason.WAIT_EXCEEDS_DEADLINE and late.projected_wait_s == 8.0
    # Without a deadline the service time does not count (max_wait_s 30 s bounds the start alone).
    assert queue.admit(_Item("no-deadline", 2)) is None


def test_a_request_asking_for_few_tokens_expects_a_short_service() -> None:
    clock = _Clock()
    queue: AdmissionQueue[_Item] = AdmissionQueue(1024, 1 << 20, clock=clock)
    assert queue.service.expected_s(64) == 0.0 and queue.service.typical_s() is None  # nothing measured
    for s, n in ((2.0, 100), (4.0, 100), (3.0, 100), (1.0, 100)):
        queue.service.observe(s, n, blocks=8)
    assert queue.service.typical_s() == 2.5 and queue.service.typical_blocks() == 8
    assert queue.service.expected_s(10) == 0.25  # 25 ms a token
    assert queue.service.expected_s(100_000) == 2.5  # a huge max_tokens: the typical completion
    clock.t += 61.0  # older than the window: forgotten
    assert queue.service.expected_s(10) == 0.0
