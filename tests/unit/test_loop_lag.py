"""The router's loop-lag watcher sees a held loop (router/loop_lag.py)."""

from __future__ import annotations

import asyncio
import time

from router.loop_lag import watch_loop_lag


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
