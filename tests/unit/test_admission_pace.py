"""Service times at the machine's current speed (kvserve/router/policy/service_times.py): completions
measured while engine steps were fast under-estimate what a request takes once the machine slows
down (issue 41: on a shared 2-core CI runner another process took the CPU between the calibration
wave and the burst of tests/chaos/test_failover.py's 10x overload; admission judged by the fast
completions admitted 53 calls of which 12 ran out their deadline). Each completion is scaled by the
step time now over the step time when it completed."""

from __future__ import annotations

import dataclasses

import pytest

from kvserve.router.policy.admission import AdmissionQueue, ColdCapacity, RejectReason
from kvserve.router.policy.service_times import ServiceTimes
from kvserve.workers.core.sizes import blocks_for
from tests.unit.admission_doubles import Clock as _Clock
from tests.unit.admission_doubles import Item as _Item


def test_completions_are_scaled_to_the_current_step_time() -> None:
    clock, step = _Clock(), [0.03]
    service = ServiceTimes(clock=clock, step_now=lambda: step[0])
    for _ in range(4):
        service.observe(2.0, 64)  # 64 tokens in 2 s while a step took 30 ms
    assert service.typical_s() == 2.0 and service.expected_s(64) == 2.0
    step[0] = 0.06  # the machine slows down: every step takes twice as long
    assert service.typical_s() == pytest.approx(4.0) and service.per_token_s() == pytest.approx(4.0 / 64)
    assert service.expected_s(64) == pytest.approx(4.0) and service.expected_s(16) == pytest.approx(1.0)
    # Completions measured at the slow speed count the same steps: the medians do not mix speeds.
    for _ in range(4):
        service.observe(4.0, 64)
    assert service.typical_s() == pytest.approx(4.0)
    step[0] = 0.015  # faster than ever: every completion is expected to take half its calibration time
    assert service.typical_s() == pytest.approx(1.0) and service.expected_s(64) == pytest.approx(1.0)
    assert service.typical_s(step_s=0.03) == pytest.approx(2.0)  # a caller's snapshot of the step wins
    step[0] = 0.0  # no step reported (no serving worker): the completions as measured
    assert service.typical_s() == pytest.approx(3.0)


def test_without_a_step_time_completions_count_as_measured() -> None:
    clock = _Clock()
    service = ServiceTimes(clock=clock)
    for _ in range(4):
        service.observe(2.0, 64)
    assert service.typical_s() == 2.0 and service.expected_s(64) == 2.0 and service.per_token_s() == 2.0 / 64


PROMPT, MAX_TOKENS, BLOCK, WAVE_S = 32, 64, 16, 2.0


def test_admission_follows_the_step_time_when_the_machine_slows_down_and_speeds_up() -> None:
    """tests/chaos/test_failover.py's overload, on a fake clock: pools of 128 blocks run 21 requests
    of 32 + 64 tokens (6 blocks) at once; a calibration wave took 2 s at 30 ms a step, and the
    deadline is 3.5 waves (7 s). The 21 of the wave before the burst are running."""
    clock = _Clock()
    cap = [ColdCapacity(step_s=0.03, pool_blocks=128, free_blocks=0, running=21, step_now_s=0.03,
                        running_tokens=(MAX_TOKENS,) * 21)]  # fmt: skip
    queue: AdmissionQueue[_Item] = AdmissionQueue(1024, 1 << 20, clock=clock, cold_capacity=lambda: cap[0])
    for _ in range(21):
        queue.service.observe(WAVE_S, MAX_TOKENS, blocks=blocks_for(PROMPT + MAX_TOKENS, BLOCK))

    def burst(step_s: float, tag: str) -> list[int]:
        cap[0] = dataclasses.replace(cap[0], step_now_s=step_s)
        refusals = [queue.admit(_Item(f"{tag}{i}", blocks_for(PROMPT, BLOCK)), deadline=clock() + 3.5 * WAVE_S,
                                max_tokens=MAX_TOKENS, blocks_ever=blocks_for(PROMPT + MAX_TOKENS, BLOCK))
                    for i in range(200)]  # fmt: skip
        assert all(r.reason is RejectReason.WAIT_EXCEEDS_DEADLINE for r in refusals if r is not None)
        admitted = [i for i, r in enumerate(refusals) if r is None]
        for i in admitted:
            queue.remove(f"{tag}{i}")  # each burst is judged on its own
        return admitted

    # At the calibration speed the queued waves end at 4 and 6 s: two waves fit the 7 s deadline.
    assert burst(0.03, "a") == list(range(42))
    # The steps take twice as long: every request now takes 4 s, the running ones end at 4 s, and a
    # queued one started then ends at 8 s, past its deadline. Judged by the fast completions (2 s)
    # all of the first queued wave was admitted, to run out its deadline; none is now.
    assert burst(0.06, "b") == []
    # Back at the calibration speed, admission takes the two waves again; faster still, more.
    assert burst(0.03, "c") == list(range(42))
    assert burst(0.015, "d") == list(range(126))  # 1 s a wave: six queued waves end by 7 s
