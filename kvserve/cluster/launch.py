"""Start (or join) a Ray cluster and bring up the router plus N workers.

The router actor goes on the node that runs this code (the head, in a deployment), so its gRPC
and metrics ports are where a Kubernetes Service or a user expects them. Workers get one GPU each
on CUDA clusters, or ``cpus_per_worker`` CPUs (and as many torch threads) otherwise. With
``spread=True`` the workers go into one placement group (strategy SPREAD: distinct nodes where
there are enough), so a multi-node cluster serves from all of its nodes.

A tensor-parallel worker (``tensor_parallel_size`` N > 1) gets a placement group of its own: N bundles, one
per rank (``{"GPU": 1, "CPU": 1}`` on GPU, ``{"CPU": cpus_per_worker}`` on CPU), strategy STRICT_PACK (one
node); the worker actor (rank 0) goes into bundle 0 and starts ranks 1..N-1 as Ray actors in the other bundles
(kvserve/workers/parallel/launchers.py). Ray cannot nest placement groups, so with ``spread=True`` there is
no SPREAD group around them: each group is given a node as a soft target, round-robin over the nodes with
room for a group (``_group_targets``). ``Cluster.shutdown`` removes the groups.

Supervision (README "Failure behaviour"): worker actors have Ray ``max_restarts=-1``: Ray starts a
killed worker's process again with the same arguments, and its new incarnation says Hello to the
router, which takes it back with an empty pool (or retires it if it crash-loops: the router kills
it with ``no_restart``). The router actor is restarted by ``kvserve serve``
(``Cluster.poll_router`` finds it dead or unresponsive, ``Cluster.restart_router`` replaces it) on
the same port. The new router gets every worker with its supervision record (restarts,
retirement: ``kvserve/router/table/supervision.py``, kept here from the last poll) and without a call to the
worker that could block (its identity is the one it gave at start-up, refreshed if it answers
within ``WORKER_PROBE_TIMEOUT_S``); a retired worker stays retired, an unreachable one is taken
back when its WorkerLink reconnects. A router restart never stops a worker, and every Ray call on
this path has a timeout.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvserve.router.config import RouterConfig
from kvserve.router.table.supervision import WorkerSupervision
from kvserve.workers.core.identity import WorkerIdentity
from kvserve.workers.core.worker_credential import issue_data_credential, issue_worker_credential, new_worker_key
from kvserve.workers.engine.config import EngineConfig
from kvserve.workers.transport.options import WorkerOptions

if TYPE_CHECKING:
    from kvserve.router.api.server import RouterActor

logger = logging.getLogger(__name__)

ROUTER_CALL_TIMEOUT_S = 30.0  # a router call that answers from its tables (register, poll)
ROUTER_START_TIMEOUT_S = 120.0  # a new router actor's process start and bind, on a loaded node
WORKER_PROBE_TIMEOUT_S = 5.0  # a worker's ready() when re-registering it with a new router
RECONNECT_WAIT_S = 60.0  # how long a restart waits for the workers' WorkerLinks before serving on


class RouterPoll(enum.Enum):
    """What one liveness poll of the router actor found."""

    ALIVE = "alive"
    DEAD = "dead"  # the actor is gone (Ray says so)
    UNRESPONSIVE = "unresponsive"  # the call timed out: alive to Ray, but not answering


def init_ray(address: str | None, num_cpus: int | None = None, **kwargs: Any) -> bool:
    """Start a local Ray (``address`` None) or join one; True if this process started it.

    The one Ray start-up of kvserve (``serve``, ``demo`` and ``start_cluster`` all come here), so
    ``address=None`` means the same everywhere.

    NOTE: a local start passes ``address="local"``: a bare ``ray.init()`` would join whatever
    cluster ``ray start`` last recorded in /tmp/ray, which is not what "start a local Ray" means.
    """
    import ray

    from kvserve.cluster.config import RAY_NAMESPACE

    if ray.is_initialized():
        return False
    kwargs.setdefault("logging_level", logging.WARNING)
    kwargs.setdefault("namespace", RAY_NAMESPACE)
    if address is None:
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, **kwargs)
        return True
    ray.init(address=address, **kwargs)
    return False


@dataclass(frozen=True)
class RestartTimes:
    """Where a router restart's seconds went: the new actor up and serving its port, the workers probed and
    registered with it, their WorkerLinks back (README "Failure behaviour")."""

    actor_s: float
    register_s: float
    reconnect_s: float

    @property
    def total_s(self) -> float:
        return self.actor_s + self.register_s + self.reconnect_s

    def __str__(self) -> str:
        return (f"{self.total_s:.1f}s: router up {self.actor_s:.1f}s, workers registered {self.register_s:.1f}s, "
                f"WorkerLinks back {self.reconnect_s:.1f}s")  # fmt: skip


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
    last_restart_s: RestartTimes | None = None  # the last restart's phases (None: none yet, or links still missing)
    identities: dict[str, WorkerIdentity] = field(default_factory=dict)  # as each worker last told us
    supervision: dict[str, WorkerSupervision] = field(default_factory=dict)  # from the last poll
    # NOTE: the cluster's worker key: the router verifies worker credentials with it, and a
    # restarted router needs the same one (the workers keep theirs). Never given to a worker.
    worker_key: str = field(default="", repr=False)
    # ``--frontends N`` (kvserve/cluster/frontends.py): their actors, their shared gRPC port (the HTTP API is
    # theirs then: ``http_port``), and the key the router trusts them by.
    frontends: list[Any] = field(default_factory=list)
    frontend_port: int | None = None
    frontend_key: str | None = field(default=None, repr=False)
    router_actor: type[RouterActor] | None = None  # the router's actor class, for a restart (None: RouterActor)
    # tensor_parallel_size > 1: each worker's own STRICT_PACK group (its ranks' bundles), removed on shutdown
    tp_groups: dict[str, Any] = field(default_factory=dict)
    _stopped: bool = field(default=False, repr=False)

    def poll_router(self, timeout_s: float = ROUTER_CALL_TIMEOUT_S) -> RouterPoll:
        """One liveness poll of the router; when it answers, keep its supervision records (for
        the next router, should this one die)."""
        import ray

        try:
            self.supervision.update(ray.get(self.router.supervision.remote(), timeout=timeout_s))
        except ray.exceptions.RayActorError:
            return RouterPoll.DEAD
        except ray.exceptions.GetTimeoutError:
            return RouterPoll.UNRESPONSIVE
        return RouterPoll.ALIVE

    def restart_router(self, reconnect_timeout_s: float = RECONNECT_WAIT_S) -> list[str]:
        """Replace a dead or unresponsive router: a new actor (same name, same port) that gets
        every worker with its supervision record; then wait (at most ``reconnect_timeout_s``) for
        the WorkerLinks of the workers not retired. Touches no worker beyond a bounded ``ready``.

        Returns:
            The workers not retired whose WorkerLink did not reconnect in time (the router takes
            each back when it does; a missing one is logged, never fatal).

        Raises:
            Exception: the new router did not start (the caller tries again later; the workers
                keep running meanwhile).
        """
        import ray

        assert self.router_config is not None
        began = time.monotonic()
        try:
            ray.kill(self.router)  # NOTE: frees the name and the port, should the old one linger half-dead
        except Exception:  # noqa: BLE001 - already gone
            pass
        # NOTE: the workers are probed while the new router starts (they do not need it to answer)
        probes = _ask_ready(self.workers)
        # NOTE: with frontends the HTTP API is theirs; they reconnect to the new router on its port.
        router, _ = _start_router(
            self.router_config, self.metrics_port, self.router_name, None if self.frontends else self.http_port,
            self.worker_key, self.frontend_key, self.router_actor,
        )
        self.router = router
        started = time.monotonic()
        ray.get(router.expect_workers.remote(list(self.workers)), timeout=ROUTER_CALL_TIMEOUT_S)
        self.router_restarts += 1
        fresh, gone = _probe_workers(self.workers, WORKER_PROBE_TIMEOUT_S, probes)
        self.identities.update(fresh)
        for worker_id in gone:
            self.supervision[worker_id] = _retired(self.supervision.get(worker_id))
        # NOTE: all at once: each registration binds its worker's link nonce, and its link connects right after
        records = self.supervision
        ray.get([router.add_worker.remote(worker_id, handle, self.identities[worker_id], records.get(worker_id))
                 for worker_id, handle in self.workers.items()], timeout=ROUTER_CALL_TIMEOUT_S)  # fmt: skip
        expected = [w for w in self.workers if not (w in self.supervision and self.supervision[w].retired)]
        registered = time.monotonic()
        try:
            ray.get(router.wait_for_workers.remote(expected, reconnect_timeout_s),
                    timeout=reconnect_timeout_s + ROUTER_CALL_TIMEOUT_S)  # fmt: skip
            self.last_restart_s = RestartTimes(started - began, registered - started, time.monotonic() - registered)
            return []
        except Exception:  # noqa: BLE001 - some never reconnected (yet): serve on without them
            connected = set(ray.get(router.connected_workers.remote(), timeout=ROUTER_CALL_TIMEOUT_S))
            missing = [w for w in expected if w not in connected]
            logger.warning("router restarted; WorkerLinks not back after %.0fs (taken back when they are): %s",
                           reconnect_timeout_s, ", ".join(missing))  # fmt: skip
            return missing

    def shutdown(self) -> None:
        """Stop workers and router (and Ray, if this process started it). Idempotent."""
        import ray

        if self._stopped:
            return
        self._stopped = True
        if self.frontends:
            from kvserve.cluster.frontends import stop_frontends

            stop_frontends(self.frontends)
        # NOTE: the router stops first: a worker that shut down under a live router would be called down
        # (its engine thread gone) and killed for a restart, as a failure would be.
        try:
            ray.get(self.router.stop.remote(), timeout=10)
        except Exception:  # noqa: BLE001 - best effort on the way down
            pass
        for handle in self.workers.values():
            try:
                ray.get(handle.shutdown.remote(), timeout=10)
            except Exception:  # noqa: BLE001 - best effort on the way down
                pass
            ray.kill(handle)
        ray.kill(self.router)
        # NOTE: removing a group also ends any actor still in it (a rank whose worker was killed above).
        for pg in [self.placement_group, *self.tp_groups.values()]:
            if pg is None:
                continue
            try:
                ray.util.remove_placement_group(pg)
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
    frontends: int = 0,
    frontend_port: int = 0,
    worker_link_address: str | None = None,
    router_actor: type[RouterActor] | None = None,
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
            ``Cluster.http_port``); on the frontends when there are any.
        frontends: stateless frontends serving the client APIs on ``frontend_port`` (shared,
            0 = a free one) and ``http_port``, relayed to the router (kvserve/cluster/frontends.py); 0 = none,
            the router serves both itself.
        worker_link_address: the address workers dial for the router's WorkerLink (a TCP proxy in
            front of it); None: the router's own.
        router_actor: the router's actor class, ``RouterActor`` (None) or a subclass of it; a restart
            (``Cluster.restart_router``) starts the same. A seam for tests: the chaos tests start one
            that can also arm a migration fault (tests/chaos/fault_router.py).
    """
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from kvserve.workers.transport.worker_actor import worker_actor_class

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
    from kvserve.cluster.frontends import frontend_key

    fkey = frontend_key(needed=frontends > 0)
    try:
        router, router_http = _start_router(
            router_config, metrics_port, name, None if frontends else http_port, worker_key, fkey, router_actor
        )
    except BaseException:
        if owns_ray:
            ray.shutdown()
        raise
    router_address = ray.get(router.address.remote(), timeout=ROUTER_CALL_TIMEOUT_S)
    bound_config = dataclasses.replace(router_config, port=int(router_address.rsplit(":", 1)[1]))
    link_address = router_address
    if router_config.host in ("0.0.0.0", "::"):
        link_address = f"{ray.util.get_node_ip_address()}:{router_address.rsplit(':', 1)[1]}"
    base = worker_options or WorkerOptions()
    actor = worker_actor_class()
    workers: dict[str, Any] = {}
    # NOTE: a tensor-parallel worker is N Ray actors (ranks) in a STRICT_PACK placement group of its own: Ray
    # reserves every rank's device and puts the group on one node (module docstring).
    tp = engine_config.tensor_parallel_size
    bundle = {"GPU": 1, "CPU": 1} if use_gpus else {"CPU": cpus_per_worker}
    resources = {"num_gpus": 1, "num_cpus": 1} if use_gpus else {"num_cpus": cpus_per_worker}
    worker_ids = [f"worker-{i}" for i in range(num_workers)]
    pg = None
    tp_groups: dict[str, Any] = {}
    if tp > 1:
        targets = _group_targets(bundle, tp, num_workers) if spread else [None] * num_workers
        for worker_id, target in zip(worker_ids, targets, strict=True):
            tp_groups[worker_id] = ray.util.placement_group(
                [dict(bundle) for _ in range(tp)], strategy="STRICT_PACK", _soft_target_node_id=target
            )
    elif spread:
        pg = ray.util.placement_group([dict(bundle) for _ in range(num_workers)], strategy="SPREAD")
    ray.get(router.expect_workers.remote(worker_ids))
    for i, worker_id in enumerate(worker_ids):
        options = worker_options_for(base, worker_id, worker_key, worker_link_address or link_address, fkey)
        # NOTE: Ray restarts a dead worker forever; the router retires one that crash-loops.
        opts: dict[str, Any] = dict(resources, max_restarts=-1)
        if worker_id in tp_groups:  # rank 0 in bundle 0; its ranks take the others
            opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                tp_groups[worker_id], placement_group_bundle_index=0
            )
        elif pg is not None:
            opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i)
        workers[worker_id] = actor.options(**opts).remote(
            worker_id, engine_config, options, None if use_gpus else cpus_per_worker
        )
    t0 = time.monotonic()
    try:
        groups = [g for g in (pg, *tp_groups.values()) if g is not None]
        if groups:
            ray.get([g.ready() for g in groups], timeout=ready_timeout_s)
        identities = _register_workers(router, workers, ready_timeout_s)
    except BaseException:
        Cluster(router, workers, router_address, metrics_port, owns_ray, pg, tp_groups=tp_groups).shutdown()
        raise
    logger.info("cluster up in %.1fs: router %s, %d workers", time.monotonic() - t0, router_address, num_workers)
    cluster = Cluster(
        router, workers, router_address, metrics_port, owns_ray, pg, router_http, bound_config, name,
        identities=identities, worker_key=worker_key, frontend_key=fkey, router_actor=router_actor,
        tp_groups=tp_groups,
    )  # fmt: skip
    if frontends:
        from kvserve.cluster.frontends import start_frontends

        try:
            cluster.frontends, cluster.frontend_port, cluster.http_port = start_frontends(
                frontends, router_config, link_address, frontend_port, http_port, fkey or "",
                (base.tls_ca, base.tls_cert, base.tls_key),
            )
        except BaseException:
            cluster.shutdown()
            raise
    return cluster


