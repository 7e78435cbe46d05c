"""Start (or join) a Ray cluster and bring up the router plus N workers.

The router actor goes on the node that runs this code (the head, in a deployment), so its gRPC
and metrics ports are where a Kubernetes Service or a user expects them. Workers get one GPU each
on CUDA clusters, or ``cpus_per_worker`` CPUs (and as many torch threads) otherwise. With
``spread=True`` the workers go into one placement group (strategy SPREAD: distinct nodes where
there are enough), so a multi-node cluster serves from all of its nodes.

Supervision (README "Failure behaviour"): worker actors have Ray ``max_restarts=-1``: Ray starts a
killed worker's process again with the same arguments, and its new incarnation says Hello to the
router, which takes it back with an empty pool (or retires it if it crash-loops: the router kills
it with ``no_restart``). The router actor is restarted by ``kvserve serve``
(``Cluster.restart_router``), on the same port, and re-registers the workers, which reconnect on
their own.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from router.config import RouterConfig
from workers.core.worker_credential import issue_worker_credential, new_worker_key
from workers.engine.config import EngineConfig
from workers.transport.options import WorkerOptions

logger = logging.getLogger(__name__)


def init_ray(address: str | None, num_cpus: int | None = None, **kwargs: Any) -> bool:
    """Start a local Ray (``address`` None) or join one; True if this process started it.

    The one Ray start-up of kvserve (``serve``, ``demo`` and ``start_cluster`` all come here), so
    ``address=None`` means the same everywhere.

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


@dataclass
class Cluster:
    """Handles to a running router and its workers."""

    router: Any
    workers: dict[str, Any]
    address: str  # router's gRPC host:port
    metrics_port: int | None = None
    owns_ray: bool = False
    placement_group: Any = None  # the workers' placement group (spread=True), removed on shutdown
    http_port: int | None = None  # the OpenAI-compatible HTTP API's port (None = off)
    router_config: RouterConfig | None = None  # as started (its port the bound one), for a restart
    router_name: str | None = None
    router_restarts: int = 0
    # NOTE: the cluster's worker key: the router verifies worker credentials with it, and a
    # restarted router needs the same one (the workers keep theirs). Never given to a worker.
    worker_key: str = field(default="", repr=False)
    _stopped: bool = field(default=False, repr=False)

    def restart_router(self, ready_timeout_s: float = 300.0) -> None:
        """Start a new router actor (same name, same port) after the old one died, register the
        workers with it and wait for their WorkerLinks (they reconnect with backoff).

        Raises:
            Exception: the new router did not start, or the workers did not reconnect in time.
        """
        import ray

        assert self.router_config is not None
        try:
            ray.kill(self.router)  # NOTE: frees the name should the old one linger half-dead
        except Exception:  # noqa: BLE001 - already gone
            pass
        self.router, _ = _start_router(
            self.router_config, self.metrics_port, self.router_name, self.http_port, self.worker_key
        )
        _register_workers(self.router, self.workers, ready_timeout_s)
        self.router_restarts += 1

    def shutdown(self) -> None:
        """Stop workers and router (and Ray, if this process started it). Idempotent."""
        import ray

        if self._stopped:
            return
        self._stopped = True
        for handle in self.workers.values():
            try:
                ray.get(handle.shutdown.remote(), timeout=10)
            except Exception:  # noqa: BLE001 - best effort on the way down
                pass
            ray.kill(handle)
        try:
            ray.get(self.router.stop.remote(), timeout=10)
        except Exception:  # noqa: BLE001
            pass
        ray.kill(self.router)
        if self.placement_group is not None:
            try:
                ray.util.remove_placement_group(self.placement_group)
            except Exception:  # noqa: BLE001
                pass
        if self.owns_ray:
            ray.shutdown()


