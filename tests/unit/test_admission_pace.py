"""Service times at the machine's current pace (kvserve/router/policy/service_times.py): completions
measured while engine steps were fast under-estimate what a request takes once the machine slows
down (issue 41: on a shared 2-core CI runner another process took the CPU between the calibration
wave and the burst of tests/chaos/test_failover.py's 10x overload, and admission judged by the fast
completions admitted calls that ran out their deadline: 12 late vs 41 ok). Each completion counts at
``max(1, pace now / pace when it completed)``; the pace is the workers' mean seconds per
token-producing step over their last busy report interval (kvserve/router/table/workers.py)."""

from __future__ import annotations

import dataclasses

import pytest

from kvserve.protos.kvserve.v1 import worker_pb2 as pb
from kvserve.router.policy.admission import AdmissionQueue, ColdCapacity, RejectReason
from kvserve.router.policy.service_times import ServiceTimes
from kvserve.workers.core.sizes import blocks_for
from tests.unit.admission_doubles import Clock as _Clock
from tests.unit.admission_doubles import Item as _Item
from tests.unit.test_router_failover import _router, _run


def test_completions_are_scaled_up_to_a_slower_pace_and_never_below_what_they_measured() -> None:
    clock, pace = _Clock(), [0.03]
    service = ServiceTimes(clock=clock, step_now=lambda: pace[0])
    for _ in range(4):
        service.observe(2.0, 64)  # 64 tokens in 2 s while a step took 30 ms
    assert service.typical_s() == 2.0 and service.expected_s(64) == 2.0
    pace[0] = 0.06  # the machine slows down: every step takes twice as long
    assert service.typical_s() == pytest.approx(4.0) and service.per_token_s() == pytest.approx(4.0 / 64)
    assert service.expected_s(64) == pytest.approx(4.0) and service.expected_s(16) == pytest.approx(1.0)
    pace[0] = 0.015  # faster than when they were measured: as measured (no evidence the next one is faster)
    assert service.typical_s() == 2.0 and service.expected_s(64) == 2.0
    # Completions measured at the slow pace are the same steps as the fast ones at that pace ...
    pace[0] = 0.06
    for _ in range(4):
        service.observe(4.0, 64)
    assert service.typical_s() == pytest.approx(4.0)
    # ... but count as measured at a faster one, until fresh completions show the faster machine.
    pace[0] = 0.03
    assert service.typical_s() == pytest.approx(3.0)  # the median of 2, 2, 2, 2, 4, 4, 4, 4
    assert service.typical_s(step_s=0.12) == pytest.approx(8.0)  # a caller's snapshot of the pace wins
    pace[0] = 0.0  # no pace measured (no serving worker): the completions as measured
    assert service.typical_s() == pytest.approx(3.0)


def test_without_a_pace_completions_count_as_measured() -> None:
    service = ServiceTimes(clock=_Clock())
    for _ in range(4):
        service.observe(2.0, 64)
    assert service.typical_s() == 2.0 and service.expected_s(64) == 2.0 and service.per_token_s() == 2.0 / 64


PROMPT, MAX_TOKENS, BLOCK, WAVE_S = 32, 64, 16, 2.0


