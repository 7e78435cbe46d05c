"""Chaos fixtures: a real ``kvserve serve`` (subprocess, its own local Ray, the tiny random Llama,
2 CPU workers, free ports), and ways to look inside it through the cluster.

``served_cluster`` yields a ``ServedCluster``: its gRPC address, ``worker_pid(worker_id)`` (asked
of the worker actor itself through the router, by a probe process joined to serve's Ray, and
checked to be one of serve's descendants, so a test kills the right process), ``wait_idle()``
(every worker reports no used block and nothing running or queued, then every pool passes its
integrity check) and ``kill_worker(worker_id)`` (SIGKILL).

Nothing here sleeps to fix a race: waits follow the cluster's own pressure stream
(``WatchBlockPressure``) and end in a bounded timeout that fails the test.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import grpc
import psutil
import pytest

from kvserve.protos.kvserve.v1 import serving_pb2 as spb
from kvserve.protos.kvserve.v1 import serving_pb2_grpc
from tests.integration.test_serve import API_LINE, REPO, Proc, clean_env, kvserve_argv

NUM_WORKERS = 2
NUM_BLOCKS = 64  # per worker
START_TIMEOUT_S = 240.0  # Ray + two model loads on a loaded 2-core box
GCS_ADDRESS_ARG = re.compile(r"--gcs-address=(\S+)")  # on the raylet's command line (the GCS's own says port 0)
PROBE_TIMEOUT_S = 120.0


@dataclass
class ServedCluster:
    proc: Proc
    address: str
    model_dir: Path
    gcs_address: str
    num_workers: int = NUM_WORKERS
    metadata: tuple[tuple[str, str], ...] = ()  # e.g. an API key, for a cluster with --auth-keys
    _probe: subprocess.Popen | None = field(default=None, repr=False)
    _replies: queue.Queue[str | None] = field(default_factory=queue.Queue, repr=False)

    # ---- gRPC -----------------------------------------------------------------------------------
    def channel(self) -> grpc.Channel:
        return grpc.insecure_channel(self.address)

    def status(self) -> spb.ClusterStatus:
        with self.channel() as ch:
            return serving_pb2_grpc.KVServeStub(ch).GetClusterStatus(
                spb.ClusterStatusRequest(), timeout=30, metadata=self.metadata
            )

    def generate(self, request: spb.GenerateRequest, timeout: float = 120.0) -> list[spb.GenerateResponse]:
        with self.channel() as ch:
            return list(serving_pb2_grpc.KVServeStub(ch).Generate(request, timeout=timeout, metadata=self.metadata))

    def wait_idle(self, timeout: float = 60.0) -> spb.ClusterStatus:
        """Until every worker is healthy and reports 0 used blocks and nothing running, waiting or
        swapped, and the router queue is empty; then every worker's pool integrity must hold.

        Raises:
            AssertionError: not idle within ``timeout`` (the last status is in the message), or a
                pool integrity check failed.
        """
        last: spb.ClusterStatus | None = None
        with self.channel() as ch:
            watch = serving_pb2_grpc.KVServeStub(ch).WatchBlockPressure(
                spb.WatchRequest(interval_ms=200), timeout=timeout, metadata=self.metadata
            )
            try:
                for last in watch:
                    if _idle(last, self.num_workers):
                        break
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise
                raise AssertionError(f"cluster not idle after {timeout}s: {last}") from None
            finally:
                watch.cancel()
        broken = self._ask({"op": "integrity"})
        assert broken and all(v is None for v in broken.values()), f"pool integrity: {broken}"
        assert last is not None
        return last

    # ---- processes ------------------------------------------------------------------------------
    def worker_pid(self, worker_id: str) -> int:
        """The OS pid of ``worker_id``'s actor, asked of the actor itself (``Worker.pid``)."""
        pid = int(self._ask({"op": "pid", "worker_id": worker_id}))
        self.proc.note_descendants()
        assert pid in self.proc.descendants, f"{worker_id} pid {pid} is not a process serve started"
        return pid

    def kill_worker(self, worker_id: str) -> int:
        """SIGKILL the worker's process; returns the pid killed."""
        pid = self.worker_pid(worker_id)
        os.kill(pid, signal.SIGKILL)
        return pid

    def hang_worker(self, worker_id: str) -> int:
        """SIGSTOP the worker's process (alive to the OS and to Ray, never steps again until
        ``resume_pid``); returns the pid stopped."""
        pid = self.worker_pid(worker_id)
        os.kill(pid, signal.SIGSTOP)
        return pid

    @staticmethod
    def resume_pid(pid: int) -> bool:
        """SIGCONT a process stopped by ``hang_worker``; False if it is gone already (killed)."""
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            return False
        return True

    def arm_migration_fault(self, phase: str, action: str, side: str) -> None:
        """At the next migration's ``phase`` boundary the router SIGKILLs ("kill") or SIGSTOPs ("hang")
        the ``side`` ("src"/"dst") worker's process (``FaultRouter.arm_migration_fault``, through Ray:
        a cluster from ``serve_cluster(..., fault_router=True)``)."""
        self._ask({"op": "arm_migration_fault", "phase": phase, "action": action, "side": side})

    def migrate(self, request_id: str, dst: str) -> bool:
        """The router's live migration of ``request_id`` to ``dst``; whether it moved."""
        return bool(self._ask({"op": "migrate", "request_id": request_id, "dst": dst}))

    def owned_keys(self) -> list[str]:
        """The router's ids of the requests frontends own (a ``fault_router`` cluster's ``FaultRouter``)."""
        return list(self._ask({"op": "owned_keys"}))  # type: ignore[call-overload]

    def router_pid(self) -> int:
        """The OS pid of the router actor (the current one: serve may have restarted it)."""
        pid = int(self._ask({"op": "router_pid"}))
        self.proc.note_descendants()
        assert pid in self.proc.descendants, f"router pid {pid} is not a process serve started"
        return pid

    def integrity(self, worker_ids: list[str] | None = None) -> dict[str, str | None]:
        """Every worker's (or those named) pool integrity check: None (intact) or the error, by worker id."""
        command: dict = {"op": "integrity"} if worker_ids is None else {"op": "integrity", "worker_ids": worker_ids}
        return self._ask(command)  # type: ignore[return-value]

    def _ask(self, command: dict) -> object:
        if self._probe is None or self._probe.poll() is not None:
            self._probe = subprocess.Popen(
                [sys.executable, "-m", "tests.chaos.ray_probe", self.gcs_address],
                cwd=REPO, env=clean_env(RAY_AUTH_MODE="disabled"),
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
            )  # fmt: skip
            self._replies = queue.Queue()
            threading.Thread(target=_pump_lines, args=(self._probe.stdout, self._replies), daemon=True).start()
            self._read_reply()  # "ready"
        assert self._probe.stdin is not None
        self._probe.stdin.write(json.dumps(command) + "\n")
        self._probe.stdin.flush()
        return self._read_reply()

    def _read_reply(self) -> object:
        assert self._probe is not None
        try:
            line = self._replies.get(timeout=PROBE_TIMEOUT_S)
        except queue.Empty:
            self._probe.kill()
            raise AssertionError(f"ray probe gave no answer in {PROBE_TIMEOUT_S}s") from None
        if line is None:
            raise AssertionError(f"ray probe exited (rc={self._probe.poll()})")
        reply = json.loads(line)
        if not reply["ok"]:
            raise AssertionError(f"ray probe: {reply['error']}")
        return reply["value"]

    def close_probe(self) -> None:
        if self._probe is not None and self._probe.poll() is None:
            assert self._probe.stdin is not None
            self._probe.stdin.close()
            try:
                self._probe.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._probe.kill()
                self._probe.wait(timeout=10)