def start_cluster(
    engine_config: EngineConfig,
    num_workers: int,
    router_config: RouterConfig | None = None,
    *,
    address: str | None = None,
    metrics_port: int | None = None,
    cpus_per_worker: int = 1,
    use_gpus: bool | None = None,
    worker_options: WorkerOptions | None = None,
    name: str | None = None,
    ready_timeout_s: float = 300.0,
    spread: bool = False,
    http_port: int | None = None,
) -> Cluster:
    """Bring up a serving cluster; returns once every worker's WorkerLink has said Hello.

    Args:
        engine_config: every worker's engine.
        num_workers: worker actors to start.
        router_config: the router's (host, port, auth, TLS, queue, placement...).
        address: Ray address to join ("auto", "host:port"); None starts a local Ray (``init_ray``)
            unless this process already runs one.
        metrics_port: serve Prometheus ``/metrics`` here (None = off, 0 = a free port, see
            ``Cluster.metrics_port``).
        use_gpus: one GPU per worker; None = when the Ray cluster has GPUs.
        name: name the router actor (detached) so ``kvserve status`` and a restarted CLI find it.
        spread: place the workers on distinct nodes where possible (placement group, SPREAD).
        http_port: serve the OpenAI-compatible HTTP API here too (None = off, 0 = a free port, see
            ``Cluster.http_port``).
    """
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from workers.transport.worker import worker_actor_class

    if num_workers <= 0:
        raise ValueError(f"num_workers must be positive, got {num_workers}")
    router_config = router_config or RouterConfig(model=engine_config.model)
    if router_config.auth_keys:  # NOTE: the router actor reads it; its working directory may differ
        router_config = dataclasses.replace(router_config, auth_keys=str(Path(router_config.auth_keys).resolve()))
    owns_ray = init_ray(address)
    if use_gpus is None:
        use_gpus = ray.cluster_resources().get("GPU", 0) >= 1
    if metrics_port == 0:
        metrics_port = _free_port(router_config.host)  # the router runs on this node
    worker_key = new_worker_key()
    try:
        router, http_port = _start_router(router_config, metrics_port, name, http_port, worker_key)
    except BaseException:
        if owns_ray:
            ray.shutdown()
        raise
    router_address = ray.get(router.address.remote())
    bound_config = dataclasses.replace(router_config, port=int(router_address.rsplit(":", 1)[1]))
    link_address = router_address
    if router_config.host in ("0.0.0.0", "::"):
        link_address = f"{ray.util.get_node_ip_address()}:{router_address.rsplit(':', 1)[1]}"
    base = worker_options or WorkerOptions()
    actor = worker_actor_class()
    workers: dict[str, Any] = {}
    resources = {"num_gpus": 1, "num_cpus": 1} if use_gpus else {"num_cpus": cpus_per_worker}
    pg = None
    if spread:
        bundle = {"GPU": 1, "CPU": 1} if use_gpus else {"CPU": cpus_per_worker}
        pg = ray.util.placement_group([dict(bundle) for _ in range(num_workers)], strategy="SPREAD")
    worker_ids = [f"worker-{i}" for i in range(num_workers)]
    ray.get(router.expect_workers.remote(worker_ids))
    for i, worker_id in enumerate(worker_ids):
        options = worker_options_for(base, worker_id, worker_key, link_address)
        # NOTE: Ray restarts a dead worker forever; the router retires one that crash-loops.
        opts: dict[str, Any] = dict(resources, max_restarts=-1)
        if pg is not None:
            opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i)
        workers[worker_id] = actor.options(**opts).remote(
            worker_id, engine_config, options, None if use_gpus else cpus_per_worker
        )
    t0 = time.monotonic()
    try:
        if pg is not None:
            ray.get(pg.ready(), timeout=ready_timeout_s)
        _register_workers(router, workers, ready_timeout_s)
    except BaseException:
        Cluster(router, workers, router_address, metrics_port, owns_ray, pg).shutdown()
        raise
    logger.info("cluster up in %.1fs: router %s, %d workers", time.monotonic() - t0, router_address, num_workers)
    return Cluster(
        router, workers, router_address, metrics_port, owns_ray, pg, http_port, bound_config, name,
        worker_key=worker_key,
    )  # fmt: skip


def worker_options_for(base: WorkerOptions, worker_id: str, worker_key: str, router_address: str) -> WorkerOptions:
    """``base`` for one worker: the router's WorkerLink address and that worker's own credential
    (only its own: docs/architecture.md section 4)."""
    return dataclasses.replace(
        base, router_address=router_address, credential=issue_worker_credential(worker_key, worker_id)
    )


def _start_router(
    config: RouterConfig, metrics_port: int | None, name: str | None, http_port: int | None, worker_key: str
) -> tuple[Any, int | None]:
    """Create the router actor on this node (detached and named if ``name``) and start it; returns it
    and its bound HTTP port (None = off).

    Raises:
        Exception: it did not start (e.g. the port is taken); no router is left behind.
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from router.server import router_actor_class

    here = ray.get_runtime_context().get_node_id()
    opts: dict[str, Any] = {"scheduling_strategy": NodeAffinitySchedulingStrategy(here, soft=False)}
    if name:
        opts.update(name=name, lifetime="detached", get_if_exists=False)
    router = router_actor_class().options(**opts).remote(config, metrics_port, http_port, worker_key=worker_key)
    try:
        ray.get(router.start.remote())
        http_port = ray.get(router.http_port.remote())
    except BaseException:  # e.g. the port is taken: leave no (detached) router behind
        ray.kill(router)
        raise
    return router, http_port


def _register_workers(router: Any, workers: dict[str, Any], timeout_s: float) -> None:
    """Register every worker (its identity from ``ready``) and wait for its WorkerLink."""
    import ray

    ray.get(router.expect_workers.remote(list(workers)))
    infos = ray.get([w.ready.remote() for w in workers.values()], timeout=timeout_s)
    for (worker_id, handle), info in zip(workers.items(), infos, strict=True):
        ray.get(router.add_worker.remote(worker_id, handle, info))
    ray.get(router.wait_for_workers.remote(list(workers), timeout_s))


def _free_port(host: str) -> int:
    """A port free on ``host`` right now (the kernel's pick; a race is possible but unlikely)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