def test_admission_follows_the_pace_when_the_machine_slows_down_and_speeds_up() -> None:
    """tests/chaos/test_failover.py's overload, on a fake clock: pools of 128 blocks run 21 requests
    of 32 + 64 tokens (6 blocks) at once; a calibration wave took 2 s at 30 ms a step, and the
    deadline is 3.5 waves (7 s). The 21 of the wave before the burst are running."""
    clock = _Clock()
    cap = [ColdCapacity(step_s=0.03, pool_blocks=128, free_blocks=0, running=21, step_now_s=0.03,
                        running_tokens=(MAX_TOKENS,) * 21, decode_step_s=0.03)]  # fmt: skip
    queue: AdmissionQueue[_Item] = AdmissionQueue(1024, 1 << 20, clock=clock, cold_capacity=lambda: cap[0])
    for _ in range(21):
        queue.service.observe(WAVE_S, MAX_TOKENS, blocks=blocks_for(PROMPT + MAX_TOKENS, BLOCK))
    # The completions record the workers' pace, not the one step a report carries (a prefill here).
    cap[0], before = dataclasses.replace(cap[0], step_now_s=0.2), cap[0]
    assert queue.service.step_s() == 0.03
    cap[0] = before

    def burst(pace_s: float, tag: str) -> list[int]:
        cap[0] = dataclasses.replace(cap[0], decode_step_s=pace_s)  # NOTE: the step a report carries stays 30 ms
        refusals = [queue.admit(_Item(f"{tag}{i}", blocks_for(PROMPT, BLOCK)), deadline=clock() + 3.5 * WAVE_S,
                                max_tokens=MAX_TOKENS, blocks_ever=blocks_for(PROMPT + MAX_TOKENS, BLOCK))
                    for i in range(200)]  # fmt: skip
        assert all(r.reason is RejectReason.WAIT_EXCEEDS_DEADLINE for r in refusals if r is not None)
        admitted = [i for i, r in enumerate(refusals) if r is None]
        for i in admitted:
            queue.remove(f"{tag}{i}")  # each burst is judged on its own
        return admitted

    # At the calibration pace the queued waves end at 4 and 6 s: two waves fit the 7 s deadline.
    assert burst(0.03, "a") == list(range(42))
    # The steps take twice as long: every request now takes 4 s, the running ones end at 4 s, and a
    # queued one started then ends at 8 s, past its deadline. Judged by the completions as measured
    # (2 s) two queued waves were admitted, to run out their deadline; none is now.
    assert burst(0.06, "b") == []
    # Back at the calibration pace, admission takes the two waves again; a faster pace than the
    # completions' takes no more than they measured.
    assert burst(0.03, "c") == list(range(42))
    assert burst(0.015, "d") == list(range(42))


def test_the_pace_is_the_mean_step_over_a_busy_report_interval_not_the_step_a_report_carries() -> None:
    async def test() -> None:
        router, _ = _router()
        table = router.table
        assert table.cold_capacity().decode_step_s == 0.0  # nothing measured

        def report(seq: int, decode_steps: int, running: int = 5, step_ms: float = 10.0, ago_s: float = 0.0) -> None:
            table.entries["a"].report_time -= ago_s  # the previous report came ``ago_s`` earlier
            table.reported("a", pb.PressureReport(seq=seq, total_blocks=32, free_blocks=16, used_blocks=16,
                                                  num_running=running, decode_steps=decode_steps,
                                                  step_latency_ms=step_ms))  # fmt: skip

        report(1, 100)
        assert table.entries["a"].decode_step_s == 0.0  # one report is no interval
        report(2, 150, ago_s=0.5)  # 50 steps in 0.5 s
        assert table.entries["a"].decode_step_s == pytest.approx(0.01, rel=0.05)
        report(3, 150, running=0, ago_s=0.1)  # it went idle
        report(4, 160, ago_s=5.0)  # busy again: the interval was mostly idle, it says nothing of the pace
        assert table.entries["a"].decode_step_s == pytest.approx(0.01, rel=0.05)
        report(5, 180, step_ms=230.0, ago_s=0.4)  # 20 steps in 0.4 s, the last one a long prefill
        cap = table.cold_capacity()
        assert cap.decode_step_s == pytest.approx(0.02, rel=0.05)  # "b" has none: the mean of those measured
        assert cap.step_now_s == pytest.approx(0.23)  # the step the report carries ("b" reported none)
        assert table.pace() == cap.decode_step_s and router.queue.service.step_s() == cap.decode_step_s
        report(6, 170, ago_s=0.2)  # a restarted worker's counters go back: not a pace
        assert table.entries["a"].decode_step_s == pytest.approx(0.02, rel=0.05)

    _run(test)
