"""The router turns a worker's tier totals into Prometheus counters by delta, and its tier gauges as reported."""

from __future__ import annotations

from prometheus_client import REGISTRY

from kvserve.protos.kvserve.v1 import worker_pb2 as pb
from kvserve.router.observe.metrics import RouterMetrics
from kvserve.router.table.workers import _TOTALS, WorkerState
from kvserve.workers.core.identity import WorkerIdentity


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
        metrics.observe_pressure(report, {name: now[name] - prev[name] for name in _TOTALS}, node="")
        prev = now
    assert _sample("kvserve:prefix_cache_tier_hits_total", worker=w, tier="host") - before == 96
    assert _sample("kvserve:tier_bytes_total", worker=w, direction="loaded") == 6144
    assert _sample("kvserve:tier_cache_bytes_used", node="", tier="host") == 300
    assert _sample("kvserve:tier_load_recompute_ratio", worker=w, tier="host") == 0.05
    assert _sample("kvserve:recompute_ms_per_block", worker=w) == 37.0


def test_a_worker_without_tiers_exports_no_tier_series() -> None:
    report = pb.PressureReport(worker_id="no-tiers-w", total_blocks=10)
    RouterMetrics().observe_pressure(report, dict.fromkeys(_TOTALS, 0))
    assert REGISTRY.get_sample_value("kvserve:recompute_ms_per_block", {"worker": "no-tiers-w"}) is None


def _node_series(name: str, node: str) -> list[dict[str, str]]:
    """The label sets of ``name``'s samples that mention ``node``."""
    return [dict(sm.labels) for fam in REGISTRY.collect() for sm in fam.samples
            if sm.name == name and node in sm.labels.values()]  # fmt: skip


def test_node_tier_usage_is_one_series_per_node_not_per_worker() -> None:
    """Two workers of one node report the node's shared tiers: one series per (node, tier), so a sum over
    the series counts each tier once (per-worker series double counted it)."""
    metrics = RouterMetrics()
    for w in ("tier-node-w0", "tier-node-w1"):
        report = pb.PressureReport(worker_id=w, total_blocks=10, host_cache_bytes_capacity=1000,
                                   host_cache_bytes_used=300, disk_cache_bytes_capacity=5000,
                                   disk_cache_bytes_used=1200)  # fmt: skip
        metrics.observe_pressure(report, dict.fromkeys(_TOTALS, 0), node="node-tiers-a")
    series = _node_series("kvserve:tier_cache_bytes_used", "node-tiers-a")
    assert sorted(series, key=lambda d: d["tier"]) == [{"node": "node-tiers-a", "tier": "disk"},
                                                        {"node": "node-tiers-a", "tier": "host"}]  # fmt: skip
    assert _sample("kvserve:tier_cache_bytes_used", node="node-tiers-a", tier="host") == 300
    assert _sample("kvserve:tier_cache_bytes_capacity", node="node-tiers-a", tier="disk") == 5000
    assert not _node_series("kvserve:tier_cache_bytes_used", "tier-node-w0")


def test_status_row_carries_both_tiers() -> None:
    """What ``kvserve top`` shows: the node's host and disk fill, and the share of prompt tokens from each."""
    entry = WorkerState(WorkerIdentity("w", "m", block_size=16, total_blocks=64, max_model_len=256, vocab_size=100),
                        None)  # fmt: skip
    entry.report = pb.PressureReport(total_blocks=64, prefix_cache_query_tokens_total=4000,
                                     host_cache_bytes_capacity=1000, host_cache_bytes_used=250,
                                     disk_cache_bytes_capacity=8000, disk_cache_bytes_used=2000,
                                     prefix_cache_host_hit_tokens_total=1000,
                                     prefix_cache_disk_hit_tokens_total=1808)  # fmt: skip
    row = entry.status_row(True, 0.0)
    assert row.report == entry.report, "the report as the worker sent it"
    assert (row.report.disk_cache_bytes_used, row.report.disk_cache_bytes_capacity) == (2000, 8000)
    assert (row.report.host_cache_bytes_used, row.report.host_cache_bytes_capacity) == (250, 1000)
