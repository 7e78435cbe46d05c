"""Admission by the decode work ahead (kvserve/router/policy/admission.py ``work_start_s``): a burst of
long generations at a saturated cluster queues only what can start before its deadline; the rest is
refused at once with a retry hint no shorter than its projected start (issue 41's overload: requests
admitted that never got a token)."""

from __future__ import annotations

import pytest

from kvserve.router.policy.admission import AdmissionQueue, ColdCapacity, RejectReason, work_start_s
from kvserve.workers.core.sizes import blocks_for
from tests.unit.admission_doubles import Clock as _Clock
from tests.unit.admission_doubles import Item as _Item


def test_list_scheduling_of_the_work_ahead() -> None:
    assert work_start_s(2, [5.0], []) == 0.0  # a slot is free
    assert work_start_s(2, [10.0, 5.0], []) == 5.0  # the shorter running one frees first
    assert work_start_s(2, [5.0, 10.0], [4.0]) == 9.0  # the queued one takes the first slot to free
    assert work_start_s(1, [], [1.0, 2.0, 3.0]) == 6.0
    assert work_start_s(3, [9.0, 9.0, 9.0, 9.0], []) == 9.0  # more running than slots: one waits a turn
    with pytest.raises(ValueError):
        work_start_s(0, [], [])


PROMPT, MAX_TOKENS, BLOCK = 100, 900, 16
FULL = blocks_for(PROMPT + MAX_TOKENS, BLOCK)  # 63 blocks: one such request per worker at its longest


def _overloaded(step_s: float = 0.02, running: int = 2) -> tuple[_Clock, AdmissionQueue[_Item]]:
    """Two workers of 70 blocks each running one long request each (the issue's ~1 per worker)."""
    clock = _Clock()
    cap = ColdCapacity(step_s=step_s, pool_blocks=140, free_blocks=0, step_now_s=step_s,
                       running=running, running_tokens=(MAX_TOKENS,) * running)  # fmt: skip
    return clock, AdmissionQueue(1024, 1 << 20, clock=clock, cold_capacity=lambda: cap, max_wait_s=120.0)


def test_a_burst_of_long_generations_queues_only_what_can_start_by_its_deadline() -> None:
    clock, queue = _overloaded()
    # 900 tokens at 20 ms: 18 s each, two at a time. Queued k-th starts at 18 s x (1 + k // 2).
    refusals = [queue.admit(_Item(f"r{i}", blocks_for(PROMPT, BLOCK)), deadline=clock() + 60.0,
                            max_tokens=MAX_TOKENS, blocks_ever=FULL) for i in range(400)]  # fmt: skip
    admitted = [i for i, r in enumerate(refusals) if r is None]
    assert admitted == list(range(6))  # starts at 18, 18, 36, 36, 54, 54 s: all before 60 s
    late = refusals[6]
    assert late is not None and late.reason is RejectReason.WAIT_EXCEEDS_DEADLINE
    assert late.projected_wait_s == pytest.approx(72.0) and late.retry_after_ms >= 72_000
    assert all(r.retry_after_ms > 0 for r in refusals if r is not None)


def test_the_same_burst_with_short_outputs_is_queued() -> None:
    clock, queue = _overloaded()
    refusals = [queue.admit(_Item(f"r{i}", blocks_for(PROMPT, BLOCK)), deadline=clock() + 60.0,
                            max_tokens=16, blocks_ever=blocks_for(PROMPT + 16, BLOCK)) for i in range(100)]  # fmt: skip
    # 8 blocks each: 17 at once; 16 tokens are 0.32 s: all 100 start within a few seconds.
    assert refusals == [None] * 100


def test_measured_completions_cap_what_a_request_is_expected_to_take() -> None:
    """Clients ask for far more than they get: once completions are measured, a request is expected
    to take the typical completion's tokens (here 50, 1 s), not its max_tokens."""
    clock, queue = _overloaded()
    for _ in range(4):
        queue.service.observe(1.0, 50, blocks=FULL, stopped=True)  # 20 ms a token, 63 blocks held at the end
    refusals = [queue.admit(_Item(f"r{i}", blocks_for(PROMPT, BLOCK)), deadline=clock() + 60.0,
                            max_tokens=MAX_TOKENS, blocks_ever=FULL) for i in range(400)]  # fmt: skip
    admitted = sum(r is None for r in refusals)
    # Two slots, 1 s per request: the k-th starts at 1 + k // 2 s and must end (1 s later) by 60 s: k <= 117.
    assert admitted == 118


def test_completions_that_ran_to_their_max_tokens_do_not_cap_longer_ones() -> None:
    """Short probes (8 tokens, ended by length) say nothing of where a 900-token request stops."""
    clock, queue = _overloaded()
    for _ in range(8):
        queue.service.observe(0.16, 8, blocks=8)  # 20 ms a token
    refusals = [queue.admit(_Item(f"r{i}", blocks_for(PROMPT, BLOCK)), deadline=clock() + 60.0,
                            max_tokens=MAX_TOKENS, blocks_ever=FULL) for i in range(400)]  # fmt: skip
    assert sum(r is None for r in refusals) == 6  # as with nothing measured: 18 s each, two at a time


def test_without_a_measured_step_nothing_bounds_the_work() -> None:
    """A cluster that never ran a step has no time per token: the work estimate abstains (the cold
    rules of test_admission_cold.py apply alone)."""
    clock, queue = _overloaded(step_s=0.0)
    refusals = [queue.admit(_Item(f"r{i}", 7), deadline=clock() + 60.0, max_tokens=MAX_TOKENS, blocks_ever=FULL)
                for i in range(50)]  # fmt: skip
    assert refusals == [None] * 50