def worker_options_for(
    base: WorkerOptions, worker_id: str, worker_key: str, router_address: str, frontend_key: str | None = None
) -> WorkerOptions:
    """``base`` for one worker: the router's WorkerLink address and that worker's own credential
    (only its own: docs/architecture.md section 4); with a ``frontend_key`` also its data credential,
    which its owned requests' data links present to the frontends (section 2a). The key itself never
    reaches the worker."""
    data_credential = issue_data_credential(frontend_key, worker_id) if frontend_key else None
    return dataclasses.replace(
        base, router_address=router_address, credential=issue_worker_credential(worker_key, worker_id),
        data_credential=data_credential,
    )  # fmt: skip


def _group_targets(bundle: dict[str, float], size: int, count: int) -> list[str | None]:
    """Soft target nodes for ``count`` STRICT_PACK groups of ``size`` bundles (``spread=True`` with tensor
    parallelism): round-robin over the alive nodes with room for a whole group, in node id order; None where
    no node has room (Ray places the group where it can)."""
    import ray

    fits = [
        n["NodeID"]
        for n in ray.nodes()
        if n.get("Alive") and all(n.get("Resources", {}).get(k, 0) >= v * size for k, v in bundle.items())
    ]
    return spread_targets(sorted(fits), count)


def spread_targets(nodes: list[str], count: int) -> list[str | None]:
    """``count`` targets round-robin over ``nodes`` (all None without nodes)."""
    return [nodes[i % len(nodes)] if nodes else None for i in range(count)]


