"""The router's event-loop lag: how late a timer fires. Every stream, dispatch and report of the
router runs on one asyncio loop, so work that holds it (a huge body parsed inline, a tokenizer
call that should have been off-loop) stalls them all at once; the lag shows it directly. Exported as
``kvserve:router_event_loop_lag_seconds``.

On a busy machine a timer is also late because the loop's thread waited for a CPU (it was runnable,
the OS ran something else): that is the machine's load, not the router. The *held* time takes it out:
the lag less the loop thread's run-queue wait over the same interval (Linux ``schedstat``), so it is
what the router itself held the loop for: computing, blocking in a call, or waiting for the GIL its
other threads held. Exported as ``kvserve:router_event_loop_held_seconds``; elsewhere it equals the lag.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

INTERVAL_S = 0.05


def run_queue_wait_reader() -> Callable[[], float] | None:
    """A reader of the calling thread's total run-queue wait in seconds (``/proc/self/task/<tid>/schedstat``,
    second field), or None where the kernel does not provide it."""
    path = f"/proc/self/task/{threading.get_native_id()}/schedstat"

    def read() -> float:
        with open(path) as f:
            return int(f.read().split()[1]) / 1e9

    try:
        read()
    except (OSError, IndexError, ValueError):
        return None
    return read


async def watch_loop_lag(
    observe: Callable[[float], None],
    interval_s: float = INTERVAL_S,
    observe_held: Callable[[float], None] | None = None,
    run_queue_wait: Callable[[], float] | None = None,
) -> None:
    """Sleep ``interval_s`` again and again and ``observe`` each oversleep, until cancelled; with
    ``observe_held``, also each oversleep less the loop thread's run-queue wait over it
    (``run_queue_wait``: the reader to use, default this thread's ``run_queue_wait_reader()``)."""
    loop = asyncio.get_running_loop()
    waited = run_queue_wait or run_queue_wait_reader()
    while True:
        began, waited_before = loop.time(), waited() if waited else 0.0
        await asyncio.sleep(interval_s)
        lag = max(loop.time() - began - interval_s, 0.0)
        observe(lag)
        if observe_held is not None:
            observe_held(max(lag - (waited() - waited_before), 0.0) if waited else lag)
