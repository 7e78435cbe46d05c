"""CPU by role over a client's run (kvserve/cluster/bench/cpu_share.py): roles, and CPU counted from /proc."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvserve.cluster.bench import cpu_share
from kvserve.cluster.bench.cpu_share import CpuSampler, ProcessCpu, by_role, role

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")


@pytest.mark.parametrize(
    ("comm", "cmdline", "expected"),
    [
        ("vllm", "/p/bin/python /p/bin/vllm bench serve --backend openai", "client"),
        ("guidellm", "/p/bin/python /p/bin/guidellm benchmark run", "client"),
        ("kvserve", "/v/bin/python3 /v/bin/kvserve bench compare-serve --guidellm-bin none", "other"),
        ("ray::Worker", "ray::Worker", "engine"),
        ("VLLM::EngineCor", "VLLM::EngineCore", "engine"),
        ("VLLM::Worker_TP", "VLLM::Worker_TP0", "engine"),
        ("ray::RouterActo", "ray::RouterActor", "serving stack"),
        ("ray::FrontendAc", "ray::FrontendActor", "serving stack"),
        ("python3", "/v/bin/python3 -m kvserve.cluster.cli serve --model /m --http-port 1", "serving stack"),
        ("vllm", "/p/bin/python /p/bin/vllm serve /m --dtype float32", "serving stack"),
        ("VLLM::APIServer", "VLLM::APIServer", "serving stack"),
        ("vllm-router", "/p/bin/vllm-router --worker-urls a b", "serving stack"),
        ("raylet", "/v/lib/python3.11/site-packages/ray/core/src/ray/raylet/raylet --x", "ray daemons"),
        ("ray::IDLE", "ray::IDLE", "ray daemons"),
        ("python3", "/v/bin/python3 -u /v/lib/python3.11/site-packages/ray/_private/log_monitor.py", "ray daemons"),
        ("bash", "bash -c make test", "other"),
    ],
)
def test_each_process_gets_its_role(comm: str, cmdline: str, expected: str) -> None:
    assert role(comm, cmdline) == expected


def test_a_reused_pid_counts_from_zero_and_a_new_process_whole() -> None:
    first = {1: ProcessCpu(5.0, 100, "ray::Worker", "ray::Worker"), 2: ProcessCpu(9.0, 100, "bash", "bash")}
    last = {
        1: ProcessCpu(7.5, 100, "ray::Worker", "ray::Worker"),  # the same process: 2.5 s since
        2: ProcessCpu(0.5, 200, "ray::RouterActo", "ray::RouterActor"),  # pid 2 reused: all of its 0.5 s
        3: ProcessCpu(1.0, 300, "raylet", "raylet"),  # started since: all of it
    }
    got = by_role(first, last)
    assert got == {"client": 0.0, "engine": 2.5, "serving stack": 0.5, "ray daemons": 1.0, "other": 0.0}


def test_a_zombie_keeps_the_role_it_had() -> None:
    """An exited, unreaped process still reports its CPU time, with an empty command line."""
    seen = {7: ProcessCpu(1.0, 50, "vllm", "/p/bin/python /p/bin/vllm bench serve --backend openai")}
    cpu_share.merge(seen, {7: ProcessCpu(12.0, 50, "vllm", "")})
    assert seen[7].seconds == 12.0 and role(seen[7].comm, seen[7].cmdline) == "client"
    cpu_share.merge(seen, {7: ProcessCpu(0.5, 99, "bash", "")})  # another process on the pid: not kept
    assert seen[7].cmdline == ""


def test_the_sampler_counts_a_client_that_exits_before_it_stops() -> None:
    """A process that burns ~0.5 s of CPU and exits while the sampler runs is counted (its last sample)."""
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.5: pass\n"
    marker = f"cpu-share-test-{os.getpid()}"
    with CpuSampler(interval_s=0.05) as sampler:
        # argv ends "bench serve": the client's role, as `vllm bench serve` is
        subprocess.run([sys.executable, "-c", burn, marker, "bench", "serve"], check=True)
    # NOTE: other work may run on this machine (its own clients, engines): find our process, not the busiest
    ours = [p for p in sampler.processes if marker in p["cmdline"]]
    assert len(ours) == 1, sampler.processes
    assert ours[0]["role"] == "client" and ours[0]["cmdline"].endswith("bench serve ")
    assert 0.4 <= ours[0]["cpu_s"] <= 1.5, ours
    assert sampler.cpu_seconds["client"] >= ours[0]["cpu_s"] - 0.01, sampler.cpu_seconds
    assert set(sampler.cpu_seconds) == set(cpu_share.ROLE_NAMES)
