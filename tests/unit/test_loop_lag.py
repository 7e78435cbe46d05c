"""The router's loop-lag watcher sees a held loop (kvserve/router/observe/loop_lag.py)."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvserve.router.observe.loop_lag import run_queue_wait_reader, watch_loop_lag


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

    async def run(wait_during_hold: float) -> tuple[list[float], list[float]]:
        lags: list[float] = []
        held: list[float] = []
        waited = [0.0]
        watcher = asyncio.get_running_loop().create_task(
            watch_loop_lag(lags.append, interval_s=0.01, observe_held=held.append, run_queue_wait=lambda: waited[0])
        )
        await asyncio.sleep(0.05)
        time.sleep(0.3)  # noqa: ASYNC251 - the loop is late by ~0.3 s
        waited[0] += wait_during_hold  # as if the thread had spent that long runnable but not running
        await asyncio.sleep(0.05)
        watcher.cancel()
        return lags, held

    lags, held = asyncio.run(run(0.0))
    assert max(lags) >= 0.25 and max(held) >= 0.25  # the router held it
    lags, held = asyncio.run(run(0.3))
    assert max(lags) >= 0.25 and max(held) < 0.1  # the machine did: no held time


def test_the_run_queue_wait_reader_reads_this_thread() -> None:
    read = run_queue_wait_reader()
    if read is None:
        pytest.skip("no /proc/self/task/<tid>/schedstat here")
    first = read()
    assert 0.0 <= first <= read()
