"""kvserve/cluster/bench/router_bench.py: a small run through the real placement, admission and prefix index."""

from __future__ import annotations

import json

import pytest

from kvserve.cluster.bench.router_bench import RouterBenchConfig, measure_memory, run_one
from kvserve.cluster.cli import main


def test_run_one_reports_every_figure() -> None:
    r = run_one(RouterBenchConfig(num_workers=8, requests=50, groups=10, prefix_blocks=4, unique_blocks=2,
                                  cached_blocks=40))  # fmt: skip
    assert r["workers"] == 8 and r["requests"] == 50
    assert 0 < r["decision_p50_us"] <= r["decision_p99_us"]
    assert r["events_per_request"] > 0 and r["apply_mean_us"] > 0
    assert r["saturation_requests_per_s"] == pytest.approx(1e6 / r["router_us_per_request"])
    assert 0 < r["max_worker_share"] <= 1


def test_memory_per_block_is_positive() -> None:
    m = measure_memory(RouterBenchConfig(num_workers=8, groups=10, prefix_blocks=4, cached_blocks=100))
    assert set(m) == {"bytes_per_block_at_100", "bytes_per_block_at_400"}
    assert all(0 < v < 1000 for v in m.values())


def test_cli_json(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["bench", "router", "--workers", "8,16", "--requests", "20", "--groups", "5", "--prefix-blocks", "3",
               "--cached-blocks", "30", "--rates", "1000,2000", "--json"])  # fmt: skip
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["workers"] for r in out["results"]] == [8, 16]
    assert set(out["results"][0]["busy_share_at"]) == {"1000", "2000"}


def test_config_validation() -> None:
    with pytest.raises(ValueError):
        RouterBenchConfig(num_workers=0)
