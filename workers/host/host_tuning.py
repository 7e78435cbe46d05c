"""Host (CPU) tuning of a worker process: glibc heap reuse, a thread governor, and the env switches.

None of this changes results; it changes how fast a CPU worker runs on a shared machine. The
environment switches (each on unless set to ``0``; documented in the README):

- ``KVSERVE_THREAD_GOVERNOR``: ``ThreadGovernor`` drops torch to one intra-op thread while another
  process competes for the cores.
- ``KVSERVE_ONEDNN``: CPU projections repacked for oneDNN (``workers/models/model.py``, ``Linear``).
- ``KVSERVE_GREEDY_SCREEN``: greedy rows pick their token from a bf16 screen of the LM head
  (``workers/models/model.py``, ``ScreenedArgmax``), falling back to fp32 logits where the screen is unsure.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import time
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)

ENV_SWITCHES = ("KVSERVE_THREAD_GOVERNOR", "KVSERVE_ONEDNN", "KVSERVE_GREEDY_SCREEN")


def env_switch(name: str) -> bool:
    """Whether the host-tuning switch ``name`` (one of ``ENV_SWITCHES``) is on: unset or anything but ``0``.

    Raises:
        ValueError: ``name`` is not a known switch (a typo would otherwise read as "on").
    """
    if name not in ENV_SWITCHES:
        raise ValueError(f"unknown host-tuning switch {name!r}; known: {ENV_SWITCHES}")
    return os.environ.get(name, "1") != "0"


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


class ThreadGovernor:
    """torch's intra-op thread count on a CPU shared with other processes: all of ``max_threads``
    while they run unhindered, one while another process competes for the cores.

    NOTE: every parallel torch op ends at an OpenMP barrier. When another process holds one of our
    cores, each op waits for the descheduled thread: measured on the tiny workload, a mean step of
    13 ms becomes 40 ms with one busy competitor, where a single thread takes 20 ms; at load average
    8-20 on 2 cores, 2 threads without the governor ran a 5 s pass in minutes (``RESULTS.md``). The
    signal is our threads' run-queue wait (runnable, not running) from ``/proc/self/task/*/schedstat``,
    checked over windows of steps. A single thread cannot see a competitor on another core, so a short
    synthetic probe (a few parallel GEMMs) asks again: ``PROBE_S`` after backing off, doubling after
    every probe that still finds the cores busy, up to ``MAX_PROBE_S`` (on a machine that stays busy,
    each probe, itself slowed by the barriers it measures, costs more than it can win back).

    Args:
        max_threads: the thread count to run with while the cores are free.
        read_wait: cumulative run-queue wait of this process in seconds, or None (``_runqueue_wait_s``).
        clock: monotonic seconds.
        set_threads: applies a thread count (``torch.set_num_threads``).
    """

    WINDOW_S = 0.1  # decide after this much wall time of steps
    CONTENDED = 0.1  # run-queue wait per thread per second of wall time above which we back off
    PROBE_S = 2.0  # first probe after backing off
    MAX_PROBE_S = 32.0  # probe interval cap while the cores stay busy

    def __init__(
        self,
        max_threads: int,
        read_wait: Callable[[], float | None] | None = None,
        clock: Callable[[], float] = time.perf_counter,
        set_threads: Callable[[int], None] = torch.set_num_threads,
    ) -> None:
        if max_threads < 2:
            raise ValueError(f"a governor needs at least 2 threads to choose from, got {max_threads}")
        self.max_threads = max_threads
        self.threads = max_threads
        self._read_wait = read_wait or _runqueue_wait_s
        self._clock = clock
        self._set_threads = set_threads
        self._window_start = clock()
        self._wait_start = self._read_wait() or 0.0
        self._next_probe = 0.0
        self.probe_interval = self.PROBE_S
        self._probe_input: torch.Tensor | None = None

    @classmethod
    def create(cls) -> ThreadGovernor | None:
        """A governor for this process, or None (one thread, no schedstat, or KVSERVE_THREAD_GOVERNOR=0)."""
        if torch.get_num_threads() < 2 or not env_switch("KVSERVE_THREAD_GOVERNOR"):
            return None
        return cls(torch.get_num_threads()) if _runqueue_wait_s() is not None else None

    def step_done(self) -> None:
        """Call after each step: backs off at the end of a contended window, probes when due."""
        now = self._clock()
        if self.threads == 1:
            if now >= self._next_probe:
                self._probe()
            return
        elapsed = now - self._window_start
        if elapsed < self.WINDOW_S:
            return
        wait = self._read_wait() or 0.0
        if self._contended(wait - self._wait_start, elapsed):
            self._back_off(now)
        else:
            self.probe_interval = self.PROBE_S
        self._window_start, self._wait_start = self._clock(), wait

    def _contended(self, wait_s: float, wall_s: float) -> bool:
        return wait_s > self.CONTENDED * wall_s * self.threads

    def _back_off(self, now: float) -> None:
        self._set(1)
        self._next_probe = now + self.probe_interval

    def _probe(self) -> None:
        self._set(self.max_threads)
        t0, w0 = self._clock(), self._read_wait() or 0.0
        self.probe_work()
        now, wait = self._clock(), self._read_wait() or 0.0
        if self._contended(wait - w0, now - t0):
            self.probe_interval = min(2 * self.probe_interval, self.MAX_PROBE_S)
            self._back_off(now)
        self._window_start, self._wait_start = now, wait

    def probe_work(self) -> None:
        """A few ms of parallel GEMMs at ``max_threads`` (overridable: tests give their own)."""
        if self._probe_input is None:
            self._probe_input = torch.randn(384, 384)
        for _ in range(16):
            torch.mm(self._probe_input, self._probe_input)

    def _set(self, threads: int) -> None:
        if threads != self.threads:
            logger.debug("intra-op threads %d -> %d", self.threads, threads)
            self._set_threads(threads)
            self.threads = threads


def _runqueue_wait_s() -> float | None:
    """Seconds this process's threads have spent runnable but not running (Linux schedstat), or None."""
    total = 0
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                total += int(f.read().split()[1])
        except (OSError, IndexError, ValueError):
            continue  # a thread that just exited
    return total / 1e9
