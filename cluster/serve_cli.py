"""``kvserve serve`` (a long-running cluster) and ``kvserve demo`` (see ``cluster/demo.py``).

``serve`` starts a local Ray (or joins one with ``--address``), brings up the router and the
workers (one per GPU, or N CPU workers), waits for every worker's Hello, prints where the API and
the metrics listen (one line each, on stdout) and serves until SIGINT/SIGTERM, then stops the
workers and the router, and Ray if it started it.

Settings come from ``--config cluster.yaml`` (``cluster/config.py``) with flags on top; a flag
left out keeps the file's value (flags default to "unset", never to a value that would mask it).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


class _Unset:
    """Default of every serve flag: 'not given on the command line' (the YAML value stands)."""

    def __repr__(self) -> str:
        return "(from --config or the default)"


UNSET: Any = _Unset()

# Engine flags (cluster/cli.py) whose dest differs from the EngineConfig field, with the mapping.
_ENGINE_FLAG_FIELDS = {"no_prefix_caching": ("enable_prefix_caching", lambda v: not v)}
# serve flags -> (section or None for the top level, key)
_SERVE_FLAGS = {
    "model": (None, "model"),
    "address": (None, "address"),
    "workers": (None, "workers"),
    "port": (None, "port"),
    "metrics_port": (None, "metrics_port"),
    "host": (None, "host"),
    "cpus_per_worker": (None, "cpus_per_worker"),
    "spread": (None, "spread"),
    "ready_timeout": (None, "ready_timeout_s"),
    "auth_token": ("router", "auth_token"),
    "tls_cert": ("router", "tls_cert"),
    "tls_key": ("router", "tls_key"),
    "tls_client_ca": ("router", "tls_client_ca"),
    "placement_policy": ("router", "placement_policy"),
}


def _workers_arg(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer or 'auto', got {text!r}") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer or 'auto', got {text!r}")
    return n


def _address_arg(text: str) -> str | None:
    return None if text in ("local", "") else text


def _metrics_port_arg(text: str) -> int | None:
    if text.lower() in ("off", "none"):
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number or 'off', got {text!r}") from None


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """Every ``kvserve serve`` flag (defaults: UNSET, so the YAML value or the default stands)."""
    from cluster.cli import _add_engine_arguments
    from router.placement import PlacementPolicy

    g = p.add_argument_group("cluster")
    g.add_argument("--model", help="HF model directory (the same path on every node)")
    g.add_argument("--config", default=None, help="cluster.yaml (see cluster/config.py); flags override it")
    g.add_argument("--address", type=_address_arg, help="Ray to join: auto | HOST:PORT (default: start a local Ray)")
    g.add_argument("--workers", type=_workers_arg, help="N | auto (default: one per GPU, else 2 CPU workers)")
    g.add_argument("--host", help="bind address of the API and metrics (default: 127.0.0.1)")
    g.add_argument("--port", type=int, help="gRPC port of the API (default: 50051; 0 = pick a free one)")
    g.add_argument(
        "--metrics-port", type=_metrics_port_arg, help="Prometheus /metrics port (default: 9400; 0 = free; off)"
    )
    g.add_argument("--cpus-per-worker", type=int, help="Ray CPUs and torch threads per CPU worker (default: 1)")
    g.add_argument("--spread", action="store_true", help="place workers on distinct nodes (placement group SPREAD)")
    g.add_argument("--ready-timeout", type=float, help="seconds to wait for every worker's Hello (default: 600)")
    r = p.add_argument_group("router")
    r.add_argument(
        "--auth-token",
        default=os.environ.get("KVSERVE_AUTH_TOKEN") or UNSET,
        help="require 'authorization: Bearer TOKEN' (default: $KVSERVE_AUTH_TOKEN)",
    )
    r.add_argument("--tls-cert", help="PEM server certificate (TLS)")
    r.add_argument("--tls-key", help="PEM server key")
    r.add_argument("--tls-client-ca", help="PEM CA: require client certificates (mTLS)")
    r.add_argument("--placement-policy", choices=[x.value for x in PlacementPolicy])
    before = set(vars(p.parse_known_args([])[0]))
    _add_engine_arguments(p)
    engine_dests = sorted(set(vars(p.parse_known_args([])[0])) - before)
    defaults: dict[str, Any] = {dest: UNSET for dest in engine_dests}
    defaults.update({dest: UNSET for dest in _SERVE_FLAGS if dest != "auth_token"})
    p.set_defaults(**defaults, engine_flags=tuple(engine_dests))


def overrides_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The flags given on the command line, shaped like cluster.yaml (ClusterConfig.load overrides)."""
    out: dict[str, Any] = {}
    for dest, (section, key) in _SERVE_FLAGS.items():
        value = getattr(args, dest, UNSET)
        if value is UNSET or (dest == "spread" and value is False):
            continue
        (out.setdefault(section, {}) if section else out)[key] = value
    for dest in getattr(args, "engine_flags", ()):
        value = getattr(args, dest, UNSET)
        if value is UNSET:
            continue
        key, convert = _ENGINE_FLAG_FIELDS.get(dest, (dest, lambda v: v))
        out.setdefault("engine", {})[key] = convert(value)
    return out


