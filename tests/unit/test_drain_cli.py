"""``kvserve rollout`` / ``kvserve drain`` (kvserve/cluster/drain_cli.py) against a fake Admin: the order of
drains, what is skipped, where a rollout stops, exit codes and the progress lines."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from kvserve.cluster import drain_cli
from kvserve.protos.kvserve.v1 import serving_pb2 as spb


class _FakeAdmin:
    def __init__(self, states: dict[str, str], fail: frozenset[str] = frozenset()) -> None:
        self.states, self.fail = states, fail
        self.drained: list[str] = []

    def status(self) -> spb.ClusterStatus:
        return spb.ClusterStatus(workers=[spb.WorkerStatus(worker_id=w, state=s) for w, s in self.states.items()])

    def drain(self, worker_id: str, deadline_s: float) -> spb.DrainProgress:
        self.drained.append(worker_id)
        phase = "failed" if worker_id in self.fail else "done"
        p = spb.DrainProgress(worker_id=worker_id, phase=phase, reason="not back within 300s", elapsed_s=1.5,
                              old_incarnation="aaaaaaaa11", new_incarnation="bbbbbbbb22",
                              requests_migrated=2)  # fmt: skip
        print(drain_cli.describe(p))
        return p

    def close(self) -> None:
        pass


def _args(**kw: Any) -> argparse.Namespace:
    return argparse.Namespace(server="127.0.0.1:1", deadline_s=0.0, **kw)


def _with(monkeypatch: pytest.MonkeyPatch, admin: _FakeAdmin) -> None:
    monkeypatch.setattr(drain_cli, "_Admin", lambda args: admin)


def test_rollout_drains_each_serving_worker_in_order_and_skips_down_and_retired(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    admin = _FakeAdmin({"worker-0": "up", "worker-1": "retired", "worker-2": "down", "worker-3": "draining"})
    _with(monkeypatch, admin)
    assert drain_cli.cmd_rollout(_args()) == 0
    assert admin.drained == ["worker-0", "worker-3"]
    out = capsys.readouterr().out
    assert "skipping retired workers: worker-1" in out and "skipping down workers: worker-2" in out
    assert "worker-0: drained and back in 1.5s (2 migrated, 0 handed off); incarnation aaaaaaaa -> bbbbbbbb" in out
    assert "rollout done: 2 workers restarted" in out


def test_rollout_stops_at_the_first_failed_drain_and_drain_exits_1(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    admin = _FakeAdmin({"worker-0": "up", "worker-1": "up", "worker-2": "up"}, fail=frozenset({"worker-1"}))
    _with(monkeypatch, admin)
    assert drain_cli.cmd_rollout(_args()) == 1
    assert admin.drained == ["worker-0", "worker-1"], "the rollout must stop at a failed drain"
    captured = capsys.readouterr()
    assert "worker-1: drain FAILED after 1.5s: not back within 300s" in captured.out
    assert "rollout stopped at worker-1" in captured.err
    assert drain_cli.cmd_drain(_args(worker_id="worker-1")) == 1
    assert drain_cli.cmd_drain(_args(worker_id="worker-0")) == 0
