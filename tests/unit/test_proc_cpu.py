"""The benchmarks' CPU reader: nanoseconds while every thread lives, /proc's ticks once one has exited."""

import os
import time

from kvserve.cluster.bench.proc_cpu import CpuReading, read_cpu


def _burn(cpu_s: float) -> None:
    end = time.thread_time() + cpu_s
    while time.thread_time() < end:
        pass


def test_a_few_milliseconds_of_cpu_are_seen() -> None:
    # NOTE: 3 ms is under one clock tick (10 ms): tick counting alone reads 0 most of the time
    for _ in range(5):
        before = read_cpu(os.getpid())
        _burn(0.003)
        spent = read_cpu(os.getpid()).seconds_since(before)
        assert 0.003 <= spent < 5.0


def test_an_exited_thread_falls_back_to_the_tick_count() -> None:
    before = CpuReading(ticks_s=1.0, threads_ns={1: 10**9, 2: 5 * 10**9})
    after = CpuReading(ticks_s=1.5, threads_ns={1: 10**9 + 10**8})  # thread 2 exited after running 0.4 s
    assert after.seconds_since(before) == 0.5
    grown = CpuReading(ticks_s=1.0, threads_ns={1: 10**9 + 3 * 10**6, 2: 5 * 10**9, 3: 10**6})  # a new one counts whole
    assert abs(grown.seconds_since(before) - 0.004) < 1e-12
