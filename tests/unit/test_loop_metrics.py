"""The router's lock-free per-token metrics expose exactly what prometheus_client's own would."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from kvserve.router.observe.loop_metrics import LoopCounter, LoopHistogram

BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 1.0, 2.5)
VALUES = (0.0, 0.004, 0.005, 0.0051, 0.01, 0.3, 1.0, 2.5, 2.6, 400.0)  # bounds, between, past the last


def _exposition(registry: CollectorRegistry) -> list[str]:
    # NOTE: prometheus_client adds a *_created sample per family; ours has none (Prometheus does not need it)
    return [line for line in generate_latest(registry).decode().splitlines() if "_created" not in line]


def test_histogram_buckets_sum_and_count_match_prometheus_client() -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    h = LoopHistogram("t:latency_seconds", "latency", BUCKETS, registry=ours)
    ref = Histogram("t:latency_seconds", "latency", buckets=BUCKETS, registry=theirs)
    for v in VALUES:
        h.observe(v)
        ref.observe(v)
    assert _exposition(ours) == _exposition(theirs)
    assert ours.get_sample_value("t:latency_seconds_bucket", {"le": "0.005"}) == 3  # 0.005 itself is in le=0.005
    assert ours.get_sample_value("t:latency_seconds_count") == len(VALUES)


def test_counter_matches_prometheus_client_and_refuses_to_go_down() -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    c = LoopCounter("t:tokens", "tokens", registry=ours)
    ref = Counter("t:tokens", "tokens", registry=theirs)
    for n in (1, 7, 0, 3):
        c.inc(n)
        ref.inc(n)
    assert _exposition(ours) == _exposition(theirs)
    with pytest.raises(ValueError, match="only go up"):
        c.inc(-1)


def test_buckets_must_increase() -> None:
    with pytest.raises(ValueError, match="increase strictly"):
        LoopHistogram("t:bad", "bad", (0.1, 0.05), registry=None)
