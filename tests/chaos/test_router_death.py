"""Failures with no failover: ``--migration-limit 0`` (a dead worker's clients get UNAVAILABLE,
nobody else) and the router's own death (its clients get UNAVAILABLE at once; ``serve`` restarts
it on the same port; the workers reconnect, their orphaned requests are aborted and every block
is freed; new requests succeed).
"""

from __future__ import annotations

import os
import re
import signal
import time

import grpc

from tests.chaos.conftest import ServedCluster
from tests.chaos.served import cluster_fixture
from tests.chaos.streams import Stream, prompt, request, run_all
from tests.chaos.test_failover import RESTART_TIMEOUT_S, _held_at, _router_pid, _wait_status, _worker

ROUTER_RESTARTED = re.compile(r"router restarted \(1\)")


cluster = cluster_fixture("--migration-limit", "0")


def test_migration_limit_0_only_the_dead_workers_clients_get_unavailable(cluster: ServedCluster) -> None:
    c = cluster
    # NOTE: the pids first (the probe process starts on first use, seconds on a loaded box), so the
    # kill lands while the streams run.
    pids = {w.worker_id: c.worker_pid(w.worker_id) for w in c.status().workers}
    streams = [Stream(c.address, request(prompt(400 + i), 200), first_tokens=3).start() for i in range(4)]
    for s in streams:
        assert s.started.wait(120)
    holders = {s.req.request_id or str(i): s.last_worker for i, s in enumerate(streams)}
    victim = max(set(holders.values()), key=list(holders.values()).count)
    t_kill = time.monotonic()
    os.kill(pids[victim], signal.SIGKILL)
    for s in streams:
        s.wait(240)
    # Those its worker held when it died (one that had ended already was not affected).
    on_victim = [s for s in streams if _held_at(s, t_kill) == victim and (s.ended_at or 0) >= t_kill]
    assert on_victim, "no stream was on the killed worker when it died"
    for s in streams:
        if s in on_victim:
            assert s.code == grpc.StatusCode.UNAVAILABLE, (s.code, s.details)
            assert "migration limit 0" in s.details, s.details
        else:
            assert s.code == grpc.StatusCode.OK and len(s.tokens) == 200, (s.code, s.details)
    _wait_status(c, lambda st: _worker(st, victim).state == "up" and _worker(st, victim).healthy,
                 RESTART_TIMEOUT_S, f"{victim} back up")  # fmt: skip
    c.wait_idle()


def test_router_death_is_prompt_unavailable_then_service_resumes_with_no_leaked_block(cluster: ServedCluster) -> None:
    c = cluster
    streams = [Stream(c.address, request(prompt(500 + i), 300), first_tokens=3).start() for i in range(4)]
    for s in streams:
        assert s.started.wait(120)
    t_kill = time.monotonic()
    os.kill(_router_pid(c), signal.SIGKILL)
    for s in streams:
        s.wait(60)
    assert all(s.code == grpc.StatusCode.UNAVAILABLE for s in streams), [(s.code, s.details) for s in streams]
    t_unavailable = max(s.ended_at for s in streams if s.ended_at is not None) - t_kill
    assert t_unavailable < 10.0, f"clients learned of the router's death only after {t_unavailable:.1f}s"

    c.proc.wait_for_line(ROUTER_RESTARTED, timeout=RESTART_TIMEOUT_S)
    t_restart = time.monotonic() - t_kill
    # Orphans: the workers' requests of the dead router are aborted, every block comes back.
    c.wait_idle(timeout=120)
    after = run_all(c.address, [request(prompt(550 + i), 16) for i in range(4)])
    assert all(s.code == grpc.StatusCode.OK and len(s.tokens) == 16 for s in after), [s.details for s in after]
    c.wait_idle()
    print(f"\nFIGURES router kill: {len(streams)} streams UNAVAILABLE within {t_unavailable:.2f}s; "
          f"router serving again {t_restart:.1f}s after the kill")  # fmt: skip
