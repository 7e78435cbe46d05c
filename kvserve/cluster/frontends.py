"""Start the stateless frontends of ``kvserve serve --frontends N`` (``kvserve/frontend/server.py``).

Each frontend is a Ray actor on this node (the router's), ``num_cpus=0`` like the router, named
``kvserve-frontend-<i>``, with ``max_restarts=-1``: Ray starts a killed frontend's process again and
it serves at once (it binds in its constructor). Why Ray actors rather than child processes: the
same supervision the workers get (restart, death detection, cleanup with the cluster), with no
second supervisor loop in ``serve``; ``kvserve frontend`` runs the same server as a plain process
where something else supervises it (a Kubernetes Deployment).

Ports: every frontend binds the same gRPC port and the same HTTP port with ``SO_REUSEPORT``; the
kernel spreads new connections over the live listeners, so one frontend's death costs only the
connections it held, and a client that reconnects lands on a live one. Port 0 is resolved to one
free port first, then given to all of them. Each frontend's data service (the workers' data links,
docs/architecture.md section 2a) is on a port of its own (a free one), advertised at this node's
address for a wildcard bind, as the launcher advertises the router's WorkerLink.
"""

from __future__ import annotations

import os
import socket
from typing import Any

from kvserve.router.config import RouterConfig

FRONTEND_START_TIMEOUT_S = 120.0
FRONTEND_NAME = "kvserve-frontend-{}"


def frontend_key(needed: bool) -> str | None:
    """The cluster's frontend key: ``$KVSERVE_FRONTEND_KEY`` when set (a Kubernetes Secret shared with
    frontends deployed apart, ``kvserve frontend``), else a fresh random one when this launcher
    starts frontends itself (``needed``), else None (the router trusts no frontend)."""
    from kvserve.frontend.server import FRONTEND_KEY_ENV

    return os.environ.get(FRONTEND_KEY_ENV) or (os.urandom(32).hex() if needed else None)


def start_frontends(
    n: int,
    router_config: RouterConfig,
    router_address: str,
    grpc_port: int,
    http_port: int | None,
    key: str,
    link_tls: tuple[str | None, str | None, str | None] = (None, None, None),
    owned_streams: bool = True,
) -> tuple[list[Any], int, int | None]:
    """Start ``n`` frontends relaying to ``router_address`` (over TLS with ``link_tls``, as the
    workers' WorkerLinks: ``FrontendSettings``); returns (handles, gRPC port, HTTP port). With a
    ``key`` and ``owned_streams`` they own their requests (their workers stream to them directly).

    Raises:
        Exception: one did not start (the ones started are killed).
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from kvserve.frontend.server import FrontendSettings, frontend_actor_class

    if grpc_port == 0:
        grpc_port = _free_port(router_config.host)
    if http_port == 0:
        http_port = _free_port(router_config.host)
    here = ray.get_runtime_context().get_node_id()
    data_host = data_advertise_host(router_config.host)
    actor = frontend_actor_class()
    handles: list[Any] = []
    try:
        for i in range(n):
            settings = FrontendSettings(router_address, router_config, grpc_port, http_port, f"frontend-{i}", key,
                                        link_tls, owned_streams=owned_streams, data_host=data_host)  # fmt: skip
            handles.append(actor.options(
                name=FRONTEND_NAME.format(i), max_restarts=-1, max_task_retries=0,
                scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False),
            ).remote(settings))  # fmt: skip
        for h in handles:
            ray.get(h.ports.remote(FRONTEND_START_TIMEOUT_S), timeout=FRONTEND_START_TIMEOUT_S + 30)
    except BaseException:
        stop_frontends(handles)
        raise
    return handles, grpc_port, http_port


def data_advertise_host(bind_host: str) -> str | None:
    """Where workers dial the frontends' data services: this node's Ray address for a wildcard bind (the
    frontends run on this node), else None (the bind address itself: ``FrontendSettings.data_host``)."""
    import ray

    return ray.util.get_node_ip_address() if bind_host in ("0.0.0.0", "::") else None


def stop_frontends(handles: list[Any]) -> None:
    """Stop and kill every frontend (best effort, bounded)."""
    import ray

    for h in handles:
        try:
            ray.get(h.stop.remote(), timeout=10)
        except Exception:  # noqa: BLE001 - best effort on the way down
            pass
        ray.kill(h, no_restart=True)


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
