"""The router's loop-lag watcher sees a held loop (kvserve/router/observe/loop_lag.py)."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from kvserve.router.observe.loop_lag import most_stolen, run_queue_wait_reader, steal_reader, watch_loop_lag


def test_a_callback_that_holds_the_loop_shows_as_lag() -> None:
    async def run() -> list[float]:
        lags: list[float] = []
        watcher = asyncio.get_running_loop().create_task(watch_loop_lag(lags.append, interval_s=0.01))
        await asyncio.sleep(0.05)  # a few quiet wake-ups
        time.sleep(0.3)  # noqa: ASYNC251 - the point: a blocking call on the loop
        await asyncio.sleep(0.05)
        watcher.cancel()
        return lags

    lags = asyncio.run(run())
    assert len(lags) >= 3
    assert max(lags) >= 0.25  # the held loop
    assert sorted(lags)[len(lags) // 2] < 0.1  # the rest woke about on time


def test_a_blocking_call_is_held_time_and_a_wait_for_the_cpu_is_not() -> None:
    """Held = lag less the loop thread's run-queue wait: a callback that holds the loop counts whole; the
    same lateness while the thread waited for a CPU (here a reader that says so) does not."""

    async def run(wait_during_hold: float, steal_during_hold: float = 0.0) -> tuple[list[float], list[float]]:
        lags: list[float] = []
        held: list[float] = []
        waited = [0.0]
        stolen = [0.0, 0.0]
        watcher = asyncio.get_running_loop().create_task(
            watch_loop_lag(
                lags.append,
                interval_s=0.01,
                observe_held=held.append,
                run_queue_wait=lambda: waited[0],
                steal=lambda: list(stolen),
            )  # fmt: skip
        )
        await asyncio.sleep(0.05)
        time.sleep(0.3)  # noqa: ASYNC251 - the loop is late by ~0.3 s
        waited[0] += wait_during_hold  # as if the thread had spent that long runnable but not running
        stolen[1] += steal_during_hold  # as if the hypervisor had run something else on the second vCPU
        await asyncio.sleep(0.05)
        watcher.cancel()
        return lags, held

    lags, held = asyncio.run(run(0.0))
    assert max(lags) >= 0.25 and max(held) >= 0.25  # the router held it
    lags, held = asyncio.run(run(0.3))
    assert max(lags) >= 0.25 and max(held) < 0.1  # the machine did: no held time
    lags, held = asyncio.run(run(0.0, steal_during_hold=0.3))
    assert max(lags) >= 0.25 and max(held) < 0.1  # the hypervisor did: no held time


def test_the_steal_reader_reads_each_cpu(tmp_path) -> None:  # noqa: ANN001
    stat = tmp_path / "stat"
    stat.write_text("cpu  10 0 0 0 0 0 0 700 0 0\ncpu0 5 0 0 0 0 0 0 300 0 0\ncpu1 5 0 0 0 0 0 0 400 0 0\nintr 1\n")
    read = steal_reader(str(stat))
    assert read is not None
    hz = os.sysconf("SC_CLK_TCK")
    assert read() == [300 / hz, 400 / hz]
    assert most_stolen([1.0, 2.0], [1.5, 2.1]) == pytest.approx(0.5)
    assert steal_reader(str(tmp_path / "missing")) is None


def test_the_run_queue_wait_reader_reads_this_thread() -> None:
    read = run_queue_wait_reader()
    if read is None:
        pytest.skip("no /proc/self/task/<tid>/schedstat here")
    first = read()
    assert 0.0 <= first <= read()


def test_with_no_work_the_probe_wakes_at_its_idle_interval_and_at_its_interval_again_once_work_arrives() -> None:
    async def run() -> tuple[int, int]:
        lags: list[float] = []
        work: list[str] = []
        watcher = asyncio.get_running_loop().create_task(
            watch_loop_lag(lags.append, interval_s=0.01, busy=lambda: bool(work), idle_interval_s=0.25)
        )
        await asyncio.sleep(0.6)
        idle_wakes = len(lags)
        work.append("a request")
        await asyncio.sleep(0.3)  # NOTE: the idle sleep in progress ends (<= 0.25 s), then 10 ms intervals
        busy_wakes = len(lags) - idle_wakes
        watcher.cancel()
        return idle_wakes, busy_wakes

    idle_wakes, busy_wakes = asyncio.run(run())
    assert idle_wakes <= 3, idle_wakes  # 0.6 s of 0.25 s sleeps (20 Hz would be ~60)
    assert busy_wakes >= 4, busy_wakes  # at least 50 ms of 10 ms intervals after the idle sleep ended
