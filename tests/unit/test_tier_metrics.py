"""The router turns a worker's tier totals into Prometheus counters by delta, and its tier gauges as reported."""

from __future__ import annotations

from prometheus_client import REGISTRY

from kvserve.protos.kvserve.v1 import worker_pb2 as pb
from kvserve.router.observe.metrics import RouterMetrics
from kvserve.router.table.workers import _TOTALS


def _sample(name: str, **labels: str) -> float:
    value = REGISTRY.get_sample_value(name, labels)
    return 0.0 if value is None else value


def test_tier_counters_follow_deltas_and_gauges_follow_the_report() -> None:
    w = "tier-metrics-w"
    metrics = RouterMetrics()
    first = pb.PressureReport(worker_id=w, total_blocks=10, host_cache_bytes_capacity=1000, host_cache_bytes_used=300,
                              host_load_ratio=0.05, recompute_ms_per_block=37.0,
                              prefix_cache_host_hit_tokens_total=64, tier_bytes_loaded_total=4096)  # fmt: skip
    second = pb.PressureReport()
    second.CopyFrom(first)
    second.prefix_cache_host_hit_tokens_total, second.tier_bytes_loaded_total = 96, 6144
    before = _sample("kvserve:prefix_cache_tier_hits_total", worker=w, tier="host")
    prev = dict.fromkeys(_TOTALS, 0)
    for report in (first, second):
        now = {name: getattr(report, name) for name in _TOTALS}
        metrics.observe_pressure(report, {name: now[name] - prev[name] for name in _TOTALS})
        prev = now
    assert _sample("kvserve:prefix_cache_tier_hits_total", worker=w, tier="host") - before == 96
    assert _sample("kvserve:tier_bytes_total", worker=w, direction="loaded") == 6144
    assert _sample("kvserve:tier_cache_bytes_used", worker=w, tier="host") == 300
    assert _sample("kvserve:tier_load_recompute_ratio", worker=w, tier="host") == 0.05
    assert _sample("kvserve:recompute_ms_per_block", worker=w) == 37.0


def test_a_worker_without_tiers_exports_no_tier_series() -> None:
    report = pb.PressureReport(worker_id="no-tiers-w", total_blocks=10)
    RouterMetrics().observe_pressure(report, dict.fromkeys(_TOTALS, 0))
    assert REGISTRY.get_sample_value("kvserve:recompute_ms_per_block", {"worker": "no-tiers-w"}) is None
