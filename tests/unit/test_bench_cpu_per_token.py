"""CPU per streamed token by part of kvserve's serving stack (issue 41 item 6): compare-serve's CPU
sampler splits the router from the frontends, and the report divides by the tokens the client streamed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvserve.cluster.bench.compare_serve_clients import read_vllm_bench_output_tokens
from kvserve.cluster.bench.compare_serve_report import cpu_summary, format_cpu_table
from kvserve.cluster.bench.cpu_share import ProcessCpu, by_stack_part


def test_the_router_and_the_frontends_are_counted_apart() -> None:
    first = {1: ProcessCpu(1.0, 10, "ray::RouterActo", "ray::RouterActor"),
             2: ProcessCpu(2.0, 10, "ray::FrontendAc", "ray::FrontendActor")}  # fmt: skip
    last = {1: ProcessCpu(1.5, 10, "ray::RouterActo", "ray::RouterActor"),
            2: ProcessCpu(2.25, 10, "ray::FrontendAc", "ray::FrontendActor"),
            3: ProcessCpu(0.5, 20, "ray::FrontendAc", "ray::FrontendActor"),  # a second frontend, new
            4: ProcessCpu(9.0, 10, "ray::Worker", "ray::Worker")}  # fmt: skip
    assert by_stack_part(first, last) == {"router": 0.5, "frontends": 0.75}


def test_the_report_gives_microseconds_per_streamed_token() -> None:
    rounds = [
        {"cpu_seconds": {"client": 1.0}, "duration_s": 2.0, "stack_seconds": {"router": 0.4, "frontends": 0.2},
         "output_tokens": 4000},
        {"cpu_seconds": {"client": 1.0}, "duration_s": 2.0, "stack_seconds": {"router": 0.6, "frontends": 0.2},
         "output_tokens": 4000},
        {"cpu_seconds": {"client": 1.0}, "duration_s": 2.0},  # a peer's round: nothing to divide
    ]  # fmt: skip
    summary = cpu_summary({"kvserve": rounds, "vllm": rounds[2:]})
    assert summary["kvserve"]["median_us_per_token"] == pytest.approx({"router": 125.0, "frontends": 50.0})
    assert summary["vllm"]["median_us_per_token"] == {}
    table = format_cpu_table(summary, 2)
    assert "**CPU per streamed token** (us, medians): kvserve: router 125.0, frontends 50.0" in table


def test_streamed_tokens_are_read_from_the_saved_result(tmp_path: Path) -> None:
    result = tmp_path / "r.json"
    result.write_text(json.dumps({"total_output_tokens": 4096, "duration": 1.5}))
    assert read_vllm_bench_output_tokens(result) == 4096
    result.write_text(json.dumps({"duration": 1.5}))
    assert read_vllm_bench_output_tokens(result) is None
    assert read_vllm_bench_output_tokens(tmp_path / "missing.json") is None
