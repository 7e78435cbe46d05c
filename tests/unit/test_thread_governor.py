"""ThreadGovernor policy on a scripted clock and run-queue signal (no timing, no real threads)."""

from __future__ import annotations

import pytest

from workers.host.host_tuning import ThreadGovernor


class FakeHost:
    """A clock, a cumulative run-queue wait and the thread count the governor set."""

    def __init__(self) -> None:
        self.now = 0.0
        self.wait = 0.0
        self.threads = 2
        self.busy = False  # whether time passing also accrues run-queue wait (a competitor holds a core)

    def advance(self, seconds: float) -> None:
        self.now += seconds
        if self.busy:
            self.wait += seconds * self.threads  # every thread waits all the time: clearly contended

    def set_threads(self, n: int) -> None:
        self.threads = n


def make(host: FakeHost) -> ThreadGovernor:
    gov = ThreadGovernor(2, read_wait=lambda: host.wait, clock=lambda: host.now, set_threads=host.set_threads)
    gov.probe_work = lambda: host.advance(0.005)  # type: ignore[method-assign]
    return gov


def run_steps(host: FakeHost, gov: ThreadGovernor, seconds: float, step_s: float = 0.01) -> None:
    for _ in range(round(seconds / step_s)):
        host.advance(step_s)
        gov.step_done()


def test_keeps_all_threads_on_idle_cores() -> None:
    host = FakeHost()
    gov = make(host)
    run_steps(host, gov, 5.0)
    assert host.threads == 2


def test_backs_off_under_contention_and_returns_when_it_ends() -> None:
    host = FakeHost()
    gov = make(host)
    host.busy = True
    run_steps(host, gov, 0.2)
    assert host.threads == 1
    host.busy = False
    run_steps(host, gov, ThreadGovernor.PROBE_S + 0.1)
    assert host.threads == 2


def test_probes_back_off_exponentially_while_the_machine_stays_busy() -> None:
    host = FakeHost()
    gov = make(host)
    probes: list[float] = []
    inner = gov.probe_work

    def counted() -> None:
        probes.append(host.now)
        inner()

    gov.probe_work = counted  # type: ignore[method-assign]
    host.busy = True
    run_steps(host, gov, 120.0)
    gaps = [b - a for a, b in zip(probes, probes[1:], strict=False)]
    assert host.threads == 1
    # 2, 4, 8, 16, 32, 32, ... seconds apart (each +/- one step)
    assert gaps[:4] == pytest.approx([4.0, 8.0, 16.0, 32.0], abs=0.05)
    assert max(gaps) == pytest.approx(ThreadGovernor.MAX_PROBE_S, abs=0.05)
    # once the cores are free again, the probe finds it and the interval starts over
    host.busy = False
    run_steps(host, gov, ThreadGovernor.MAX_PROBE_S + 1)
    assert host.threads == 2
    assert gov.probe_interval == ThreadGovernor.PROBE_S


def test_rejects_a_single_thread() -> None:
    with pytest.raises(ValueError):
        ThreadGovernor(1)
