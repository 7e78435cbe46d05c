"""WorkerState: a worker's running totals become per-report deltas once (what RouterMetrics adds), and a
new incarnation's totals, which begin again, count as new."""

from __future__ import annotations

from kvserve.protos.kvserve.v1 import worker_pb2 as pb
from kvserve.router.table.workers import WorkerState
from kvserve.workers.core.identity import WorkerIdentity


def _state() -> WorkerState:
    ident = WorkerIdentity("w", "m", block_size=16, total_blocks=64, max_model_len=256, vocab_size=100)
    return WorkerState(ident, None)


def _report(preempt: int, swaps: int, queries: int, hits: int, prefill: int) -> pb.PressureReport:
    return pb.PressureReport(
        num_preemptions_total=preempt, num_swaps_total=swaps, prefix_cache_query_tokens_total=queries,
        prefix_cache_hit_tokens_total=hits, prefill_tokens_total=prefill,
    )  # fmt: skip


def counted(preempt: int, swaps: int, queries: int, hits: int, prefill: int) -> dict[str, int]:
    """The deltas of ``_report``'s totals; every other counter of the report (tiers, migrations, graph steps,
    whatever the proto adds next) is zero in these reports."""
    return {**dict.fromkeys(_COUNTERS, 0), "num_preemptions_total": preempt, "num_swaps_total": swaps,
            "prefix_cache_query_tokens_total": queries, "prefix_cache_hit_tokens_total": hits,
            "prefill_tokens_total": prefill}  # fmt: skip


# The report's running totals (``*_blocks_total`` are pool sizes, not counters).
_FIELDS = pb.PressureReport.DESCRIPTOR.fields
_COUNTERS = [f.name for f in _FIELDS if f.name.endswith("_total") and "_blocks_" not in f.name]


def test_totals_become_deltas_and_a_restart_counts_from_zero() -> None:
    w = _state()
    assert w.deltas(_report(2, 1, 100, 40, 60)) == counted(2, 1, 100, 40, 60)
    assert w.deltas(_report(3, 1, 150, 40, 110)) == counted(1, 0, 50, 0, 50)
    assert w.deltas(_report(3, 1, 150, 40, 110)) == counted(0, 0, 0, 0, 0)  # nothing new
    # A new incarnation: its totals began again (one went down), so all of it is new.
    assert w.deltas(_report(0, 0, 30, 10, 20)) == counted(0, 0, 30, 10, 20)


def test_every_total_of_the_report_is_counted() -> None:
    """A counter added to the proto is counted with no change here (the one place is the proto)."""
    names = {f.name for f in pb.PressureReport.DESCRIPTOR.fields if f.name.endswith("_total")} - {"swap_blocks_total"}
    assert set(_state().deltas(pb.PressureReport())) == names
