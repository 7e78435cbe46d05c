"""CPU time of another process, fine enough for short benchmark runs.

``/proc/<pid>/stat`` counts user + system time in whole clock ticks (10 ms), each truncated: a router that
spends 6 ms over a short run reads 0, 10 or 20 ms. ``/proc/<pid>/task/<tid>/schedstat`` counts each live
thread's run time in nanoseconds but forgets threads that exited. So the CPU time between two readings is the
threads' nanoseconds when every thread of the first reading is still there (a thread both born and gone
in between is missed), and the ticks' difference otherwise.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class CpuReading:
    """One look at a process: its tick-counted CPU seconds and each live thread's run time in ns."""

    ticks_s: float
    threads_ns: dict[int, int]

    def seconds_since(self, earlier: CpuReading) -> float:
        """CPU seconds the process spent between ``earlier`` and this reading (see the module doc)."""
        if self.threads_ns and earlier.threads_ns.keys() <= self.threads_ns.keys():
            return sum(ns - earlier.threads_ns.get(tid, 0) for tid, ns in self.threads_ns.items()) / 1e9
        return max(self.ticks_s - earlier.ticks_s, 0.0)


def read_cpu(pid: int) -> CpuReading:
    """The CPU reading of process ``pid`` now (Linux; off Linux, psutil's tick count and no threads)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        import psutil

        t = psutil.Process(pid).cpu_times()
        return CpuReading(t.user + t.system, {})
    ticks_s = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    threads: dict[int, int] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        tids = []
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                threads[int(tid)] = int(f.read().split()[0])
        except (OSError, IndexError, ValueError):
            continue  # a thread that just exited, or no schedstat in this kernel
    return CpuReading(ticks_s, threads)
