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
        called |= set(re.findall(r"handle\.(\w+)(?:\.options\([^)]*\))?\.remote\(", path.read_text()))
    # RouterService's test and ops helpers, not the request path
    called -= {"pid", "check_integrity"}
    label = "Ray calls, router → worker (methods of `kvserve/workers/transport/worker_actor.py` `Worker`):"
    assert _doc_list(label) - {"Worker"} == called


def test_every_pressure_report_field_is_documented() -> None:
    section = DOC[DOC.index("- **PressureReport** fields"):DOC.index("- **Block events**")]
    missing = [f.name for f in pb.PressureReport.DESCRIPTOR.fields if f.name not in section]
    assert not missing, f"docs/architecture.md section 4 does not name PressureReport fields {missing}"


def test_every_client_rpc_is_documented() -> None:
    """Section 3b names each service of serving.proto and each of its methods."""
    from kvserve.protos.kvserve.v1 import serving_pb2 as spb

    section = DOC[DOC.index("## 3b."):DOC.index("## 4.")]
    for service in spb.DESCRIPTOR.services_by_name.values():
        assert f"`{service.name}`" in section, f"docs/architecture.md 3b does not name service {service.name}"
        missing = [m.name for m in service.methods if f"`{m.name}`" not in section]
        assert not missing, f"docs/architecture.md 3b does not name {service.name} methods {missing}"


def test_the_folder_map_matches_the_tree() -> None:
    """Section 6 draws every folder of kvserve/router and kvserve/workers, and only folders that exist."""
    section = DOC[DOC.index("## 6. Layering"):DOC.index("## 7.")]
    for package in ("router", "workers"):
        start = section.index(f"\n{package} ")
        end = section.index("\n  ▼", start)
        drawn = set(re.findall(r"^\s+(\w+)/\s", section[start:end] + "\n", re.M))
        actual = {p.name for p in (ROOT / "kvserve" / package).iterdir() if (p / "__init__.py").is_file()}
        assert drawn == actual, f"kvserve/{package}: drawn {sorted(drawn)}, on disk {sorted(actual)}"


def test_the_cluster_status_shape_is_documented() -> None:
    """Section 3b says a WorkerStatus carries the worker's PressureReport as ``report``, as serving.proto has it."""
    from kvserve.protos.kvserve.v1 import serving_pb2 as spb

    section = DOC[DOC.index("## 3b.") : DOC.index("## 4.")]
    field = spb.WorkerStatus.DESCRIPTOR.fields_by_name["report"]
    assert field.message_type.name == "PressureReport"
    assert "`WorkerStatus`" in section and f"`{field.message_type.name}` as sent, `{field.name}`" in section
