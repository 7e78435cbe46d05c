"""`kvserve top` frames rendered from crafted ClusterStatus snapshots (no server)."""

from __future__ import annotations

import re

import pytest
from rich.table import Table

from kvserve.cluster.top import _layout, block_bar, render_frame, render_text
from kvserve.protos.kvserve.v1 import pressure_pb2 as ppb
from kvserve.protos.kvserve.v1 import serving_pb2 as spb

REPORTED = {f.name for f in ppb.PressureReport.DESCRIPTOR.fields}


def status(ts_ms: int, **per_worker: dict) -> spb.ClusterStatus:
    """Workers of 48 blocks; a field the worker reports goes into its embedded report, the rest are the router's."""
    s = spb.ClusterStatus(timestamp_ms=ts_ms)
    for worker_id, fields in per_worker.items():
        w = s.workers.add(worker_id=worker_id.replace("_", "-"), healthy=True)
        w.report.total_blocks, w.report.free_blocks = 48, 48
        for key, value in fields.items():
            setattr(w.report if key in REPORTED else w, key, value)
        if "usage" not in fields:
            w.usage = w.report.used_blocks / w.report.total_blocks
    s.router.max_queue_requests = 1024
    s.router.admission_state = "open"
    return s


def row(text: str, worker_id: str) -> list[str]:
    line = next(ln for ln in text.splitlines() if ln.startswith(worker_id))
    return line.split()


def header(text: str) -> list[str]:
    line = next(ln for ln in text.splitlines() if ln.startswith("worker "))
    for two_words in ("KV blocks", "step ms", "age s"):
        line = line.replace(two_words, two_words.replace(" ", "_"))
    return line.split()


def test_rates_come_from_deltas_of_totals() -> None:
    prev = status(10_000, worker_0={"num_preemptions_total": 10, "num_migrations_total": 1})
    cur = status(12_000, worker_0={"num_preemptions_total": 16, "num_migrations_total": 2})
    prev.router.rejections_total["queue_full_blocks"] = 4
    cur.router.rejections_total["queue_full_blocks"] = 10
    text = render_text(prev, cur, width=200)
    cells = dict(zip(header(text), row(text, "worker-0"), strict=True))
    assert cells["preempt/s"] == "3.0"  # 6 preemptions in 2 s
    assert cells["migr/s"] == "0.5"
    assert "rejections 10 (3.0/s): queue_full_blocks 10" in text


def test_graph_share_of_the_decode_steps_between_frames() -> None:
    """graph%: of the decode steps since the last frame, those that replayed a decode graph."""
    prev = status(1000, worker_0={"decode_steps": 100, "decode_graph_steps_total": 40}, worker_1={"decode_steps": 7})
    cur = status(2000, worker_0={"decode_steps": 200, "decode_graph_steps_total": 130}, worker_1={"decode_steps": 7})
    text = render_text(prev, cur, width=200)
    assert dict(zip(header(text), row(text, "worker-0"), strict=True))["graph%"] == "90%"
    assert dict(zip(header(text), row(text, "worker-1"), strict=True))["graph%"] == "-"  # no step since
    first = render_text(None, cur, width=200)
    assert dict(zip(header(first), row(first, "worker-0"), strict=True))["graph%"] == "-"


def test_no_previous_snapshot_shows_no_rates() -> None:
    text = render_text(None, status(1000, worker_0={"num_preemptions_total": 5}), width=200)
    cells = dict(zip(header(text), row(text, "worker-0"), strict=True))
    assert cells["preempt/s"] == "-" and cells["migr/s"] == "-"


def test_counter_reset_never_shows_a_negative_rate() -> None:
    prev = status(1000, worker_0={"num_preemptions_total": 50})
    cur = status(2000, worker_0={"num_preemptions_total": 3})  # the worker restarted
    text = render_text(prev, cur, width=200)
    cells = dict(zip(header(text), row(text, "worker-0"), strict=True))
    assert cells["preempt/s"] == "0.0"


def test_every_worker_and_its_state_is_shown() -> None:
    cur = status(
        5000,
        worker_0={"used_blocks": 30, "cached_evictable_blocks": 6, "free_blocks": 12, "num_running": 3,
                  "num_waiting": 2, "num_swapped": 1, "swap_blocks_total": 64, "swap_blocks_free": 60,
                  "node_id": "a" * 56, "prefix_cache_query_tokens_total": 800,
                  "prefix_cache_hit_tokens_total": 200, "step_latency_ms": 12.5,
                  "last_report_age_s": 0.3, "host_cache_bytes_capacity": 1000, "host_cache_bytes_used": 400,
                  "prefix_cache_host_hit_tokens_total": 400, "disk_cache_bytes_capacity": 4000,
                  "disk_cache_bytes_used": 1000, "prefix_cache_disk_hit_tokens_total": 100},
        worker_1={"used_blocks": 0, "free_blocks": 48, "healthy": False, "last_report_age_s": -1.0,
                  "node_id": "b" * 56},
    )  # fmt: skip
    cur.router.queue_requests, cur.router.queue_blocks, cur.router.requests_in_flight = 3, 21, 4
    cur.router.admission_state = "queueing"
    text = render_text(None, cur, server="10.0.0.1:50051", width=200)
    assert "10.0.0.1:50051" in text and "workers 1/2 healthy" in text and "in flight 4" in text
    assert "router queue 3/1024 req, 21 blocks  [queueing]" in text
    cells = dict(zip(header(text), row(text, "worker-0"), strict=True))
    assert cells["node"] == "aaaaaaaa"
    assert (cells["used"], cells["evict"], cells["free"], cells["use%"]) == ("30", "6", "12", "62%")
    assert (cells["swap"], cells["run"], cells["wait"], cells["swp"]) == ("4/64", "3", "2", "1")
    assert (cells["hit%"], cells["step_ms"], cells["age_s"]) == ("25%", "12.5", "0.3")
    assert cells["host"] == "40%/50%"  # the node's host tier: 40 % full, half the prompt tokens loaded from it
    assert cells["disk"] == "25%/12%"  # and its disk tier (a worker with disk hits used to show none)
    down = row(text, "worker-1")
    assert down[1] == "✗" and down[-1] == "never", "an unhealthy worker is marked, a never-reported one says so"


