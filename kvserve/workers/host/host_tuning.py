"""Host (CPU) tuning of a worker process: glibc heap reuse, a thread governor, and the env switches.

None of this changes results; it changes how fast a CPU worker runs on a shared machine. The
environment switches (``kvserve/workers/core/env_switches.py``; each on unless set to ``0``):

- ``KVSERVE_THREAD_GOVERNOR``: ``ThreadGovernor`` drops torch to one intra-op thread while another
  process competes for the cores.
- ``KVSERVE_ONEDNN``: CPU projections repacked for oneDNN (``kvserve/workers/models/model.py``, ``Linear``).
- ``KVSERVE_GREEDY_SCREEN``: greedy rows pick their token from a bf16 screen of the LM head
  (``kvserve/workers/models/model.py``, ``ScreenedArgmax``), falling back to fp32 logits where the screen is unsure.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import time
from collections.abc import Callable

import torch

from kvserve.workers.core.env_switches import env_switch

logger = logging.getLogger(__name__)


def keep_freed_heap_memory() -> bool:
    """Ask glibc malloc to keep freed big buffers for reuse instead of returning them to the OS.

    NOTE: a CPU forward allocates the same multi-MB activations every step (logits alone are
    ``num_seqs x vocab`` floats). By default glibc serves each from a fresh ``mmap`` and unmaps it on
    free, so every step page-faults its whole working set in again (measured: a quarter of the CPU
    time went to the kernel). Raising the mmap and trim thresholds lets the heap recycle them. Process
    wide, harmless for other code; returns False where there is no glibc.
    """
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        m_trim_threshold, m_mmap_threshold = -1, -3
        return bool(libc.mallopt(m_mmap_threshold, 1 << 30) and libc.mallopt(m_trim_threshold, 1 << 31 - 1))
    except (OSError, AttributeError, TypeError):
        return False


ThreadTimes = dict[str, tuple[float, float]]  # thread id -> cumulative (CPU seconds, run-queue wait seconds)


class ThreadGovernor:
    """torch's intra-op thread count on a CPU shared with other processes: all of ``max_threads``
    while they run unhindered, one while another process competes for the cores.

    NOTE: every parallel torch op ends at an OpenMP barrier. When another process holds one of our
    cores, each op waits for the descheduled thread: measured on the tiny workload, a mean step of
    13 ms becomes 40 ms with one busy competitor, where a single thread takes 20 ms; at load average
    8-20 on 2 cores, 2 threads without the governor ran a 5 s pass in minutes (``RESULTS.md``).

    The signal is the run-queue wait (``/proc/self/task/*/schedstat``) of the compute threads
    alone, i.e. those runnable (running or waiting to run) at least ``COMPUTE_SHARE`` of a window,
    over windows of ``WINDOW_S``. Runnable, not running: at load 15 our compute threads run a tenth
    of the time and wait the rest. Not every thread's wait, and not over short windows: a served
    worker shares its cores with its own Ray and gRPC threads, the router and the HTTP server,
    which wake in bursts; counted over all threads and per 100 ms, those bursts read as contention
    and kept a two-thread worker at one thread for most of a served run (measured, ``RESULTS.md``),
    although two threads served more. A single thread cannot see a competitor on another core, so
    after backing off the governor tries ``max_threads`` again for one window: ``PROBE_S`` later,
    doubling after every try that still finds the cores busy, up to ``MAX_PROBE_S`` (on a machine
    that stays busy, each try costs a window of slow steps).

    Args:
        max_threads: the thread count to run with while the cores are free.
        read_threads: this process's cumulative per-thread times, or None (``_thread_times``).
        clock: monotonic seconds.
        set_threads: applies a thread count (``torch.set_num_threads``).
    """

    WINDOW_S = 1.0  # decide after this much wall time of steps
    COMPUTE_SHARE = 0.25  # a thread runnable this share of a window computes (helpers sleep)
    CONTENDED = 0.15  # mean run-queue wait per compute thread per second of wall above which we back off
    PROBE_S = 2.0  # first try of all threads after backing off
    MAX_PROBE_S = 32.0  # interval cap of those tries while the cores stay busy

    def __init__(
        self,
        max_threads: int,
        read_threads: Callable[[], ThreadTimes | None] | None = None,
        clock: Callable[[], float] = time.perf_counter,
        set_threads: Callable[[int], None] = torch.set_num_threads,
    ) -> None:
        if max_threads < 2:
            raise ValueError(f"a governor needs at least 2 threads to choose from, got {max_threads}")
        self.max_threads = max_threads
        self.threads = max_threads
        self._read_threads = read_threads or _thread_times
        self._clock = clock
        self._set_threads = set_threads
        self._start_window(clock(), self._read_threads() or {})
        self._trying = False  # this window runs all threads again after a back-off
        self._next_probe = 0.0
        self.probe_interval = self.PROBE_S

    @classmethod
    def create(cls) -> ThreadGovernor | None:
        """A governor for this process, or None (one thread, no schedstat, or KVSERVE_THREAD_GOVERNOR=0)."""
        if torch.get_num_threads() < 2 or not env_switch("KVSERVE_THREAD_GOVERNOR"):
            return None
        return cls(torch.get_num_threads()) if _thread_times() is not None else None

    def step_done(self) -> None:
        """Call after each step: decides at the end of each window; tries all threads again when due."""
        now = self._clock()
        if self.threads == 1:
            if now >= self._next_probe:
                self._set(self.max_threads)
                self._trying = True
                self._start_window(now, self._read_threads() or {})
            return
        elapsed = now - self._window_start
        if elapsed < self.WINDOW_S:
            return
        times = self._read_threads() or {}
        if self._contended(self._window_times, times, elapsed):
            if self._trying:
                self.probe_interval = min(2 * self.probe_interval, self.MAX_PROBE_S)
            self._set(1)
            self._next_probe = now + self.probe_interval
        else:
            self.probe_interval = self.PROBE_S
        self._trying = False
        self._start_window(now, times)

    def _start_window(self, now: float, times: ThreadTimes) -> None:
        self._window_start, self._window_times = now, times

    def _contended(self, before: ThreadTimes, after: ThreadTimes, wall_s: float) -> bool:
        waits = []
        for tid, (cpu, wait) in after.items():
            cpu0, wait0 = before.get(tid, (0.0, 0.0))
            if (cpu - cpu0) + (wait - wait0) >= self.COMPUTE_SHARE * wall_s:
                waits.append(wait - wait0)
        return bool(waits) and sum(waits) / len(waits) > self.CONTENDED * wall_s

    def _set(self, threads: int) -> None:
        if threads != self.threads:
            logger.debug("intra-op threads %d -> %d", self.threads, threads)
            self._set_threads(threads)
            self.threads = threads


def _thread_times() -> ThreadTimes | None:
    """Cumulative CPU and run-queue wait seconds of each of this process's threads (Linux schedstat), or None."""
    times: ThreadTimes = {}
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                cpu, wait = f.read().split()[:2]
            times[tid] = (int(cpu) / 1e9, int(wait) / 1e9)
        except (OSError, ValueError):
            continue  # a thread that just exited
    return times
