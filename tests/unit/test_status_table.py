"""``kvserve status``'s table stays readable at 80 columns and when piped (no squeezed headers)."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from kvserve.cluster.remote_cli import _ACTIVITY, _PRESSURE, WIDE_TABLE_MIN_COLUMNS, render_status
from kvserve.protos.kvserve.v1 import pressure_pb2 as ppb
from kvserve.protos.kvserve.v1 import serving_pb2 as spb


def busy_status() -> spb.ClusterStatus:
    """Two workers with large numbers in every column (the widest realistic cells)."""
    s = spb.ClusterStatus(timestamp_ms=1)
    for i in range(2):
        report = ppb.PressureReport(
            total_blocks=40960, used_blocks=39960, free_blocks=1000, cached_evictable_blocks=999,
            swap_blocks_total=4096, swap_blocks_free=4000, num_swapped=3, num_running=256, num_waiting=1000,
            num_preemptions_total=12345, prefix_cache_query_tokens_total=100, prefix_cache_hit_tokens_total=53,
            step_latency_ms=123.4,
        )  # fmt: skip
        s.workers.add(worker_id=f"worker-{i}", healthy=i == 0, usage=0.97, blocks_in_flight=128,
                      num_migrations_total=7, last_report_age_s=0.4, report=report)  # fmt: skip
    s.router.max_queue_requests = 1024
    s.router.admission_state = "open"
    return s


def render(width: int) -> str:
    out = io.StringIO()
    render_status(busy_status(), Console(file=out, width=width, force_terminal=False))  # as when piped
    return out.getvalue()


@pytest.mark.parametrize("width", [80, WIDE_TABLE_MIN_COLUMNS])
def test_every_header_and_value_whole(width: int) -> None:
    text = render(width)
    assert "…" not in text
    assert max(len(line) for line in text.splitlines()) <= width
    header_lines = [ln for ln in text.splitlines() if ln.strip().startswith("worker ")]
    headers = " ".join(header_lines)
    for name, _, _ in _PRESSURE + _ACTIVITY:
        assert f" {name} " in f" {headers} ", name
    for value in ("worker-0", "worker-1", "39960/40960", "97%", "96/4096", "12345", "123.4", "NO"):
        assert value in text, value


def test_layout_follows_width() -> None:
    assert render(80).count("worker-0") == 2  # two narrow tables, a row each
    assert render(WIDE_TABLE_MIN_COLUMNS).count("worker-0") == 1  # one wide table
