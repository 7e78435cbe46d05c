"""One worker-stats shape: a worker's PressureReport is the engine's ``EngineStats`` by field name plus the
few fields the worker measures itself, and every report field has exactly one of those sources."""

from __future__ import annotations

import dataclasses

from kvserve.protos.kvserve.v1 import worker_pb2 as pb
from kvserve.workers.engine.stats import EngineStats
from kvserve.workers.transport.pressure import WORKER_FIELDS, pressure_report

REPORT_FIELDS = {f.name for f in pb.PressureReport.DESCRIPTOR.fields}
STATS_FIELDS = {f.name for f in dataclasses.fields(EngineStats)}


def test_every_report_field_has_one_source() -> None:
    """A new report field is made by the engine or measured by the worker, never both, never neither."""
    assert not STATS_FIELDS & WORKER_FIELDS
    assert REPORT_FIELDS - STATS_FIELDS - WORKER_FIELDS == set(), "report fields nobody fills"
    assert STATS_FIELDS - REPORT_FIELDS == set(), "engine stats the report cannot carry"
    assert WORKER_FIELDS - REPORT_FIELDS == set()


def test_the_report_carries_every_stat_and_the_workers_counters() -> None:
    stats = EngineStats(**{f.name: i + 1 for i, f in enumerate(dataclasses.fields(EngineStats))})
    report = pressure_report("w0", stats, decode_steps=101, step_latency_ms=2.5, num_imports_total=3,
                             num_exports_total=4)  # fmt: skip
    for name, value in vars(stats).items():
        assert getattr(report, name) == value, f"{name} not carried"
    assert (report.worker_id, report.decode_steps, report.step_latency_ms) == ("w0", 101, 2.5)
    assert (report.num_imports_total, report.num_exports_total, report.seq) == (3, 4, 0)


def test_worker_status_embeds_the_report_and_copies_none_of_it() -> None:
    """ClusterStatus shows a worker's report as sent: no WorkerStatus field repeats a report field, so a
    reported field reaches ``kvserve top`` without a copy in the router (issue 40)."""
    from kvserve.protos.kvserve.v1 import serving_pb2 as spb

    fields = spb.WorkerStatus.DESCRIPTOR.fields_by_name
    assert fields["report"].message_type is pb.PressureReport.DESCRIPTOR
    assert set(fields) & REPORT_FIELDS == {"worker_id"}, "a report field copied into WorkerStatus"