def test_bar_cells_are_proportional_to_blocks() -> None:
    bar = block_bar(total=48, used=24, cached=12, width=40).plain
    assert len(bar) == 40
    assert (bar.count("█"), bar.count("▒"), bar.count("░")) == (20, 10, 10)
    assert block_bar(48, 0, 0, 20).plain == "░" * 20
    assert block_bar(48, 48, 0, 20).plain == "█" * 20
    one = block_bar(1000, 1, 1, 20).plain
    assert one.count("█") == 1 and one.count("▒") == 1, "a non-zero share is always visible"
    assert len(block_bar(0, 0, 0, 12).plain) == 12


def test_bar_colour_follows_usage() -> None:
    assert block_bar(100, 50, 0).spans[0].style == "green"
    assert block_bar(100, 75, 0).spans[0].style == "yellow"
    assert block_bar(100, 95, 0).spans[0].style == "red"


@pytest.mark.parametrize("width", [80, 100, 120, 160, 220])
def test_frame_fits_the_terminal(width: int) -> None:
    cur = status(2000, worker_0={"used_blocks": 40, "free_blocks": 8}, worker_1={"used_blocks": 4, "free_blocks": 44})
    text = render_text(status(1000, worker_0={}, worker_1={}), cur, server="127.0.0.1:50051", width=width)
    table_lines = [ln for ln in text.splitlines() if ln.startswith("worker")]
    assert len(table_lines) == 3  # header + both workers
    assert all(len(ln) <= width for ln in table_lines), "no table line wraps"
    assert "…" not in text, "no cell is cut short"
    for worker_id in ("worker-0", "worker-1"):
        assert re.search(rf"^{worker_id}\s+[█▒░]+\s+", text, re.M) or re.search(
            rf"^{worker_id}\s+\S+\s+[█▒░]+", text, re.M
        )


def test_narrow_layout_keeps_the_essentials() -> None:
    cols, bar = _layout(80, 30)
    for name in ("worker", "KV blocks", "used", "evict", "free", "use%", "run", "wait", "swp", "preempt/s", "migr/s"):
        assert name in cols
    assert bar >= 10
    full, bar_full = _layout(None, 30)
    assert len(full) == 20 and bar_full == 30


def test_a_frame_off_a_terminal_keeps_the_node_column() -> None:
    # NOTE: `kvserve top --once` into a pipe renders 160 cells; the node is what an operator greps by,
    # so the columns that drop first at that width are the ones without it (graph% first)
    cols, _ = _layout(160, 30)
    assert "node" in cols and "graph%" not in cols, cols


def test_no_workers() -> None:
    text = render_text(None, spb.ClusterStatus(timestamp_ms=1), width=100)
    assert "no workers registered" in text and "workers 0/0 healthy" in text


def test_render_frame_is_a_rich_renderable() -> None:
    from rich.console import Console

    console = Console(record=True, width=120)
    console.print(render_frame(None, status(1, worker_0={"used_blocks": 1, "free_blocks": 47}), width=120))
    assert "worker-0" in console.export_text()


def test_worker_down_restarts_retired_and_projected_wait_are_shown() -> None:
    cur = status(
        5000,
        worker_0={"state": "up", "restarts_total": 2},
        worker_1={"healthy": False, "state": "down", "restarts_total": 1},
        worker_2={"healthy": False, "state": "retired", "restarts_total": 4},
    )
    cur.router.projected_wait_s, cur.router.replays_total = 2.5, 3
    text = render_text(None, cur, width=200)
    assert "projected wait 2.5s" in text and "failover replays 3" in text
    assert row(text, "worker-0")[1] == "↻2"
    assert row(text, "worker-1")[1:4] == ["✗", "down", "↻1"]
    assert row(text, "worker-2")[1:4] == ["✗", "retired", "↻4"]
    cur.router.projected_wait_s = -1.0  # unknown: no drain observed yet
    assert "projected wait ?" in render_text(None, cur, width=200)


def test_usage_is_coloured_by_the_routers_own_watermarks() -> None:
    """The same 75 % pool is yellow under the default watermarks and red under a router whose high
    watermark is 0.7 (the colours say what the router does: above high it sheds work)."""
    def status(high: float | None) -> spb.ClusterStatus:
        s = spb.ClusterStatus(workers=[spb.WorkerStatus(worker_id="w0", healthy=True, state="up", usage=0.75,
                                                       report=ppb.PressureReport(total_blocks=100, used_blocks=75,
                                                                                 free_blocks=25))])  # fmt: skip
        if high is not None:
            s.router.high_watermark, s.router.low_watermark = high, 0.5
        return s

    def use_style(s: spb.ClusterStatus) -> str:
        frame = render_frame(None, s)
        table = next(r for r in frame.renderables if isinstance(r, Table))
        col = next(c for c in table.columns if c.header == "use%")
        return col._cells[0].style

    assert use_style(status(None)) == "yellow"
    assert use_style(status(0.7)) == "red"
