"""``kvserve serve`` (a long-running cluster) and ``kvserve demo`` (see ``kvserve/cluster/demo.py``).

``serve`` starts a local Ray (or joins one with ``--address``), brings up the router and the
workers (one per GPU, or N CPU workers), waits for every worker's Hello, prints where the API and
the metrics listen (one line each, on stdout) and serves until SIGINT/SIGTERM, then stops the
workers and the router, and Ray if it started it.

Settings come from ``--config cluster.yaml`` (``kvserve/cluster/config.py``) with flags on top; a flag
left out keeps the file's value (flags default to "unset", never to a value that would mask it).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from kvserve.cluster.launch import init_ray
from kvserve.cluster.process_signals import signals_as_keyboard_interrupt, stop_all

logger = logging.getLogger(__name__)


class _Unset:
    """Default of every serve flag: 'not given on the command line' (the YAML value stands)."""

    def __repr__(self) -> str:
        return "(from --config or the default)"


UNSET: Any = _Unset()

# Flag groups of ``serve``: (group title, cluster.yaml section or None for the top level, flag prefix).
# Every flag is generated from its config dataclass (kvserve/workers/core/knobs.py); the dest is "section.key".
_FLAG_GROUPS = (
    ("cluster", None, ""),
    ("router", "router", ""),
    ("engine", "engine", ""),
    ("worker", "worker", "worker"),
)


def _section_classes() -> dict[str | None, type]:
    from kvserve.cluster.config import ClusterConfig
    from kvserve.router.config import RouterConfig
    from kvserve.workers.engine.config import EngineConfig
    from kvserve.workers.transport.options import WorkerOptions

    return {None: ClusterConfig, "router": RouterConfig, "engine": EngineConfig, "worker": WorkerOptions}


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """Every ``kvserve serve`` flag, one per config field (defaults: UNSET, so the YAML value or the default stands).

    Flags: the cluster's top-level keys (``--model``, ``--workers``, ...), the router's and the
    engine's fields under their own names (``--placement-policy``, ``--block-size``), the worker's
    with a ``--worker-`` prefix (``--worker-stall-timeout-s``).
    """
    from kvserve.workers.core.knobs import add_arguments

    p.add_argument("--config", default=None, help="cluster.yaml (see kvserve/cluster/config.py); flags override it")
    classes = _section_classes()
    flags: dict[str, tuple[str | None, str]] = {}
    for title, section, prefix in _FLAG_GROUPS:
        group = p.add_argument_group(title)
        dests = add_arguments(
            group,
            classes[section],
            prefix=prefix,
            dest_prefix=f"{section}." if section else "",
            unset=UNSET,
            environ=os.environ,
        )
        flags.update({dest: (section, key) for dest, key in dests.items()})
    p.set_defaults(knob_flags=flags)


def overrides_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The flags given on the command line, shaped like cluster.yaml (ClusterConfig.load overrides)."""
    out: dict[str, Any] = {}
    for dest, (section, key) in getattr(args, "knob_flags", {}).items():
        value = getattr(args, dest, UNSET)
        if value is UNSET:
            continue
        (out.setdefault(section, {}) if section else out)[key] = value
    return out


def config_from_args(args: argparse.Namespace):
    """ClusterConfig from ``--config`` plus the flags; ValueError names a bad key."""
    from kvserve.cluster.config import ClusterConfig

    return ClusterConfig.load(args.config, overrides_from_args(args))


ROUTER_POLL_TIMEOUT_S = 10.0  # one liveness poll of the router (it answers from its tables)
ROUTER_UNRESPONSIVE_POLLS = 3  # consecutive timed-out polls before an alive router is replaced
RESTART_RETRY_S = 2.0  # wait before trying again when a new router failed to start


def supervise_router(cluster: Any, out: Any, poll_s: float) -> None:
    """Poll the router until interrupted; replace it when it dies or stops answering.

    NOTE: nothing here stops the cluster: a router that died, hangs or fails to restart is
    replaced (again, after ``RESTART_RETRY_S``) while the workers keep running; clients of the
    dead router get UNAVAILABLE and retry (kvserve/cluster/client.py). Only SIGINT/SIGTERM end serve.
    """
    from kvserve.cluster.launch import RouterPoll

    unresponsive = 0
    while True:
        time.sleep(poll_s)
        poll = cluster.poll_router(ROUTER_POLL_TIMEOUT_S)
        if poll is RouterPoll.ALIVE:
            unresponsive = 0
            continue
        if poll is RouterPoll.UNRESPONSIVE:
            unresponsive += 1
            if unresponsive < ROUTER_UNRESPONSIVE_POLLS:
                continue
            logger.warning("router did not answer %d polls of %.0fs; replacing it", unresponsive,
                           ROUTER_POLL_TIMEOUT_S)  # fmt: skip
        else:
            logger.warning("router died; restarting it")
        try:
            missing = cluster.restart_router()
        except Exception as e:  # noqa: BLE001 - try again: the workers are fine meanwhile
            logger.error("router restart failed (%s); trying again in %.0fs", e, RESTART_RETRY_S)
            time.sleep(RESTART_RETRY_S)
            continue
        unresponsive = 0
        retired = sorted(w for w, record in cluster.supervision.items() if record.retired)
        note = f"; retired: {', '.join(retired)}" if retired else ""
        note += f"; not reconnected yet: {', '.join(missing)}" if missing else ""
        note += f"; in {cluster.last_restart_s}" if cluster.last_restart_s and not missing else ""
        print(f"kvserve: router restarted ({cluster.router_restarts}); API listening on {cluster.address}{note}",
              file=out)  # fmt: skip
        out.flush()


