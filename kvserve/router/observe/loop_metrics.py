"""Metrics written once per streamed token, by the router's event loop alone: no lock per write.

prometheus_client's ``Histogram.observe`` and ``Counter.inc`` take a lock and check their state on
every call (~0.6 and ~0.3 µs here); per streamed token that was a fifth of the router's own
Python cost (kvserve/cluster/bench/RESULTS.md, data plane). These families are written by one thread (the
router's loop) and read by the ``/metrics`` thread, which copies the counts in one C-level list
copy (atomic under the GIL), so a scrape sees each bucket as of one moment; the sum and the count
may be one observation apart, as between two of prometheus_client's own locked writes.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator, Sequence

from prometheus_client import REGISTRY
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry


class LoopHistogram(Collector):
    """A label-free histogram with prometheus_client's exposition (``le`` buckets, ``_sum``, ``_count``)."""

    def __init__(self, name: str, documentation: str, buckets: Sequence[float],
                 registry: CollectorRegistry | None = REGISTRY) -> None:  # fmt: skip
        bounds = tuple(float(b) for b in buckets)
        if list(bounds) != sorted(set(bounds)):
            raise ValueError(f"{name}: buckets must increase strictly, got {buckets}")
        self.name, self.documentation = name, documentation
        self._bounds = bounds  # NOTE: +Inf is the last slot of _counts, past every bound
        self._counts = [0] * (len(bounds) + 1)
        self._sum = 0.0
        if registry is not None:
            registry.register(self)

    def observe(self, value: float) -> None:
        # NOTE: bisect_left puts a value equal to a bound in that bound's bucket (Prometheus's le)
        self._counts[bisect_left(self._bounds, value)] += 1
        self._sum += value

    def describe(self) -> Iterator[HistogramMetricFamily]:
        yield HistogramMetricFamily(self.name, self.documentation)

    def collect(self) -> Iterator[HistogramMetricFamily]:
        counts, total = list(self._counts), self._sum
        cumulative, running = [], 0
        for bound, n in zip((*self._bounds, float("inf")), counts, strict=True):
            running += n
            cumulative.append((_le(bound), running))
        yield HistogramMetricFamily(self.name, self.documentation, buckets=cumulative, sum_value=total)


class LoopCounter(Collector):
    """A label-free counter (exposed as ``<name>_total``, as prometheus_client's ``Counter``)."""

    def __init__(self, name: str, documentation: str, registry: CollectorRegistry | None = REGISTRY) -> None:
        self.name, self.documentation = name, documentation
        self._value = 0.0
        if registry is not None:
            registry.register(self)

    def inc(self, amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError(f"{self.name}: counters only go up, got {amount}")
        self._value += amount

    def describe(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily(self.name, self.documentation)

    def collect(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily(self.name, self.documentation, value=self._value)


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(bound)
