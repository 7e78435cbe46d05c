"""Where a served run's CPU goes: every process's CPU time over a client's run, summed by role.

``kvserve bench compare-serve`` wraps each client run in a ``CpuSampler``: it reads every process's
user + system time (``/proc/<pid>/stat``) when the client starts, again every ``interval_s`` (so that a
process that exits before the end still counts up to its last sample), and at the end, and sums the
differences by ``role``: the engine (kvserve's worker actors, vLLM's engine core), the serving stack in
front of it (kvserve's router, frontends and ``kvserve serve``; vLLM's API server and ``vllm-router``),
Ray's own daemons, the client, and everything else. Divided by the benchmark's duration this says how
much of the machine the engine got while it served, which is what separates an engine-bound run from a
serving-stack-bound one (issue 21: "where the time goes between the HTTP request and the engine step").

NOTE: the client's figure includes its own start-up (``vllm bench serve`` imports vLLM and tokenizes
its prompts before the first request); the servers are idle then, so their figures are the run's.
Linux only (``/proc``); elsewhere the sampler reports nothing.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _client(comm: str, cmd: str) -> bool:  # `vllm bench serve`; guidellm (its script, not an argument)
    return " bench serve" in cmd or any(os.path.basename(word) == "guidellm" for word in cmd.split()[:2])


def _engine(comm: str, cmd: str) -> bool:
    # kvserve's worker actors; vLLM's engine core and the model-running worker it starts (their titles,
    # "VLLM::EngineCore", "VLLM::Worker_TP0", which also name their comm, cut to 15 characters)
    return comm.startswith(("ray::Worker", "VLLM::EngineCor", "VLLM::Worker")) or cmd.startswith(
        ("VLLM::EngineCore", "VLLM::Worker")
    )


def _serving_stack(comm: str, cmd: str) -> bool:  # router, frontends, `kvserve serve`; vLLM's API server
    kvserve = comm.startswith(("ray::RouterActo", "ray::FrontendAc")) or "kvserve.cluster.cli serve" in cmd
    vllm = "APIServer" in cmd or "vllm serve" in cmd or comm == "vllm-router"
    return kvserve or "kvserve serve" in cmd or vllm


def _ray_daemons(comm: str, cmd: str) -> bool:
    return comm.startswith("ray::") or comm in ("raylet", "gcs_server") or "/site-packages/ray/" in cmd


# First match wins: the client before the vLLM server (its command line says "vllm bench serve"), the
# engine and the serving stack before the generic Ray processes they run in.
ROLES: tuple[tuple[str, Callable[[str, str], bool]], ...] = (
    ("client", _client),
    ("engine", _engine),
    ("serving stack", _serving_stack),
    ("ray daemons", _ray_daemons),
)
OTHER = "other"
TOP_PROCESSES = 20
ROLE_NAMES = (*(name for name, _ in ROLES), OTHER)


def role(comm: str, cmdline: str) -> str:
    """The role of a process from its ``comm`` (15 characters at most) and command line."""
    for name, test in ROLES:
        if test(comm, cmdline):
            return name
    return OTHER


class ProcessCpu(NamedTuple):
    """One process at one moment."""

    seconds: float  # user + system CPU time so far
    started: int  # start time in clock ticks since boot: tells a reused pid apart
    comm: str
    cmdline: str


def _read(pid: str) -> ProcessCpu | None:
    """One process's ``ProcessCpu``, or None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None
    head, _, rest = stat.rpartition(")")
    fields = rest.split()  # state, ppid, ...: utime, stime are the 12th and 13th after the comm, starttime the 20th
    try:
        seconds, started = (int(fields[11]) + int(fields[12])) / _TICKS, int(fields[19])
    except (IndexError, ValueError):
        return None
    return ProcessCpu(seconds, started, head.partition("(")[2], cmdline)


def snapshot() -> dict[int, ProcessCpu]:
    """Every live process by pid (empty off Linux)."""
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return {}
    out = {}
    for pid in pids:
        got = _read(pid)
        if got is not None:
            out[int(pid)] = got
    return out


def merge(seen: dict[int, ProcessCpu], now: dict[int, ProcessCpu]) -> None:
    """Update ``seen`` with ``now``, keeping what named a process: an exited process not yet reaped (a
    zombie) still reports its CPU time but has lost its command line."""
    for pid, p in now.items():
        before = seen.get(pid)
        if not p.cmdline and before is not None and before.started == p.started:
            p = p._replace(comm=before.comm, cmdline=before.cmdline)
        seen[pid] = p


def by_process(first: dict[int, ProcessCpu], last: dict[int, ProcessCpu]) -> list[tuple[float, str, ProcessCpu]]:
    """``(CPU seconds, role, process)`` between two snapshots, most CPU first (a process new in ``last``
    counts from 0: it started since; a reused pid is a new process). The role is read from ``last``
    (set-up may retitle a process)."""
    out = []
    for pid, now in last.items():
        before = first.get(pid)
        spent = now.seconds - before.seconds if before is not None and before.started == now.started else now.seconds
        out.append((max(spent, 0.0), role(now.comm, now.cmdline), now))
    return sorted(out, key=lambda row: -row[0])


# The serving stack's parts that issue 41 measures per streamed token, by the comm of their processes.
STACK_PARTS = (("router", "ray::RouterActo"), ("frontends", "ray::FrontendAc"))


def by_stack_part(first: dict[int, ProcessCpu], last: dict[int, ProcessCpu]) -> dict[str, float]:
    """CPU seconds of kvserve's router and of its frontends (all of them) between two snapshots."""
    out = dict.fromkeys((name for name, _ in STACK_PARTS), 0.0)
    for spent, _, p in by_process(first, last):
        for name, comm in STACK_PARTS:
            if p.comm.startswith(comm):
                out[name] += spent
    return out


def by_role(first: dict[int, ProcessCpu], last: dict[int, ProcessCpu]) -> dict[str, float]:
    """CPU seconds per role between two snapshots (see ``by_process``)."""
    out = dict.fromkeys(ROLE_NAMES, 0.0)
    for spent, name, _ in by_process(first, last):
        out[name] += spent
    return out


@dataclass
class CpuSampler:
    """CPU seconds by role between ``start()`` and ``stop()`` (or over a ``with`` block)."""

    interval_s: float = 0.5

    def __post_init__(self) -> None:
        self._first: dict[int, ProcessCpu] = {}
        self._seen: dict[int, ProcessCpu] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.cpu_seconds: dict[str, float] = {}
        self.stack_seconds: dict[str, float] = {}  # kvserve's router and frontends (``by_stack_part``)
        self.processes: list[dict] = []  # the busiest processes, for the log: what each role holds

    def start(self) -> CpuSampler:
        self._first = snapshot()
        self._seen = dict(self._first)
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            merge(self._seen, snapshot())

    def stop(self) -> dict[str, float]:
        """CPU seconds per role since ``start()`` (also kept in ``cpu_seconds``)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        merge(self._seen, snapshot())
        self.cpu_seconds = by_role(self._first, self._seen)
        self.stack_seconds = by_stack_part(self._first, self._seen)
        # NOTE: the busiest processes, and every client whatever its rank: on a machine busy with other
        # work the benchmark's own client must still be there to read.
        self.processes = [
            {"cpu_s": round(spent, 2), "role": name, "comm": p.comm, "cmdline": p.cmdline[:160]}
            for rank, (spent, name, p) in enumerate(by_process(self._first, self._seen))
            if spent > 0 and (rank < TOP_PROCESSES or name == "client")
        ]
        return self.cpu_seconds

    def __enter__(self) -> CpuSampler:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
