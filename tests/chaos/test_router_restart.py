"""A router restart always comes back (README "Failure behaviour"): with one worker retired
(``--worker-restart-limit 0``: its first restart retires it), a SIGKILL of the router makes
``kvserve serve`` start a new one that keeps the retirement and the restart count, serves on
the surviving worker, reports ready, and leaves every worker process it did not retire running.
"""

from __future__ import annotations

import os
import re
import signal
import time

import grpc
import psutil
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.chaos.conftest import ServedCluster
from tests.chaos.served import cluster_fixture
from tests.chaos.streams import prompt, request, run_all
from tests.chaos.test_failover import RESTART_TIMEOUT_S, _wait_status, _worker

ROUTER_RESTARTED = re.compile(r"router restarted \(1\).*retired: worker-0")


cluster = cluster_fixture("--worker-restart-limit", "0")


def _ready(c: ServedCluster) -> int:
    with c.channel() as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=30)
    return reply.status


def test_router_killed_while_a_worker_is_retired_comes_back_and_keeps_the_retirement(cluster: ServedCluster) -> None:
    c = cluster
    c.kill_worker("worker-0")  # Ray restarts it; its new incarnation's Hello retires it (limit 0)
    _wait_status(c, lambda st: _worker(st, "worker-0").state == "retired", RESTART_TIMEOUT_S, "worker-0 retired")
    survivor_pid = c.worker_pid("worker-1")

    t_kill = time.monotonic()
    os.kill(c.router_pid(), signal.SIGKILL)
    c.proc.wait_for_line(ROUTER_RESTARTED, timeout=RESTART_TIMEOUT_S)
    t_back = time.monotonic() - t_kill
    assert c.proc.popen.poll() is None, "serve stopped instead of restarting the router"
    assert psutil.pid_exists(survivor_pid) and c.worker_pid("worker-1") == survivor_pid, "a worker was restarted"

    st = _wait_status(c, lambda st: _worker(st, "worker-1").healthy and _worker(st, "worker-1").state == "up", 60,
                      "worker-1 serving the new router")  # fmt: skip
    retired = _worker(st, "worker-0")
    assert (retired.state, retired.healthy, retired.restarts_total) == ("retired", False, 1)
    assert _ready(c) == health_pb2.HealthCheckResponse.SERVING
    after = run_all(c.address, [request(prompt(600 + i), 16) for i in range(4)], timeout=120)
    assert all(s.code == grpc.StatusCode.OK and len(s.tokens) == 16 for s in after), [s.details for s in after]
    assert {w for s in after for w in s.worker_ids} == {"worker-1"}
    _wait_status(c, lambda st: _worker(st, "worker-1").report.used_blocks == 0 and st.router.requests_in_flight == 0,
                 60, "worker-1 idle")  # fmt: skip
    assert c.integrity()["worker-1"] is None
    print(f"\nFIGURES router kill with worker-0 retired: serving again {t_back:.1f}s after the kill; "
          f"worker-0 still retired (restarts 1), worker-1 same process, 4/4 new requests ok")  # fmt: skip
