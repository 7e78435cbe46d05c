"""The router's event-loop lag: how late a timer fires. Every stream, dispatch and report of the
router runs on one asyncio loop, so work that holds it (a huge body parsed inline, a tokenizer
call that should have been off-loop) stalls them all at once; the lag shows it directly. Exported as
``kvserve:router_event_loop_lag_seconds``.

On a busy machine a timer is also late because the loop's thread waited for a CPU (it was runnable,
the OS ran something else): that is the machine's load, not the router. The *held* time takes it out:
the lag less the loop thread's run-queue wait over the same interval (Linux ``schedstat``), and less
the time the hypervisor took the virtual CPUs away (``steal`` in ``/proc/stat``: a stolen vCPU runs
nothing of the guest, and the guest's run-queue wait does not see it), so it is what the router itself
held the loop for: computing, blocking in a call, or waiting for the GIL its other threads held.
Exported as ``kvserve:router_event_loop_held_seconds``; elsewhere it equals the lag.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable

INTERVAL_S = 0.05
# NOTE: with no request in the router nothing waits on the loop, so a lag has no one to delay: the probe
# then wakes once a second instead of 20 times (a wake-up, two /proc reads and two observations each were
# ~4 ms/s of an idle router's loop thread, Zen 3). The first wake-up after work arrives goes back to 20 Hz.
IDLE_INTERVAL_S = 1.0


def run_queue_wait_reader() -> Callable[[], float] | None:
    """A reader of the calling thread's total run-queue wait in seconds (``/proc/self/task/<tid>/schedstat``,
    second field), or None where the kernel does not provide it."""
    try:
        fd = os.open(f"/proc/self/task/{threading.get_native_id()}/schedstat", os.O_RDONLY)
    except OSError:
        return None

    def read() -> float:  # NOTE: one pread of a file kept open: opening it was most of the watcher's cost
        return int(os.pread(fd, 256, 0).split()[1]) / 1e9

    try:
        read()
    except (OSError, IndexError, ValueError):
        os.close(fd)
        return None
    return read


def steal_reader(path: str = "/proc/stat") -> Callable[[], list[float]] | None:
    """A reader of each CPU's total hypervisor steal in seconds (``/proc/stat``'s ``cpuN`` lines, 8th
    value, in ``USER_HZ`` ticks), or None where the kernel does not provide it."""
    tick = 1.0 / os.sysconf("SC_CLK_TCK")
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None

    def read() -> list[float]:  # NOTE: the cpu lines come first; a file kept open, read again from its start
        head = os.pread(fd, 1 << 16, 0)
        return [
            int(line.split()[8]) * tick for line in head.splitlines() if line.startswith(b"cpu") and line[3:4].isdigit()
        ]

    try:
        if not read():
            os.close(fd)
            return None
    except (OSError, IndexError, ValueError):
        os.close(fd)
        return None
    return read


def most_stolen(before: list[float], after: list[float]) -> float:
    """The largest steal any one CPU had between two readings. The loop's thread ran on one CPU (or a few:
    it may migrate), not known here; the largest is the most the machine can have taken from it."""
    return max((b - a for a, b in zip(before, after, strict=False)), default=0.0)


async def watch_loop_lag(
    observe: Callable[[float], None],
    interval_s: float = INTERVAL_S,
    observe_held: Callable[[float], None] | None = None,
    run_queue_wait: Callable[[], float] | None = None,
    steal: Callable[[], list[float]] | None = None,
    busy: Callable[[], bool] | None = None,
    idle_interval_s: float = IDLE_INTERVAL_S,
) -> None:
    """Sleep ``interval_s`` again and again and ``observe`` each oversleep, until cancelled; with
    ``observe_held``, also each oversleep less the loop thread's run-queue wait and the CPUs' steal over
    it (``run_queue_wait`` / ``steal``: the readers to use, default ``run_queue_wait_reader()`` for this
    thread and ``steal_reader()``). With ``busy``, an interval that begins while ``busy()`` is false sleeps
    ``idle_interval_s`` instead (its oversleep is measured the same way)."""
    loop = asyncio.get_running_loop()
    waited = run_queue_wait or run_queue_wait_reader()
    stolen = (steal or steal_reader()) if observe_held is not None else None
    if observe_held is None:
        waited = stolen = None
    # NOTE: one reading per interval, each interval's end the next one's start: the readers (two /proc files)
    # are most of an idle router loop's work at 20 Hz, and the microseconds between two intervals do not matter.
    waited_before = waited() if waited else 0.0
    stolen_before = stolen() if stolen else []
    while True:
        wait = interval_s if busy is None or busy() else idle_interval_s
        began = loop.time()
        await asyncio.sleep(wait)
        lag = max(loop.time() - began - wait, 0.0)
        observe(lag)
        if observe_held is not None:
            waited_now = waited() if waited else 0.0
            stolen_now = stolen() if stolen else []
            machine = (waited_now - waited_before) + (most_stolen(stolen_before, stolen_now) if stolen else 0.0)
            waited_before, stolen_before = waited_now, stolen_now
            observe_held(max(lag - machine, 0.0))