def serve(cfg, *, out=None, poll_s: float = 0.5, router_actor: type | None = None) -> int:  # noqa: ANN001 - ClusterConfig
    """Run a cluster for ``cfg`` until SIGINT/SIGTERM. Returns the exit status.

    ``router_actor``: ``start_cluster``'s seam (None: ``RouterActor``); tests/chaos/fault_serve.py passes
    the chaos tests' router."""
    import ray

    from kvserve.cluster.config import ROUTER_ACTOR_NAME
    from kvserve.cluster.launch import start_cluster

    out = out or sys.stdout
    cluster = None
    started_ray = False
    status = 0
    with signals_as_keyboard_interrupt() as reinstall_signal_handlers:
        try:
            guess = cfg.workers if cfg.workers != "auto" else 2
            # NOTE: a tensor-parallel worker's ranks take cpus_per_worker each (kvserve/cluster/launch.py)
            cpus = guess * cfg.cpus_per_worker * cfg.engine.tensor_parallel_size
            started_ray = init_ray(cfg.address, num_cpus=max(os.cpu_count() or 1, cpus))
            reinstall_signal_handlers()
            gpus = int(ray.cluster_resources().get("GPU", 0))
            n = cfg.num_workers(gpus)
            use_gpus = cfg.use_gpus(gpus)
            logger.info("starting %d %s workers", n, "GPU" if use_gpus else "CPU")
            cluster = start_cluster(
                cfg.engine,
                n,
                cfg.router,
                metrics_port=cfg.metrics_port,
                cpus_per_worker=cfg.cpus_per_worker,
                use_gpus=use_gpus,
                worker_options=cfg.worker_options(),
                name=ROUTER_ACTOR_NAME,
                ready_timeout_s=cfg.ready_timeout_s,
                spread=cfg.spread,
                http_port=cfg.http_port,
                frontends=cfg.frontends,
                frontend_port=cfg.frontend_port,
                worker_link_address=cfg.worker_link_address,
                router_actor=router_actor,
            )
            names = ", ".join(cluster.workers)
            print(f"kvserve: API listening on {cluster.address} (gRPC kvserve.v1.KVServe; workers: {names})", file=out)
            if cluster.metrics_port is not None:
                print(f"kvserve: metrics listening on http://{cfg.host}:{cluster.metrics_port}/metrics", file=out)
            else:
                print("kvserve: metrics off", file=out)
            if cluster.frontends:
                print(f"kvserve: {len(cluster.frontends)} frontends serving gRPC kvserve.v1.KVServe on "
                      f"{cfg.host}:{cluster.frontend_port}", file=out)  # fmt: skip
            if cluster.http_port is not None:
                scheme = "https" if cfg.router.tls_cert else "http"
                print(f"kvserve: OpenAI-compatible HTTP API on {scheme}://{cfg.host}:{cluster.http_port}/v1", file=out)
            out.flush()
            supervise_router(cluster, out, poll_s)
        except KeyboardInterrupt as e:
            logger.info("%s: shutting down", e.args[0] if e.args else "SIGINT")
        except Exception as e:  # noqa: BLE001 - reported, then everything is stopped
            logger.debug("serve failed", exc_info=True)
            print(f"error: {e}", file=sys.stderr)
            status = 1
        finally:
            stop_all(cluster, started_ray)
    logger.info("stopped")
    return status


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        cfg = config_from_args(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from kvserve.workers.models.gguf_checkpoint import find_gguf

    try:
        gguf = find_gguf(cfg.model)
    except ValueError as e:
        print(f"error: model: {e}", file=sys.stderr)
        return 2
    if gguf is None and not (Path(cfg.model) / "config.json").is_file():
        print(f"error: model: {cfg.model} has no config.json (an HF model directory) nor a .gguf file", file=sys.stderr)
        return 2
    return serve(cfg)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="run a serving cluster (router + workers) until SIGINT/SIGTERM",
        description=(
            "Start (or join) Ray, bring up the router and one worker per GPU (or N CPU workers), print "
            "where the gRPC API and the metrics listen, and serve until SIGINT/SIGTERM. Flags override --config."
        ),
    )
    add_serve_arguments(p)
    p.set_defaults(func=cmd_serve)

    from kvserve.cluster import demo

    demo.register(sub)