def _pump_lines(stream: IO[str], sink: queue.Queue[str | None]) -> None:
    for line in stream:
        if line.startswith("{"):  # NOTE: Ray may print to stdout too (e.g. when a node dies)
            sink.put(line)
    sink.put(None)  # EOF: the probe exited


def _idle(status: spb.ClusterStatus, num_workers: int = NUM_WORKERS) -> bool:
    r = status.router
    return (
        len(status.workers) == num_workers
        and all(
            w.healthy
            and w.report.used_blocks == 0
            and w.report.num_running == 0
            and w.report.num_waiting == 0
            and w.report.num_swapped == 0
            for w in status.workers
        )
        and r.queue_requests == 0
        and r.requests_in_flight == 0
    )


def _gcs_address(proc: Proc) -> str:
    proc.note_descendants()
    for p in proc.descendants.values():
        try:
            m = GCS_ADDRESS_ARG.search(" ".join(p.cmdline()))
        except psutil.Error:
            continue
        if m:
            return m.group(1)
    raise AssertionError("no process serve started names its GCS address (--gcs-address)")


def serve_cluster(
    model_dir: Path,
    *extra_args: str,
    num_workers: int = NUM_WORKERS,
    metadata: tuple[tuple[str, str], ...] = (),
    fault_router: bool = False,
) -> ServedCluster:
    """Start ``kvserve serve`` and wait for its API line (the caller must ``stop_cluster``).
    ``metadata`` goes with the fixture's own calls (status, wait_idle): an API key with --auth-keys.
    ``fault_router``: serve's router is the chaos tests' ``FaultRouter`` (tests/chaos/fault_router.py;
    the same serve through tests/chaos/fault_serve.py), so ``arm_migration_fault`` works."""
    flags = (
        "--model", str(model_dir), "--workers", str(num_workers), "--port", "0",
        "--metrics-port", "off", "--device", "cpu", "--num-gpu-blocks", str(NUM_BLOCKS), *extra_args,
    )  # fmt: skip
    proc = Proc(
        [sys.executable, "-m", "tests.chaos.fault_serve", *flags] if fault_router else kvserve_argv("serve", *flags),
        # NOTE: Ray's token auth off for this loopback-only cluster, so the probe can join it
        # (as in tests/integration/test_multinode.py).
        clean_env(RAY_AUTH_MODE="disabled"),
    )  # fmt: skip
    try:
        address = proc.wait_for_line(API_LINE, timeout=START_TIMEOUT_S).group(1)
        return ServedCluster(proc, address, model_dir, _gcs_address(proc), num_workers, metadata)
    except BaseException:
        proc.kill_tree()
        raise


def stop_cluster(cluster: ServedCluster) -> None:
    """SIGINT serve, as an operator would; kill what is left if it does not stop in time."""
    cluster.close_probe()
    proc = cluster.proc
    proc.note_descendants()
    if proc.popen.poll() is None:
        proc.popen.send_signal(signal.SIGINT)
        try:
            proc.popen.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill_tree()
    leftovers = proc.alive_descendants(timeout=15)
    if leftovers:
        proc.kill_tree()
        pytest.fail(f"serve left processes behind: {leftovers}")


@pytest.fixture(scope="module")
def served_cluster(tiny_llama_dir: Path) -> Iterator[ServedCluster]:
    """A 2-worker ``kvserve serve`` for the module; every test should leave it idle."""
    t0 = time.monotonic()
    cluster = serve_cluster(tiny_llama_dir)
    print(f"served cluster up in {time.monotonic() - t0:.1f}s at {cluster.address}")
    try:
        yield cluster
    finally:
        stop_cluster(cluster)
