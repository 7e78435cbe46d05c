"""gRPC servicers (client API + WorkerLink on one port) and the Router's Ray actor.

One ``grpc.aio`` server on the router's event loop serves ``kvserve.v1.KVServe`` for clients,
``kvserve.v1.WorkerLink`` for workers, the standard health service and server reflection (so
``grpcurl`` works with no .proto at hand).

Every client call goes through the guard of kvserve/router/api/grpc_surface.py (shared with the
frontends): request bytes that are not a valid message get INVALID_ARGUMENT (the methods are
registered with a deserializer that never raises), and an unexpected exception is logged once
with its traceback and answered INTERNAL with an incident id (the request id when there is one),
never UNKNOWN with a class name. CANCELLED is produced here
only by the Abort RPC (the client asked); grpc itself ends a call CANCELLED when the client
cancels it.

Health (``kvserve/router/api/health.py``): the standard health service answers readiness for ``""`` and
``kvserve.v1.KVServe`` (SERVING iff some worker can serve now, in both directions, the same verdict
as HTTP ``/health``) and liveness for ``kvserve.v1.Liveness`` (SERVING while the router runs). A
Generate that arrives before any worker said Hello waits for one (bounded by its deadline and
``ready_timeout_s``).

With an HTTP port, the OpenAI-compatible API (``kvserve/router/api/http_api.py``) runs on the same loop and the
same Router.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvserve.protos.kvserve.v1 import serving_pb2 as spb
from kvserve.protos.kvserve.v1 import serving_pb2_grpc, worker_pb2, worker_pb2_grpc
from kvserve.router.api.admin_api import AdminServicer
from kvserve.router.api.grpc_surface import Undecodable, abort_call, add_kvserve_servicer, read_generate_stream
from kvserve.router.api.health import HealthPublisher
from kvserve.router.api.http_api import HttpApiServer
from kvserve.router.api.keepalive import server_keepalive_options
from kvserve.router.api.router_backend import RouterBackend
from kvserve.router.config import RouterConfig
from kvserve.router.gate.auth import CallerAuthInterceptor, frontend_trusted
from kvserve.router.gate.bounds import Bounds
from kvserve.router.gate.limits import LimitExceeded, client_of_peer
from kvserve.router.gate.tenancy import KeyRing, Principal, Tenancy
from kvserve.router.gate.worker_auth import WorkerLinkGate
from kvserve.router.observe.loop_lag import watch_loop_lag
from kvserve.router.observe.metrics import RouterMetrics, start_metrics_server
from kvserve.router.requests.demux import stream_responses
from kvserve.router.requests.mux import StreamMux, stream_batches
from kvserve.router.requests.owned import stream_mux
from kvserve.router.requests.request import RouterRequest
from kvserve.router.requests.router import Router, RouterError
from kvserve.router.requests.takeover import grant_of
from kvserve.router.table.supervision import WorkerSupervision
from kvserve.workers.core.gc_pauses import settle_heap
from kvserve.workers.core.identity import WorkerIdentity
from kvserve.workers.core.tls import add_port
from kvserve.workers.core.worker_credential import new_worker_key

logger = logging.getLogger(__name__)

DEFAULT_WATCH_INTERVAL_MS = 500
WATCH_SNAPSHOT_S = 0.025  # NOTE: half the shortest watch interval (50 ms): a watcher sees no staler data
DEFAULT_READY_TIMEOUT_S = 60.0


class KVServeServicer(serving_pb2_grpc.KVServeServicer):
    """The client API (register with ``add_kvserve_servicer``, which adds the guards).

    Args:
        router: The router.
        ready_timeout_s: Longest a Generate arriving before any worker said Hello waits for one
            (also bounded by the call's own deadline) before UNAVAILABLE.
    """

    def __init__(
        self,
        router: Router,
        ready_timeout_s: float = DEFAULT_READY_TIMEOUT_S,
        bounds: Bounds | None = None,
        frontend_key: str | None = None,
    ) -> None:
        if not ready_timeout_s >= 0:
            raise ValueError(f"ready_timeout_s must be >= 0, got {ready_timeout_s}")
        self.router = router
        self.frontend_key = frontend_key  # a GenerateStream carrying it may name its requests' clients
        self.ready_timeout_s = ready_timeout_s
        self.bounds = bounds or Bounds(router)
        self._snapshot: tuple[float, spb.ClusterStatus] | None = None

    async def _wait_until_ready(self, context: grpc.aio.ServicerContext) -> None:
        """Wait for the first worker's Hello, at most ``ready_timeout_s`` and the call's deadline;
        returns either way (``submit`` then answers UNAVAILABLE if there is still none)."""
        ready = self.router.ready_event()
        if ready.is_set():
            return
        remaining = context.time_remaining()
        timeout = self.ready_timeout_s if remaining is None else min(self.ready_timeout_s, max(remaining, 0.0))
        try:
            await asyncio.wait_for(ready.wait(), timeout)
        except TimeoutError:
            pass

    async def Generate(  # noqa: N802 - gRPC method name
        self, request: spb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[spb.GenerateResponse]:
        await self._wait_until_ready(context)
        who = self._principal(context)
        try:
            (r,) = await self.bounds.submit_all(
                client_of_peer(context.peer()), [request], context.time_remaining, who
            )
        except RouterError as e:
            await _abort(context, e)
            return
        try:
            async for response in stream_responses(r):
                if who is not None:  # the id as the tenant knows it
                    response.request_id = self.bounds.tenancy.unscoped_id(who, response.request_id)  # type: ignore[union-attr]
                yield response
        except RouterError as e:
            await _abort(context, e)
        finally:
            # Cancelled by the client, past its deadline, or aborted: free its blocks now.
            if not r.finished:
                self.router.lifecycle.cancel(r)

    async def GenerateStream(  # noqa: N802 - gRPC method name
        self, requests: AsyncIterator[spb.GenerateStreamRequest | Undecodable], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[spb.GenerateBatch]:
        """Many requests over one stream, answered by one ``GenerateBatch`` per wake-up (router/requests/mux.py).

        Ends when the client closed its side and every request it sent has ended; a request refused or
        ended abnormally gets a ``RequestError``, not the stream's status. A message that cannot be
        answered by id (undecodable, no request_id, an id in use on the stream) ends the stream
        INVALID_ARGUMENT. Closing, cancelling or ending the stream cancels every request still running
        on it (their blocks are freed), but an owned request already placed: it is kept for its owner's
        grace (``OwnedRequests.stream_ended``)."""
        await self._wait_until_ready(context)
        mux = StreamMux()
        live: dict[str, RouterRequest] = {}
        who = self._principal(context)
        trusted = frontend_trusted(context.invocation_metadata(), self.frontend_key)
        caller = (client_of_peer(context.peer()), who, trusted)
        reader = asyncio.get_running_loop().create_task(self._read_requests(requests, mux, live, caller))
        # the ids as the tenant knows them
        rename = None if who is None else functools.partial(self.bounds.tenancy.unscoped_id, who)  # type: ignore[union-attr]
        try:
            async for batch in stream_batches(mux, live, reader, rename):
                yield batch
        except RouterError as e:
            await _abort(context, e)
        finally:
            reader.cancel()
            # NOTE: an owned, placed request outlives its frontend's stream for a grace (its frontend re-opens
            # it: kvserve/router/requests/owned.py ``stream_ended``); every other one is cancelled
            for r in self.router.owned.stream_ended(mux, list(live.values())):
                self.router.lifecycle.cancel(r)

    async def _read_requests(
        self,
        requests: AsyncIterator[Any],
        mux: StreamMux,
        live: dict[str, RouterRequest],
        caller: tuple[str, Principal | None, bool],
    ) -> None:
        peer, who, trusted = caller

        async def submit(rid: str, msg: spb.GenerateStreamRequest) -> None:
            # NOTE: a frontend relays many clients on one stream: each counts as itself (frontend/).
            client = msg.client if trusted and msg.client else peer
            owner = msg.owner if msg.HasField("owner") and msg.owner.key else None
            try:
                if owner is not None and not trusted:
                    # NOTE: an owner is where a worker will dial: never an address a client chose
                    raise RouterError(grpc.StatusCode.PERMISSION_DENIED, "owner needs the frontend credential")
                if owner is not None and not owner.address:  # NOTE: its worker would have nowhere to send outputs
                    raise RouterError(grpc.StatusCode.INVALID_ARGUMENT, "owner.key needs owner.address")
                # NOTE: the same bounds, tokenization off the loop and tenancy as Generate.
                (live[rid],) = await self.bounds.submit_all(
                    client, [msg.generate], _time_remaining(msg.timeout_ms), who=who, mux=mux, owner=owner
                )
                if owner is not None and (grant := grant_of(msg, _tenant(who), client)) is not None:
                    self.router.owned.takeovers.grant(live[rid], grant)
            except RouterError as e:
                # NOTE: keyed as the router keys the request's responses (scoped), unscoped on the way out.
                mux.put(rid if who is None else self.bounds.tenancy.scoped_id(who, rid), e)  # type: ignore[union-attr]

        def control(msg: spb.GenerateStreamRequest) -> None:
            if msg.WhichOneof("kind") == "cancel_request_id":
                # NOTE: a frontend cancels an owned request by its key; one this router adopted (after a
                # restart) is on no stream, so it is looked up among this owner's (a client's: ignored)
                if trusted:
                    self.router.owned.cancel(msg.cancel_request_id, mux)
                return
            if not trusted:
                raise RouterError(grpc.StatusCode.PERMISSION_DENIED, "resume and owner need the frontend credential")
            if msg.HasField("owner") and msg.owner.address:
                self.router.owned.announce(msg.owner.address, mux)
            if msg.WhichOneof("kind") == "resume":
                self.router.owned.resume(msg.resume.owner_key, list(msg.resume.output_ids), mux)
            elif msg.WhichOneof("kind") == "take_over":  # NOTE: its client resumes through this frontend
                client = msg.client or peer
                self.router.owned.takeovers.take_over(msg.take_over, _tenant(who), client, mux)

        def cancel(r: RouterRequest) -> None:
            if r.owner_key and stream_mux(r) is not mux:
                return  # NOTE: taken over by another frontend (takeover.py): this stream's cancel is not its own
            self.router.lifecycle.cancel(r)

        await read_generate_stream(requests, mux, live, submit, cancel, columns=True, control=control)

    async def Abort(self, request: spb.AbortRequest, context: grpc.aio.ServicerContext) -> spb.AbortResponse:  # noqa: N802
        who = self._principal(context)
        rid = request.request_id
        if who is not None:  # NOTE: only the caller's tenant's requests are in its reach
            rid = self.bounds.tenancy.scoped_id(who, rid)  # type: ignore[union-attr]
        return spb.AbortResponse(found=self.router.lifecycle.abort(rid))

    def _principal(self, context: grpc.aio.ServicerContext) -> Principal | None:
        return self.bounds.principal(dict(context.invocation_metadata() or ()).get("authorization"))

    async def GetClusterStatus(  # noqa: N802
        self, request: spb.ClusterStatusRequest, context: grpc.aio.ServicerContext
    ) -> spb.ClusterStatus:
        return self.router.cluster_status()

    async def WatchBlockPressure(  # noqa: N802
        self, request: spb.WatchRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[spb.ClusterStatus]:
        interval = max(request.interval_ms or DEFAULT_WATCH_INTERVAL_MS, 50) / 1000
        with contextlib.ExitStack() as held:
            try:
                held.enter_context(self.bounds.watchers.hold())
            except LimitExceeded as e:
                await _abort(context, RouterError(e.code, str(e), e.trailers))
            while True:
                yield self._shared_status()
                await asyncio.sleep(interval)

    def _shared_status(self) -> spb.ClusterStatus:
        """One snapshot per ``WATCH_SNAPSHOT_S`` for every watcher: N watchers cost one build, not N
        (each build walks the request table), so they cannot crowd the loop."""
        now = time.monotonic()
        if self._snapshot is None or now - self._snapshot[0] >= WATCH_SNAPSHOT_S:
            self._snapshot = (now, self.router.cluster_status())
        return self._snapshot[1]


def _tenant(who: Principal | None) -> str:
    """The tenant a resume grant is bound to ("" without API keys: the token alone then)."""
    return "" if who is None else who.tenant


def _time_remaining(timeout_ms: int) -> Callable[[], float | None]:
    """Seconds left of a GenerateStream request's own deadline (``timeout_ms`` from now; 0 = none)."""
    if not timeout_ms:
        return lambda: None
    deadline = time.monotonic() + timeout_ms / 1000
    return lambda: deadline - time.monotonic()


async def _abort(context: grpc.aio.ServicerContext, e: RouterError) -> None:
    await abort_call(context, e)  # NOTE: quiet for a call its deadline already ended


def build_server(
    router: Router,
    config: RouterConfig,
    gate: WorkerLinkGate,
    bounds: Bounds,
    ready_timeout_s: float = DEFAULT_READY_TIMEOUT_S,
    frontend_key: str | None = None,
) -> tuple[grpc.aio.Server, int]:
    """The gRPC server with every service registered and its port bound (not started).

    Client calls are authenticated by ``CallerAuthInterceptor`` (kvserve/router/gate/auth.py), WorkerLink streams
    by ``gate`` (kvserve/router/gate/worker_auth.py), which hands accepted ones to ``router.link``.
    The health service starts NOT_SERVING; ``RouterService.start`` keeps it in step with the
    workers (``kvserve/router/api/health.py``).
    """
    options = [
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.so_reuseport", 0),
        *server_keepalive_options(config),
    ]
    keys = bounds.tenancy.keys if bounds.tenancy is not None else None
    server = grpc.aio.server(interceptors=[CallerAuthInterceptor(config.auth_token, keys)], options=options)
    add_kvserve_servicer(KVServeServicer(router, ready_timeout_s, bounds, frontend_key), server)
    add_kvserve_servicer(AdminServicer(router), server, "Admin")
    worker_pb2_grpc.add_WorkerLinkServicer_to_server(gate, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = (
        spb.DESCRIPTOR.services_by_name["KVServe"].full_name,
        spb.DESCRIPTOR.services_by_name["Admin"].full_name,
        worker_pb2.DESCRIPTOR.services_by_name["WorkerLink"].full_name,
        health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
        reflection.SERVICE_NAME,
    )
    reflection.enable_server_reflection(names, server)
    address = f"{config.host}:{config.port}"
    port = add_port(server, address, config.tls_cert, config.tls_key, config.tls_client_ca)
    if port == 0:
        raise OSError(f"cannot bind the router's gRPC port at {address}")
    server._kvserve_health = health_servicer  # type: ignore[attr-defined]
    return server, port


class RouterService:
    """Router + gRPC server + health loop + metrics endpoint on the current event loop.

    Used directly in tests and wrapped as the ``RouterActor`` on a Ray cluster.
    """

    def __init__(
        self,
        config: RouterConfig,
        metrics_port: int | None = None,
        http_port: int | None = None,
        ready_timeout_s: float = DEFAULT_READY_TIMEOUT_S,
        worker_key: str | None = None,
        frontend_key: str | None = None,
    ) -> None:
        """
        Args:
            metrics_port: Prometheus ``/metrics`` (None = off).
            http_port: the OpenAI-compatible HTTP API (None = off, 0 = a free port: see ``http_port()``).
            worker_key: the cluster's worker key (``kvserve/workers/core/worker_credential.py``), from the
                launcher, which issues each worker's credential from it. None: a fresh one no
                worker holds, so no WorkerLink is accepted (a router without workers, in tests).
            frontend_key: the cluster's frontend key (frontend/): a GenerateStream presenting it
                may name each request's end client. None: no frontend is trusted.
        """
        from kvserve.workers.text.chat_template import ChatTemplate
        from kvserve.workers.text.tokenizer import load_tokenizer

        self.config = config
        self.ready_timeout_s = ready_timeout_s
        tokenizer = load_tokenizer(config.model) if config.model else None
        template = ChatTemplate.from_dir(config.model) if config.model else None
        self.router = Router(config, tokenizer=tokenizer, chat_template=template)
        self.gate = WorkerLinkGate(self.router.link, worker_key or new_worker_key(), bind=self._bind_link)
        # NOTE: with keys, the --auth-token bearer is the operator's own tenant (gate/tenancy.py), not all of them
        keys = KeyRing.load(config.auth_keys) if config.auth_keys else None
        tenancy = Tenancy(keys, operator_token=config.auth_token) if keys is not None else None
        self.bounds = Bounds(self.router, tenancy=tenancy)
        self.frontend_key = frontend_key
        self.metrics_port = metrics_port
        self.port = 0
        self._http_port = http_port
        self._http: HttpApiServer | None = None
        self._server: grpc.aio.Server | None = None
        self._health_task: asyncio.Task | None = None
        self._readiness_task: asyncio.Task | None = None
        self._lag_task: asyncio.Task | None = None
        self.health: HealthPublisher | None = None

    async def start(self) -> str:
        """Start serving; returns the bound ``host:port``. Readiness answers NOT_SERVING until a
        worker can serve (and again whenever none can); liveness answers SERVING."""
        server, self.port = build_server(
            self.router, self.config, self.gate, self.bounds, self.ready_timeout_s, self.frontend_key
        )
        self.health = HealthPublisher(self.router, server._kvserve_health)  # type: ignore[attr-defined]
        await self.health.start()
        await server.start()
        self._server = server
        loop = asyncio.get_running_loop()
        self._health_task = loop.create_task(self.router.table.health_loop())
        self._readiness_task = loop.create_task(self.health.run())
        lag_sink, held_sink = RouterMetrics.loop_lag_sinks()
        requests = self.router.requests
        self._lag_task = loop.create_task(watch_loop_lag(lag_sink, observe_held=held_sink, busy=lambda: bool(requests)))
        queue = self.router.queue
        RouterMetrics.watch_queue(lambda: queue.num_requests, lambda: queue.num_blocks, self._projected_wait_s)
        if self.metrics_port is not None:
            start_metrics_server(self.metrics_port, self.config.host, self._metrics_authorized())
        if self._http_port is not None:
            # NOTE: on this loop, beside grpc.aio: one Router, one request table, no extra hop.
            c = self.config
            self._http = HttpApiServer(RouterBackend(self.router, self.bounds), c.host, self._http_port, c.auth_token,
                                       tls=c.tls_files())  # fmt: skip
            try:
                self._http_port = await self._http.start()
            except BaseException:
                await self.stop()
                raise
        logger.info("router serving on %s:%d", self.config.host, self.port)
        return f"{self.config.host}:{self.port}"

    def _metrics_authorized(self) -> Callable[[str], bool] | None:
        """The scrape check of ``router.metrics_auth`` (None: /metrics open)."""
        token, tenancy = self.config.auth_token, self.bounds.tenancy
        if not self.config.metrics_auth:
            return None
        expected = f"Bearer {token}".encode() if token else None

        def authorized(header: str) -> bool:
            got = header.encode("latin-1", "replace")
            if expected is not None and hmac.compare_digest(got, expected):
                return True
            return tenancy is not None and tenancy.principal(got) is not None

        return authorized

    def _projected_wait_s(self) -> float:
        wait = self.router.queue.projected_wait_s()
        return float("nan") if wait is None else wait

    async def expect_workers(self, worker_ids: list[str]) -> None:
        """Let these workers' WorkerLinks in (their credentials must still be valid); the launcher
        calls this before it starts them, as their Hello may come before ``add_worker``."""
        self.gate.expect(worker_ids)

    async def add_worker(
        self, worker_id: str, handle: Any, identity: WorkerIdentity, supervision: WorkerSupervision | None = None
    ) -> None:
        """Register a worker; ``supervision`` carries its restarts and retirement over from a
        previous router (``kvserve/router/table/supervision.py``): a retired worker stays retired."""
        self.gate.expect([worker_id])
        self.router.add_worker(worker_id, handle, identity, supervision)
        self.gate.bind_soon(worker_id)  # NOTE: its process's link nonce, before its first Hello if we can
        entry = self.router.table[worker_id]
        RouterMetrics.watch_report_age(
            worker_id, lambda: time.monotonic() - entry.report_time if entry.report is not None else float("nan")
        )

    async def _bind_link(self, worker_id: str, nonce: str) -> str | None:
        """Hand ``worker_id``'s live actor its link nonce through Ray (kvserve/router/gate/worker_auth.py);
        its incarnation, or None when no actor is registered under that id."""
        entry = self.router.table.entries.get(worker_id)
        if entry is None:
            return None
        return await asyncio.wait_for(entry.handle.bind_link.remote(nonce), self.config.link_grace_s)

    async def supervision(self) -> dict[str, WorkerSupervision]:
        """Every worker's supervision record now (``kvserve serve`` keeps the latest for the next
        router; also its liveness poll of this router)."""
        return self.router.table.supervision()

    async def connected_workers(self) -> list[str]:
        """The registered workers whose WorkerLink is connected now."""
        return [w for w in self.router.table.entries if self.router.link.connected(w)]

    async def pid(self) -> int:
        """This router's OS process id (chaos tests kill it)."""
        import os

        return os.getpid()

    async def worker_pid(self, worker_id: str) -> int:
        """The OS pid of a registered worker's actor process; KeyError if unknown."""
        return int(await self.router.table[worker_id].handle.pid.remote())

    async def check_worker_integrity(self, worker_id: str) -> None:
        """Run a worker's block-pool integrity check (raises on a broken invariant; tests)."""
        await self.router.table[worker_id].handle.check_integrity.remote()

    async def wait_for_workers(self, worker_ids: list[str], timeout: float = 120.0) -> None:
        await self.router.table.wait_connected(worker_ids, timeout)

    async def cluster_status(self) -> bytes:
        return self.router.cluster_status().SerializeToString()

    async def migrate(self, request_id: str, dst_worker_id: str) -> bool:
        return await self.router.mover.migrate(request_id, dst_worker_id)

    async def address(self) -> str:
        return f"{self.config.host}:{self.port}"

    async def http_port(self) -> int | None:
        """The HTTP API's bound port (None = off)."""
        return self._http_port if self._http is not None else None

    async def stop(self, grace: float = 1.0) -> None:
        self.router.table.close()
        for task in (self._health_task, self._readiness_task, self._lag_task):
            if task is not None:
                task.cancel()
        if self._http is not None:
            await self._http.stop()
            self._http = None
        if self._server is not None:
            await self._server.stop(grace)
            self._server = None
        self.bounds.close()


class RouterActor(RouterService):
    """``RouterService`` in a process of its own (a Ray actor): once serving, it freezes its start-up
    heap out of the garbage collector's scans and times the collections that remain
    (``kvserve:router_gc_pause_seconds``). NOTE: not in ``RouterService`` itself: tests run that
    inside the test process, whose heap is not the router's to freeze."""

    async def start(self) -> str:
        address = await super().start()
        frozen, self.gc_pauses = settle_heap("router", RouterMetrics.gc_paused)
        RouterMetrics.heap_settled(frozen)
        return address

    async def stop(self, grace: float = 1.0) -> None:
        pauses = getattr(self, "gc_pauses", None)
        if pauses is not None:
            pauses.close()
        await super().stop(grace)


def router_actor_class(actor: type[RouterActor] = RouterActor):
    """``ray.remote(actor)`` as an async actor (Ray is imported only here).

    ``actor`` is ``RouterActor`` or a subclass of it: the chaos tests start one that can also arm a
    migration fault (``tests/chaos/fault_router.py``, through ``start_cluster(router_actor=...)``),
    with the same actor options as production."""
    import ray

    return ray.remote(num_cpus=0, max_concurrency=1000)(actor)