def _start_router(
    config: RouterConfig,
    metrics_port: int | None,
    name: str | None,
    http_port: int | None,
    worker_key: str,
    frontend_key: str | None = None,
    actor: type[RouterActor] | None = None,
) -> tuple[Any, int | None]:
    """Create the router actor (``actor``, None: ``RouterActor``) on this node (detached and named if
    ``name``) and start it; returns it and its bound HTTP port (None = off).

    Raises:
        Exception: it did not start (e.g. the port is taken); no router is left behind.
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from kvserve.router.api.server import router_actor_class

    here = ray.get_runtime_context().get_node_id()
    opts: dict[str, Any] = {"scheduling_strategy": NodeAffinitySchedulingStrategy(here, soft=False)}
    if name:
        opts.update(name=name, lifetime="detached", get_if_exists=False)
    cls = router_actor_class() if actor is None else router_actor_class(actor)
    router = cls.options(**opts).remote(
        config, metrics_port, http_port, worker_key=worker_key, frontend_key=frontend_key
    )
    try:
        ray.get(router.start.remote(), timeout=ROUTER_START_TIMEOUT_S)
        http_port = ray.get(router.http_port.remote(), timeout=ROUTER_CALL_TIMEOUT_S)
    except BaseException:  # e.g. the port is taken: leave no (detached) router behind
        ray.kill(router)
        raise
    return router, http_port


def _register_workers(router: Any, workers: dict[str, Any], timeout_s: float) -> dict[str, WorkerIdentity]:
    """Register every worker (its identity from ``ready``) and wait for its WorkerLink; returns
    the identities."""
    import ray

    ray.get(router.expect_workers.remote(list(workers)), timeout=ROUTER_CALL_TIMEOUT_S)
    infos = ray.get([w.ready.remote() for w in workers.values()], timeout=timeout_s)
    for (worker_id, handle), info in zip(workers.items(), infos, strict=True):
        ray.get(router.add_worker.remote(worker_id, handle, info), timeout=ROUTER_CALL_TIMEOUT_S)
    ray.get(router.wait_for_workers.remote(list(workers), timeout_s), timeout=timeout_s + ROUTER_CALL_TIMEOUT_S)
    return dict(zip(workers, infos, strict=True))


def _ask_ready(workers: dict[str, Any]) -> dict[Any, str]:
    """Every worker's ``ready`` asked at once: its pending answer -> the worker id."""
    return {w.ready.remote(): worker_id for worker_id, w in workers.items()}


