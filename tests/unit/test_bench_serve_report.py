"""kvserve/cluster/bench/serve_report.py: figures from synthetic records, the side-by-side table, SLO parsing."""

from __future__ import annotations

import math

import pytest

from kvserve.cluster.bench.serve_report import (
    ROWS,
    RequestRecord,
    RunResult,
    Slo,
    StatusSample,
    format_table,
    split_groups,
    summarize,
)


def _record(send: float, first: float, chunks: list[float], worker: str, prompt: list[int], cached: int,
            status: str = "ok") -> RequestRecord:  # fmt: skip
    r = RequestRecord(0, 0, "", prompt, send, group=prompt[-1] % 2, status=status, first_t=first, end_t=chunks[-1],
                      chunk_times=chunks, output_ids=list(range(len(chunks))), cached_tokens=cached,
                      worker_id=worker)  # fmt: skip
    return r


def _run(policy: str = "kv_aware") -> RunResult:
    shared = [9, 9, 9, 9, 9, 9, 9, 9]
    records = [
        _record(0.0, 0.1, [0.1, 0.2, 0.3], "worker-0", [*shared, 1, 2], 0),
        _record(0.5, 0.55, [0.55, 0.6, 0.65], "worker-0", [*shared, 3, 4], 8),
        _record(1.0, 1.3, [1.3, 1.5, 1.7], "worker-1", [*shared, 5, 6], 0),
        RequestRecord(0, 0, "", [1], 1.2, status="rejected"),
    ]
    samples = [StatusSample(0.1, 2, {"worker-0": 0.1, "worker-1": 0.0}, {}), StatusSample(0.3, 5, {}, {})]
    return RunResult(policy, 4.0, "d", 2.0, 4, records, samples)


def test_summarize_figures() -> None:
    s = summarize(_run(), Slo.parse("ttft:200"))
    assert (s["completed"], s["failed"], s["rejected"]) == (3, 0, 1)
    assert s["request_throughput"] == pytest.approx(1.5) and s["output_throughput"] == pytest.approx(4.5)
    assert s["ttft_median_ms"] == pytest.approx(100) and s["ttft_mean_ms"] == pytest.approx(150)
    assert s["tpot_mean_ms"] == pytest.approx((100 + 50 + 200) / 3)
    assert s["itl_p99_ms"] <= 200 and s["e2e_median_ms"] == pytest.approx(300)
    assert s["goodput"] == pytest.approx(2 / 2.0)  # the 300 ms TTFT misses the 200 ms SLO
    assert s["hit_rate"] == pytest.approx(8 / 30)
    assert s["ideal_cached_tokens"] == 16 and s["hit_of_ideal"] == pytest.approx(0.5)
    assert s["worker_shares"] == pytest.approx({"worker-0": 2 / 3, "worker-1": 1 / 3})
    assert s["max_share_ratio"] == pytest.approx(4 / 3)
    assert s["peak_queue"] == 5
    assert s["split_groups"] == pytest.approx(1.0)  # one group (prompts end 2, 4, 6), served by both workers
    assert all(key in s for key, _, _ in ROWS)
    assert s["host_hit_rate"] == 0.0  # the last poll says nothing about tiers


def test_tier_hit_rates_weight_each_worker_by_its_share() -> None:
    run = _run()
    run.samples.append(StatusSample(0.5, 0, {}, {}, {"worker-0": (0.3, 0.0), "worker-1": (0.6, 0.1)}))
    s = summarize(run, Slo())
    assert s["host_hit_rate"] == pytest.approx(2 / 3 * 0.3 + 1 / 3 * 0.6)
    assert s["disk_hit_rate"] == pytest.approx(1 / 3 * 0.1)


def test_table_has_every_row_and_ratio_columns() -> None:
    runs = [summarize(_run(p), Slo()) for p in ("kv_aware", "least_loaded", "round_robin")]
    table = format_table(runs)
    header = table.splitlines()[0]
    for col in ("kv_aware", "least_loaded", "round_robin", "least_loaded/kv_aware", "round_robin/kv_aware"):
        assert f" {col} |" in header
    for _, label, _ in ROWS:
        assert f"| {label} |" in table
    assert "| requests/s | 1.50 | 1.50 | 1.50 | 1.00x | 1.00x |" in table


def test_split_groups() -> None:
    def rec(group: int, worker: str) -> RequestRecord:
        return RequestRecord(0, 0, "", [1], 0.0, group=group, status="ok", worker_id=worker)

    records = [rec(0, "a"), rec(0, "a"), rec(1, "a"), rec(1, "b"), rec(2, "b"), rec(-1, "a"), rec(-1, "b")]
    assert split_groups(records) == pytest.approx(0.5)  # group 2 has one request; -1 is no group
    assert math.isnan(split_groups([rec(-1, "a")]))


def test_slo_parse() -> None:
    assert Slo.parse("ttft:500,tpot:50") == Slo(500.0, 50.0)
    assert Slo.parse(None) == Slo()
    for bad in ("foo:1", "ttft:0", "ttft:x"):
        with pytest.raises(ValueError):
            Slo.parse(bad)
    assert Slo(ttft_ms=100).met(0.05, None, 9.0) and not Slo(tpot_ms=10).met(0.0, 0.02, 0.0)
    assert math.isnan(summarize(RunResult("p", 1.0, "d", 1.0, 4, [], []), Slo())["ttft_p99_ms"])


def test_cli_refuses_several_policies_without_launch(capsys: pytest.CaptureFixture[str]) -> None:
    from kvserve.cluster.cli import main

    assert main(["bench", "serve", "--server", "127.0.0.1:1", "--vocab-size", "100",
                 "--policies", "kv_aware,round_robin"]) == 2  # fmt: skip
    assert "--launch" in capsys.readouterr().err
    assert main(["bench", "serve", "--server", "127.0.0.1:1", "--goodput", "ttfx:1", "--vocab-size", "100"]) == 2
    assert "unknown metric" in capsys.readouterr().err