def config_from_args(args: argparse.Namespace):
    """ClusterConfig from ``--config`` plus the flags; ValueError names a bad key."""
    from cluster.config import ClusterConfig

    return ClusterConfig.load(args.config, overrides_from_args(args))


@contextmanager
def signals_as_keyboard_interrupt() -> Iterator[Callable[[], None]]:
    """SIGTERM behaves like SIGINT (KeyboardInterrupt) inside the block; the old handlers come back after.

    Yields ``reinstall``: call it after ``ray.init``. NOTE: Ray's core worker installs its own
    (C++) SIGTERM handler, which would end the process at once, leaving the actors unstopped.
    """

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    def install() -> None:
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, interrupt)

    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    install()
    try:
        yield install
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)


@contextmanager
def signals_ignored() -> Iterator[None]:
    """Shutdown must finish: a second Ctrl-C must not leave half-stopped actors behind."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    for s in saved:
        signal.signal(s, signal.SIG_IGN)
    try:
        yield
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)


def stop_all(cluster: Any, started_ray: bool) -> None:
    """Stop the cluster, then the Ray this process started; signals are held off meanwhile."""
    import ray

    with signals_ignored():
        if cluster is not None:
            cluster.shutdown()
        if started_ray and ray.is_initialized():
            ray.shutdown()


def init_ray(address: str | None, num_cpus: int | None = None, **kwargs: Any) -> bool:
    """Start a local Ray (``address`` None) or join one; True if this process started it.

    NOTE: a local start passes ``address="local"``: a bare ``ray.init()`` would join whatever
    cluster ``ray start`` last recorded in /tmp/ray, which is not what "start a local Ray" means.
    """
    import ray

    from cluster.config import RAY_NAMESPACE

    if ray.is_initialized():
        return False
    kwargs.setdefault("logging_level", logging.WARNING)
    kwargs.setdefault("namespace", RAY_NAMESPACE)
    if address is None:
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, **kwargs)
        return True
    ray.init(address=address, **kwargs)
    return False


def serve(cfg, *, out=None, poll_s: float = 5.0) -> int:  # noqa: ANN001 - ClusterConfig
    """Run a cluster for ``cfg`` until SIGINT/SIGTERM. Returns the exit status."""
    import ray

    from cluster.config import ROUTER_ACTOR_NAME
    from cluster.launch import start_cluster

    out = out or sys.stdout
    cluster = None
    started_ray = False
    status = 0
    with signals_as_keyboard_interrupt() as reinstall_signal_handlers:
        try:
            guess = cfg.workers if cfg.workers != "auto" else 2
            started_ray = init_ray(cfg.address, num_cpus=max(os.cpu_count() or 1, guess * cfg.cpus_per_worker))
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
            )
            names = ", ".join(cluster.workers)
            print(f"kvserve: API listening on {cluster.address} (gRPC kvserve.v1.KVServe; workers: {names})", file=out)
            if cluster.metrics_port is not None:
                print(f"kvserve: metrics listening on http://{cfg.host}:{cluster.metrics_port}/metrics", file=out)
            else:
                print("kvserve: metrics off", file=out)
            out.flush()
            failures = 0
            while True:
                time.sleep(poll_s)
                try:  # the router is the cluster: if it is gone, so is serving (let a supervisor restart us)
                    ray.get(cluster.router.address.remote(), timeout=30)
                    failures = 0
                except ray.exceptions.GetTimeoutError:
                    failures += 1
                    if failures >= 3:
                        raise
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
    from workers.gguf_checkpoint import find_gguf

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

    from cluster import demo

    demo.register(sub)