def _probe_workers(
    workers: dict[str, Any], timeout_s: float, probes: dict[Any, str] | None = None
) -> tuple[dict[str, WorkerIdentity], set[str]]:
    """Ask every worker's ``ready`` at once (or take the ``probes`` of ``_ask_ready`` already asked), for at most
    ``timeout_s``.

    Returns:
        The identities of those that answered, and the workers whose actor is dead for good.
        NOTE: worker actors have ``max_restarts=-1``, so Ray restarts any dead one, except one the
        router killed with ``no_restart`` (retired); one that is restarting, hung or slow is in
        neither set (its last known identity stands).
    """
    import ray

    refs = _ask_ready(workers) if probes is None else probes
    done, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
    identities: dict[str, WorkerIdentity] = {}
    gone: set[str] = set()
    for ref in done:
        try:
            identities[refs[ref]] = ray.get(ref, timeout=0)
        except ray.exceptions.ActorDiedError:
            gone.add(refs[ref])
        except Exception:  # noqa: BLE001 - unavailable for now (restarting): taken back when it says Hello
            logger.debug("%s did not answer ready()", refs[ref], exc_info=True)
    return identities, gone


def _retired(record: WorkerSupervision | None) -> WorkerSupervision:
    """The record of a worker found dead for good, i.e. retired by the dead router after the
    launcher's last poll: at least one restart more than the record knew (the one that retired it)."""
    if record is None:
        return WorkerSupervision(restarts_total=1, retired=True, taken_at=time.time())
    if record.retired:
        return record
    return dataclasses.replace(record, restarts_total=record.restarts_total + 1, retired=True)


def _free_port(host: str) -> int:
    """A port free on ``host`` right now (the kernel's pick; a race is possible but unlikely)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
