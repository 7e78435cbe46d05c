"""The router's event-loop lag: how late a timer fires. Every stream, dispatch and report of the
router runs on one asyncio loop, so work that holds it (a huge body parsed inline, a tokenizer
call that should have been off-loop) stalls them all at once; the lag shows it directly, apart
from what the machine's CPU load does to token latencies. Exported as
``kvserve:router_event_loop_lag_seconds``."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

INTERVAL_S = 0.05


async def watch_loop_lag(observe: Callable[[float], None], interval_s: float = INTERVAL_S) -> None:
    """Sleep ``interval_s`` again and again and ``observe`` each oversleep, until cancelled."""
    loop = asyncio.get_running_loop()
    while True:
        began = loop.time()
        await asyncio.sleep(interval_s)
        observe(max(loop.time() - began - interval_s, 0.0))
