"""docs/architecture.md names every message and command of the two router↔worker channels exactly as the
protos and the code have them (section 4, "Two channels"), and every PressureReport field."""

from __future__ import annotations

import re
from pathlib import Path

from kvserve.protos.kvserve.v1 import worker_pb2 as pb

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "architecture.md").read_text()


def _doc_list(label: str) -> set[str]:
    """The backquoted names after ``label`` up to the sentence's end (a list item may wrap)."""
    start = DOC.index(label) + len(label)
    end = DOC.index(".", start)
    return set(re.findall(r"`(\w+)`", DOC[start:end]))


def _oneof(message: type, name: str) -> set[str]:
    return {f.name for f in message.DESCRIPTOR.oneofs_by_name[name].fields}


def test_worker_messages_match_the_proto() -> None:
    assert _doc_list("WorkerLink, worker → router (`WorkerMessage.body`):") == _oneof(pb.WorkerMessage, "body")


def test_router_commands_match_the_proto() -> None:
    assert _doc_list("WorkerLink, router → worker (`RouterCommand.command`):") == _oneof(pb.RouterCommand, "command")


def test_ray_calls_match_what_the_router_calls() -> None:
    """Every ``handle.<method>.remote`` in router/ (health and pid helpers of the actor service aside)."""
    called = set()
    for path in (ROOT / "kvserve" / "router").rglob("*.py"):
        called |= set(re.findall(r"handle\.(\w+)\.remote\(", path.read_text()))
    # RouterService's test and ops helpers, not the request path
    called -= {"pid", "check_integrity", "partition_link_for_test"}
    label = "Ray calls, router → worker (methods of `kvserve/workers/transport/worker.py` `Worker`):"
    assert _doc_list(label) - {"Worker"} == called


def test_every_pressure_report_field_is_documented() -> None:
    section = DOC[DOC.index("- **PressureReport** fields"):DOC.index("- **Block events**")]
    missing = [f.name for f in pb.PressureReport.DESCRIPTOR.fields if f.name not in section]
    assert not missing, f"docs/architecture.md section 4 does not name PressureReport fields {missing}"
