"""Two Ray nodes on one machine (`ray start --head` + `ray start --address`), `kvserve serve
--address HOST:PORT --spread` joining them: the workers land on both nodes and serve requests.

Everything runs in subprocesses (no ``ray.init`` here, so an already-initialized Ray in this
pytest process does not matter), and the external cluster is this test's own:

* ``--temp-dir`` is a fresh directory, so its ``ray_current_cluster`` file never makes another
  ``ray.init()`` on this machine join it, and every process it starts names that directory;
* the nodes run ``ray start --block``: SIGTERM to those two processes stops each node. NOTE: no
  ``ray stop``: it kills every Ray process on the machine, other sessions' included; stragglers
  are found by the temp directory in their command line and killed by pid;
* Ray's token auth is off for this loopback-only cluster (``RAY_AUTH_MODE=disabled``): a joining
  ``ray start`` does not pick up the head's token by itself.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest

from tests.integration.test_serve import API_LINE, Proc, clean_env, cluster_status, kvserve_argv, stream_tokens

RAY = str(Path(sys.executable).with_name("ray"))
STARTED = re.compile(r"Ray runtime started")


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports on loopback.

    NOTE: all bound at once: ports taken one at a time can repeat (each socket is closed before the
    next bind), and `ray start` refuses a port given to two of its components."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


def node_ports(head: bool) -> list[str]:
    """The ports a `ray start` on loopback is given, the GCS port first for the head (two nodes on
    one host must not share them; a node started after another sees its ports bound)."""
    if not head:
        agent, metrics = free_ports(2)
        return [f"--dashboard-agent-listen-port={agent}", f"--metrics-export-port={metrics}"]
    gcs, dashboard, client_server, agent, metrics = free_ports(5)
    return [f"--port={gcs}", f"--dashboard-port={dashboard}", f"--ray-client-server-port={client_server}",
            f"--dashboard-agent-listen-port={agent}", f"--metrics-export-port={metrics}"]  # fmt: skip


def wait_for_output(proc: Proc, pattern: re.Pattern, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not (pattern.search(proc.out) or pattern.search(proc.err)):
        assert proc.popen.poll() is None, f"{proc.argv[:3]} exited {proc.popen.returncode}:\n{proc.err[-4000:]}"
        assert time.monotonic() < deadline, f"{proc.argv[:3]}: no {pattern.pattern!r}:\n{proc.err[-4000:]}"
        time.sleep(0.2)


def processes_under(temp_dir: str) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any(temp_dir in arg for arg in p.info["cmdline"] or ()):
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return found


def active_nodes(address: str, env: dict[str, str]) -> int:
    out = subprocess.run([RAY, "status", f"--address={address}"], env=env, capture_output=True, text=True, timeout=60)
    if out.returncode != 0 or "Active:" not in out.stdout:
        return 0
    active = out.stdout.split("Active:", 1)[1].split("Pending:", 1)[0]
    return len(re.findall(r"^\s*\d+\s+node_", active, re.M))


@pytest.fixture
def two_nodes(request: pytest.FixtureRequest) -> Iterator[tuple[str, dict[str, str], list[Proc]]]:
    """Two nodes of 2 CPUs each (``indirect`` parametrization: another count)."""
    num_cpus = getattr(request, "param", 2)
    # NOTE: short and fresh: Ray's Unix sockets live under it (paths must stay < 108 bytes).
    temp_dir = tempfile.mkdtemp(prefix="kvr", dir="/tmp")
    env = clean_env(RAY_AUTH_MODE="disabled")
    head_ports = node_ports(head=True)
    address = f"127.0.0.1:{head_ports[0].removeprefix('--port=')}"

    def node(*extra: str) -> list[str]:
        return [
            RAY, "start", f"--num-cpus={num_cpus}", "--node-ip-address=127.0.0.1", f"--temp-dir={temp_dir}", "--block",
            "--disable-usage-stats", *extra,
        ]  # fmt: skip

    nodes: list[Proc] = []
    try:
        head = node("--head", *head_ports, '--resources={"node_a": 1}', "--include-dashboard=false")
        nodes.append(Proc(head, env))
        wait_for_output(nodes[0], STARTED, timeout=120)
        nodes.append(Proc(node(f"--address={address}", *node_ports(head=False), '--resources={"node_b": 1}'), env))
        wait_for_output(nodes[1], STARTED, timeout=120)
        deadline = time.monotonic() + 60
        while active_nodes(address, env) < 2:
            assert time.monotonic() < deadline, "the second node never registered"
            time.sleep(1)
        yield address, env, nodes
    finally:
        for proc in reversed(nodes):  # worker node first, then the head
            proc.note_descendants()
            if proc.popen.poll() is None:
                proc.popen.send_signal(signal.SIGTERM)
                try:
                    proc.popen.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill_tree()
        deadline = time.monotonic() + 15
        while (left := _alive(processes_under(temp_dir), *nodes)) and time.monotonic() < deadline:
            time.sleep(0.5)
        for p in left:  # stragglers of this cluster only, by pid
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        shutil.rmtree(temp_dir, ignore_errors=True)
        assert not left, f"Ray processes outlived `ray start --block`: {[p.pid for p in left]}"


def test_workers_spread_over_two_nodes(two_nodes: tuple[str, dict[str, str], list[Proc]], tiny_llama_dir: Path) -> None:
    ray_address, env, nodes = two_nodes
    serve = Proc(
        kvserve_argv(
            "serve", "--address", ray_address, "--workers", "2", "--spread", "--port", "0", "--metrics-port", "off",
            "--model", str(tiny_llama_dir), "--device", "cpu", "--num-gpu-blocks", "64", "--ready-timeout", "180",
        ),
        env,
    )  # fmt: skip
    try:
        address = serve.wait_for_line(API_LINE, timeout=240).group(1)
        status = cluster_status(address)
        placed = {w.worker_id: w.node_id for w in status.workers}
        assert sorted(placed) == ["worker-0", "worker-1"]
        assert all(placed.values()) and len(set(placed.values())) == 2, f"one worker per node: {placed}"

        prompts = [[11 + 7 * i + j for j in range(48)] for i in range(4)]
        with ThreadPoolExecutor(len(prompts)) as pool:
            finals = [r[-1] for r in pool.map(lambda p: stream_tokens(address, p, max_tokens=16), prompts)]
        assert all(f.finish_reason == "length" and f.usage.completion_tokens == 16 for f in finals)
        served_by = {f.worker_id for f in finals}
        assert served_by == {"worker-0", "worker-1"}, f"requests served on both nodes: {served_by}"
        after = cluster_status(address)
        assert all(w.healthy and w.report.decode_steps > 0 for w in after.workers)

        actors = [p for node in nodes for p in _children(node) if _is_kvserve_actor(p)]
        assert len(actors) == 3, f"router + 2 workers run in the nodes' processes: {actors}"
        t0 = time.monotonic()
        serve.popen.send_signal(signal.SIGINT)
        assert serve.popen.wait(timeout=60) == 0, serve.err[-4000:]
        assert time.monotonic() - t0 < 20
        # the actors it created are gone from the (still running) Ray cluster
        deadline = time.monotonic() + 20
        while actors := [p for node in nodes for p in _children(node) if _is_kvserve_actor(p)]:
            assert time.monotonic() < deadline, f"actor processes left behind: {[p.pid for p in actors]}"
            time.sleep(0.5)
    finally:
        if serve.popen.poll() is None:
            serve.kill_tree()


@pytest.mark.parametrize("two_nodes", [4], indirect=True)
def test_tp_groups_spread_over_nodes(two_nodes: tuple[str, dict[str, str], list[Proc]], tiny_llama_dir: Path) -> None:
    """``--spread`` with ``--tensor-parallel-size 2``: each worker's STRICT_PACK group (rank 0 + a rank actor) on
    one node, the two groups on distinct nodes though either node has room for both (4 CPUs each)."""
    ray_address, env, nodes = two_nodes
    serve = Proc(
        kvserve_argv(
            "serve", "--address", ray_address, "--workers", "2", "--spread", "--tensor-parallel-size", "2",
            "--port", "0", "--metrics-port", "off", "--model", str(tiny_llama_dir), "--device", "cpu",
            "--num-gpu-blocks", "64", "--ready-timeout", "180",
        ),
        env,
    )  # fmt: skip
    try:
        address = serve.wait_for_line(API_LINE, timeout=240).group(1)
        status = cluster_status(address)
        placed = {w.worker_id: w.node_id for w in status.workers}
        assert sorted(placed) == ["worker-0", "worker-1"] and [w.tensor_parallel_size for w in status.workers] == [2, 2]
        assert all(placed.values()) and len(set(placed.values())) == 2, f"one group per node: {placed}"
        # every node runs one group whole: its rank 0 (Worker) and its rank 1 (RankActor)
        per_node = [sorted(_actor_class(p) for p in _children(node) if _actor_class(p) in ("Worker", "RankActor"))
                    for node in nodes]  # fmt: skip
        assert per_node == [["RankActor", "Worker"], ["RankActor", "Worker"]], per_node
        finals = [stream_tokens(address, [11 + 7 * i + j for j in range(24)], max_tokens=8)[-1] for i in range(2)]
        assert all(f.finish_reason == "length" and f.usage.completion_tokens == 8 for f in finals)
        serve.popen.send_signal(signal.SIGINT)
        assert serve.popen.wait(timeout=60) == 0, serve.err[-4000:]
        deadline = time.monotonic() + 20  # the ranks it created are gone with their groups
        while left := [p for node in nodes for p in _children(node) if _actor_class(p) in ("Worker", "RankActor")]:
            assert time.monotonic() < deadline, f"actor processes left behind: {[p.pid for p in left]}"
            time.sleep(0.5)
    finally:
        if serve.popen.poll() is None:
            serve.kill_tree()


def _actor_class(p: psutil.Process) -> str | None:
    """The actor class a live Ray actor process runs (Ray titles it ``ray::Class`` or ``ray::Class.method``)."""
    try:
        cmd = " ".join(p.cmdline())
        if not cmd.startswith("ray::") or p.status() == psutil.STATUS_ZOMBIE:
            return None
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None
    return cmd.removeprefix("ray::").split()[0].split(".")[0]


def _children(node: Proc) -> list[psutil.Process]:
    try:
        return node.ps.children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _alive(found: list[psutil.Process], *nodes: Proc) -> list[psutil.Process]:
    """``found`` plus every descendant the nodes had, that still runs."""
    procs = {p.pid: p for p in found}
    for node in nodes:
        procs.update(node.descendants)
    out = []
    for p in procs.values():
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def _is_kvserve_actor(p: psutil.Process) -> bool:
    """A live process running a router or worker actor (Ray titles them ray::Class)."""
    try:
        cmd = " ".join(p.cmdline())
        return cmd.startswith(("ray::Worker", "ray::RouterActor")) and p.status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False
