"""The servers ``kvserve bench compare-serve`` puts side by side, as command lines, and their launch.

A ``Target`` is the processes one served setup needs, started in order (each waited for over HTTP
before the next) and one base URL that the client drives:

* ``kvserve``: ``kvserve serve --http-port P`` (layout flags passed through: ``--workers``,
  ``--cpus-per-worker``, anything in ``kvserve_args``); ready once ``/health`` answers 200 *and* its log
  says the HTTP API is up (printed after every worker's Hello: ``/health`` is 200 from the first one);
* ``vllm``: one ``vllm serve MODEL --dtype float32`` as a user would start it on a CPU;
* ``vllm-router``: two ``vllm serve`` engines pinned one core each (``VLLM_CPU_OMP_THREADS_BIND=0`` and
  ``=1``) behind vLLM's Rust router ``vllm-router`` (``round_robin`` for random prompts,
  ``cache_aware`` for prefix-heavy ones): the two-engine setup a user would build instead.

Every server gets the same served model name (what ``kvserve serve`` lists for ``--model``), so one
client command line works against all of them; ``launch`` checks that ``/v1/models`` lists it.
"""

from __future__ import annotations

import contextlib
import json
import sys
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvserve.cluster.bench.procs import ServerError, ServerProcess, free_port, wait_http_ready

HOST = "127.0.0.1"
KVSERVE_READY_LINE = "OpenAI-compatible HTTP API on"  # kvserve/cluster/serve_cli.py prints it once all workers are up
ROUTER_POLICIES = {"random": "round_robin", "prefix_repetition": "cache_aware"}


@dataclass(frozen=True)
class ProcSpec:
    """One server process of a target: its command, extra environment, and when it counts as ready."""

    name: str
    argv: list[str]
    port: int
    env: dict[str, str] = field(default_factory=dict)
    ready_path: str = "/health"
    log_marker: str | None = None  # a line that must be in its log too before it counts as ready
    # start the next process before waiting for this one (engines behind one router load side by side)
    start_with_next: bool = False

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"


@dataclass(frozen=True)
class Target:
    """A served setup: ``procs`` start in order; the client drives ``procs[-1]`` (the front server)."""

    name: str
    procs: list[ProcSpec]

    @property
    def base_url(self) -> str:
        return self.procs[-1].url


def kvserve_target(
    model: str, served_name: str, workers: int | None = None, cpus_per_worker: int | None = None,
    extra: Sequence[str] = (), python: str = sys.executable,
) -> Target:  # fmt: skip
    """``kvserve serve`` on a free HTTP port; gRPC on a free port and no metrics port, so that it does
    not collide with another cluster on the machine."""
    port = free_port()
    argv = [python, "-m", "kvserve.cluster.cli", "serve", "--model", model, "--http-port", str(port), "--port", "0",
            "--metrics-port", "off", "--served-model-name", served_name]  # fmt: skip
    if workers is not None:
        argv += ["--workers", str(workers)]
    if cpus_per_worker is not None:
        argv += ["--cpus-per-worker", str(cpus_per_worker)]
    argv += list(extra)
    return Target("kvserve", [ProcSpec("kvserve", argv, port, log_marker=KVSERVE_READY_LINE)])


def vllm_serve_spec(
    name: str, vllm: str, model: str, served_name: str, port: int, kv_cache_gib: float,
    extra: Sequence[str] = (), bind: str | None = None, start_with_next: bool = False,
) -> ProcSpec:  # fmt: skip
    """One ``vllm serve`` (fp32; ``bind``: ``VLLM_CPU_OMP_THREADS_BIND``, e.g. ``"0"`` for core 0)."""
    argv = [vllm, "serve", model, "--served-model-name", served_name, "--dtype", "float32",
            "--host", HOST, "--port", str(port), *extra]  # fmt: skip
    env = {"VLLM_CPU_KVCACHE_SPACE": f"{kv_cache_gib:g}"}
    if bind is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = bind
    return ProcSpec(name, argv, port, env, start_with_next=start_with_next)


def vllm_target(vllm: str, model: str, served_name: str, kv_cache_gib: float, extra: Sequence[str] = ()) -> Target:
    """One ``vllm serve`` with vLLM's default CPU binding."""
    return Target("vllm", [vllm_serve_spec("vllm", vllm, model, served_name, free_port(), kv_cache_gib, extra)])


def vllm_router_target(
    vllm: str, router: str, model: str, served_name: str, workload: str, kv_cache_gib: float,
    extra: Sequence[str] = (), cores: Sequence[str] = ("0", "1"),
) -> Target:  # fmt: skip
    """One ``vllm serve`` per entry of ``cores`` (pinned there; they load side by side), then ``vllm-router``
    in front of them once all are ready."""
    engines = [
        vllm_serve_spec(f"vllm-{i}", vllm, model, served_name, free_port(), kv_cache_gib, extra, bind=core,
                        start_with_next=i < len(cores) - 1)  # fmt: skip
        for i, core in enumerate(cores)
    ]
    port = free_port()
    argv = [router, "--host", HOST, "--port", str(port), "--policy", ROUTER_POLICIES[workload],
            "--worker-urls", *(e.url for e in engines)]  # fmt: skip
    return Target("vllm-router", [*engines, ProcSpec("vllm-router", argv, port, ready_path="/v1/models")])


def listed_models(base_url: str, timeout_s: float = 10.0) -> list[str]:
    """The ids ``GET /v1/models`` lists."""
    with urllib.request.urlopen(f"{base_url}/v1/models", timeout=timeout_s) as r:
        return [m.get("id") for m in json.load(r).get("data", [])]


@contextlib.contextmanager
def launch(target: Target, log_dir: Path, served_name: str, timeout_s: float) -> Iterator[str]:
    """Start ``target``'s processes (each waited for before the next), check ``/v1/models`` lists
    ``served_name``, yield the base URL; on leaving (also on error or Ctrl-C) stop them in reverse order.

    Raises:
        ServerError: a process exited or was not ready within ``timeout_s`` (the message names its log),
            or the front server does not list ``served_name``.
    """
    with contextlib.ExitStack() as stack:
        pending: list[tuple[ProcSpec, ServerProcess]] = []  # started, not yet waited for
        for spec in target.procs:
            log = log_dir / f"{spec.name}.log"
            pending.append((spec, stack.enter_context(ServerProcess(spec.name, spec.argv, log, spec.env))))
            if spec.start_with_next:
                continue
            for s, server in pending:
                wait_http_ready(server, s.url + s.ready_path, timeout_s, ready=_marker_seen(server, s.log_marker))
            pending.clear()
        names = listed_models(target.base_url)
        if served_name not in names:
            raise ServerError(f"{target.name} lists models {names}, not {served_name!r} (logs in {log_dir})")
        yield target.base_url


def _marker_seen(server: ServerProcess, marker: str | None):  # noqa: ANN202 - a predicate or None
    """A readiness predicate: ``marker`` is in the server's log (None when there is no marker)."""
    if marker is None:
        return None
    return lambda: marker in server.log_tail(chars=1 << 20)
