"""Host (CPU) tuning of a worker process: glibc heap reuse, a thread governor, and the env switches.

None of this changes results; it changes how fast a CPU worker runs on a shared machine. The
environment switches (each on unless set to ``0``; documented in the README):

- ``KVSERVE_THREAD_GOVERNOR``: ``ThreadGovernor`` drops torch to one intra-op thread while another
  process competes for the cores.
- ``KVSERVE_ONEDNN``: CPU projections repacked for oneDNN (``workers/model.py``, ``Linear``).
- ``KVSERVE_GREEDY_SCREEN``: greedy rows pick their token from a bf16 screen of the LM head
  (``workers/model.py``, ``ScreenedArgmax``), falling back to fp32 logits where the screen is unsure.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import time

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
    13 ms becomes 40 ms with one busy competitor, where a single thread takes 20 ms. The signal is our
    threads' run-queue wait (runnable, not running) from ``/proc/self/task/*/schedstat``, checked
    over windows of steps. A single thread cannot see a competitor on another core, so every
    ``PROBE_S`` seconds a short synthetic probe (a few ms of parallel GEMMs) asks again.
    """

    WINDOW_S = 0.1  # decide after this much wall time of steps
    CONTENDED = 0.1  # run-queue wait per thread per second of wall time above which we back off
    PROBE_S = 2.0

    def __init__(self, max_threads: int) -> None:
        self.max_threads = max_threads
        self.threads = max_threads
        self._window_start = time.perf_counter()
        self._wait_start = _runqueue_wait_s() or 0.0
        self._next_probe = 0.0
        self._probe_input = torch.randn(384, 384)

    @classmethod
    def create(cls) -> ThreadGovernor | None:
        """A governor for this process, or None (one thread, no schedstat, or KVSERVE_THREAD_GOVERNOR=0)."""
        if torch.get_num_threads() < 2 or not env_switch("KVSERVE_THREAD_GOVERNOR"):
            return None
        return cls(torch.get_num_threads()) if _runqueue_wait_s() is not None else None

    def step_done(self) -> None:
        """Call after each step: backs off at the end of a contended window, probes when due."""
        now = time.perf_counter()
        if self.threads == 1:
            if now >= self._next_probe:
                self._probe()
            return
        elapsed = now - self._window_start
        if elapsed < self.WINDOW_S:
            return
        wait = _runqueue_wait_s() or 0.0
        if self._contended(wait - self._wait_start, elapsed):
            self._set(1)
            self._next_probe = now + self.PROBE_S
        self._window_start, self._wait_start = time.perf_counter(), wait

    def _contended(self, wait_s: float, wall_s: float) -> bool:
        return wait_s > self.CONTENDED * wall_s * self.threads

    def _probe(self) -> None:
        self._set(self.max_threads)
        t0, w0 = time.perf_counter(), _runqueue_wait_s() or 0.0
        for _ in range(16):
            torch.mm(self._probe_input, self._probe_input)
        now, wait = time.perf_counter(), _runqueue_wait_s() or 0.0
        if self._contended(wait - w0, now - t0):
            self._set(1)
            self._next_probe = now + self.PROBE_S
        self._window_start, self._wait_start = now, wait

    def _set(self, threads: int) -> None:
        if threads != self.threads:
            logger.debug("intra-op threads %d -> %d", self.threads, threads)
            torch.set_num_threads(threads)
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
