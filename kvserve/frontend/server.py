"""A stateless frontend: the client gRPC API and the OpenAI HTTP API, relayed to the router.

``FrontendServer`` runs on one event loop: a ``grpc.aio`` server (``kvserve.v1.KVServe``, health,
reflection) and the HTTP API (``kvserve/router/api/http_api.py`` over ``kvserve/frontend/http_backend.py``), both bound
with ``SO_REUSEPORT`` so N frontends share one gRPC port and one HTTP port (the kernel spreads new
connections over the live ones, as vLLM's ``--api-server-count`` does). What runs here instead of in
the router process: HTTP/JSON/SSE, request parsing and validation, the caller auth check (token or
API key), prompt tokenization and chat templating, logprob token text, per-caller stream writes.
What stays in the router: admission, placement, ordering and de-duplication, tenancy's scope,
priority bound and rate, and one ``GenerateBatch`` per worker step to each frontend.

Health: liveness (``kvserve.v1.Liveness``, ``/health/live``) while this process answers; readiness
(``""``, ``kvserve.v1.KVServe``, ``/health``, ``/health/ready``) mirrors the router's readiness,
re-read every ``READINESS_POLL_S`` (NOT_SERVING while the router cannot be reached).

Owned requests (docs/architecture.md section 2a): with a frontend key (and ``owned_streams``) the frontend
also serves its data service (``kvserve/frontend/data_service.py``, its own port) and owns every request it
relays: workers stream the outputs here directly, the router keeps only the decisions.

Process forms: ``FrontendActor`` (``kvserve serve --frontends N``: Ray actors on the router's node,
restarted by Ray after a crash) and ``kvserve frontend --router ADDR`` (a plain process, e.g. a
Kubernetes Deployment's pod). Both run this class.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvserve.frontend.data_service import DataService
from kvserve.frontend.grpc_api import FRONTEND_ID_HEADER, FrontendServicer
from kvserve.frontend.http_backend import RelayBackend
from kvserve.frontend.link import RouterLink
from kvserve.frontend.owned import OwnedRequests
from kvserve.frontend.relay import Relay, frontend_prompts
from kvserve.protos.kvserve.v1 import serving_pb2 as spb
from kvserve.router.api.grpc_surface import add_kvserve_servicer
from kvserve.router.api.health import LIVENESS_SERVICE, READINESS_SERVICES
from kvserve.router.api.http_api import HttpApiServer
from kvserve.router.config import RouterConfig
from kvserve.router.gate.auth import CallerAuthInterceptor
from kvserve.router.gate.limits import InputLimits
from kvserve.router.gate.tenancy import KeyRing, Tenancy
from kvserve.workers.core.gc_pauses import settle_heap
from kvserve.workers.core.reconnect import RECONNECT_OPTIONS
from kvserve.workers.core.tls import add_port, channel_credentials

logger = logging.getLogger(__name__)

READINESS_POLL_S = 0.5
FRONTEND_KEY_ENV = "KVSERVE_FRONTEND_KEY"


@dataclass(frozen=True)
class FrontendSettings:
    """One frontend's settings.

    Attributes:
        router_address: the router's gRPC ``host:port``.
        router: the cluster's router config: ``host`` (bind address), ``model`` (its tokenizer and
            chat template), ``served_model_name``, ``auth_token``, ``auth_keys``, the input bounds
            and ``max_buffered_responses`` apply here as on the router.
        grpc_port: the client gRPC port (shared by every frontend; 0 = a free one, this frontend alone).
        http_port: the HTTP API port (shared; None = off).
        frontend_id: this frontend's name (``kvserve-frontend`` response metadata, logs).
        frontend_key: the cluster's frontend key (None: the router counts relayed requests against
            this frontend's address instead of each end client's).
        link_tls: ``(CA of the router's certificate, client cert, client key)`` PEM paths for the
            connection to the router, as a worker's WorkerLink uses (``ClusterConfig.worker_options``:
            the router's own certificate as the CA, its key pair under mTLS); all None: plaintext.
            The client ports serve TLS with ``router.tls_cert``/``tls_key`` (and require client
            certificates with ``tls_client_ca``) as the router's do.
        owned_streams: own every relayed request (docs/architecture.md section 2a): serve a data service
            (``kvserve/frontend/data_service.py``) that workers stream the request's outputs to, so the
            router leaves the token path. Needs ``frontend_key`` (without one, or False, requests are
            relayed through the router as section 1 describes).
        data_port: the data service's port (0: a free one; each frontend its own, never shared).
        data_host: the host workers dial the data service at (None: the bind host when it is one address,
            else this node's address: ``data_service.advertise_host``).
    """

    router_address: str
    router: RouterConfig
    grpc_port: int
    http_port: int | None = None
    frontend_id: str = "frontend-0"
    frontend_key: str | None = None
    link_tls: tuple[str | None, str | None, str | None] = (None, None, None)
    owned_streams: bool = True
    data_port: int = 0
    data_host: str | None = None


class FrontendServer:
    """A frontend on the current event loop (``start`` / ``stop``)."""

    def __init__(self, settings: FrontendSettings) -> None:
        from kvserve.workers.text.chat_template import ChatTemplate
        from kvserve.workers.text.tokenizer import load_tokenizer

        self.settings = settings
        c = settings.router
        tokenizer = load_tokenizer(c.model) if c.model else None
        template = ChatTemplate.from_dir(c.model) if c.model else None
        self.tokenizer = tokenizer
        self.limits = InputLimits.from_config(c)
        self.tenancy = Tenancy(KeyRing.load(c.auth_keys), operator_token=c.auth_token) if c.auth_keys else None
        self._prompts = frontend_prompts(tokenizer, template, self.limits)
        self.ready = False
        self.grpc_port = 0
        self.http_port: int | None = None
        self._channel: grpc.aio.Channel | None = None
        self._link: RouterLink | None = None
        self.owned: OwnedRequests | None = None
        self._data: DataService | None = None
        self._server: grpc.aio.Server | None = None
        self._http: HttpApiServer | None = None
        self._poll: asyncio.Task | None = None

    async def start(self) -> tuple[int, int | None]:
        """Bind and serve; returns (gRPC port, HTTP port or None). Raises OSError if a port cannot be bound."""
        s, c = self.settings, self.settings.router
        options = [("grpc.max_receive_message_length", c.max_message_bytes),
                   ("grpc.max_send_message_length", c.max_message_bytes)]  # fmt: skip
        # NOTE: the router's channel: a restarted router is reached within 0.5 s of listening (core/reconnect.py)
        router_options = [*options, *RECONNECT_OPTIONS]
        link_credentials = channel_credentials(*s.link_tls)
        address = s.router_address
        self._channel = (grpc.aio.insecure_channel(address, options=router_options) if link_credentials is None
                         else grpc.aio.secure_channel(address, link_credentials, options=router_options))  # fmt: skip
        data_address = await self._start_data_service(options)
        self._link = RouterLink(self._channel, s.frontend_key, c.max_buffered_responses, self.owned, data_address)
        relay = Relay(self._link, self._prompts, self.limits)
        keys = self.tenancy.keys if self.tenancy is not None else None
        server = grpc.aio.server(interceptors=[CallerAuthInterceptor(c.auth_token, keys)],
                                 options=[*options, ("grpc.so_reuseport", 1)])  # fmt: skip
        add_kvserve_servicer(FrontendServicer(relay, s.frontend_id), server)  # type: ignore[arg-type]
        self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        await self._health.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)
        for name in READINESS_SERVICES:
            await self._health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        names = (spb.DESCRIPTOR.services_by_name["KVServe"].full_name,
                 health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME)  # fmt: skip
        reflection.enable_server_reflection(names, server)
        self.grpc_port = add_port(server, f"{c.host}:{s.grpc_port}", c.tls_cert, c.tls_key, c.tls_client_ca)
        if self.grpc_port == 0:
            raise OSError(f"cannot bind the frontend's gRPC port at {c.host}:{s.grpc_port}")
        await server.start()
        self._server = server
        if s.http_port is not None:
            model_names = (c.served_model_name or "", c.model or "", "")
            backend = RelayBackend(
                relay,
                self.tenancy,
                model_names,
                self.tokenizer,
                lambda: self.ready,
                default_timeout_s=c.http_default_timeout_s,
            )
            self._http = HttpApiServer(backend, c.host, s.http_port, c.auth_token, tls=c.tls_files(), reuse_port=True,
                                       served_by=(FRONTEND_ID_HEADER, s.frontend_id))  # fmt: skip
            self.http_port = await self._http.start()
        self._poll = asyncio.get_running_loop().create_task(self._mirror_readiness())
        logger.info("frontend %s serving gRPC on %s:%d%s, relaying to %s", s.frontend_id, c.host, self.grpc_port,
                    f" and HTTP on port {self.http_port}" if self.http_port else "", s.router_address)  # fmt: skip
        return self.grpc_port, self.http_port

    async def _start_data_service(self, options: list[tuple[str, int]]) -> str:
        """Serve the data service when this frontend owns its requests; its advertised address ("" = none)."""
        s, c = self.settings, self.settings.router
        if not (s.owned_streams and s.frontend_key):
            return ""
        self.owned = OwnedRequests()
        self._data = DataService(self.owned, s.frontend_key, c.host, s.data_port,
                                 (c.tls_cert, c.tls_key, c.tls_client_ca), s.data_host, options)  # fmt: skip
        return await self._data.start()

    @property
    def data_address(self) -> str:
        """The data service's advertised ``host:port`` ("" when it does not run)."""
        return self._data.address if self._data is not None else ""

    async def _mirror_readiness(self) -> None:
        assert self._channel is not None
        stub = health_pb2_grpc.HealthStub(self._channel)
        while True:
            try:
                got = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=READINESS_POLL_S * 4)
                ready = got.status == health_pb2.HealthCheckResponse.SERVING
            except grpc.aio.AioRpcError:
                ready = False
            if ready != self.ready:
                self.ready = ready
                status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
                for name in READINESS_SERVICES:
                    await self._health.set(name, status)
            await asyncio.sleep(READINESS_POLL_S)

    async def stop(self, grace: float = 1.0) -> None:
        if self._poll is not None:
            self._poll.cancel()
        if self._http is not None:
            await self._http.stop()
        if self._server is not None:
            await self._server.stop(grace)
        if self._link is not None:
            await self._link.close()
        if self._data is not None:  # NOTE: after the link: its close aborts the owned requests on their data links
            await self._data.stop(grace)
        if self._channel is not None:
            await self._channel.close()
        self._prompts.close()


class FrontendActor:
    """A ``FrontendServer`` in a Ray actor: it serves on its own thread and event loop from the
    constructor on, so a Ray restart (``max_restarts=-1``) serves again with no call from anyone."""

    def __init__(self, settings: FrontendSettings) -> None:
        self._bound = threading.Event()
        self._ports: tuple[int, int | None] | None = None
        self._error: BaseException | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, args=(settings,), name="kvserve-frontend", daemon=True)
        self._thread.start()

    def _run(self, settings: FrontendSettings) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._server = FrontendServer(settings)
            self._ports = self._loop.run_until_complete(self._server.start())
        except BaseException as e:  # noqa: BLE001 - reported by ports()
            self._error = e
            self._bound.set()
            return
        # NOTE: here, not in FrontendServer: this process is the frontend's alone.
        _, self.gc_pauses = settle_heap(f"frontend {settings.frontend_id}")
        self._bound.set()
        self._loop.run_forever()

    def ports(self, timeout_s: float = 120.0) -> tuple[int, int | None]:
        """(gRPC port, HTTP port) once bound. Raises what failed at start-up."""
        if not self._bound.wait(timeout_s):
            raise TimeoutError(f"frontend not serving after {timeout_s}s")
        if self._error is not None:
            raise self._error
        assert self._ports is not None
        return self._ports

    def pid(self) -> int:
        """This frontend's OS process id (chaos tests kill it)."""
        return os.getpid()

    def stop(self) -> None:
        if self._error is None and self._bound.is_set():
            future = asyncio.run_coroutine_threadsafe(self._server.stop(), self._loop)
            with contextlib.suppress(Exception):
                future.result(timeout=10)


def frontend_actor_class():
    """``ray.remote(FrontendActor)`` (Ray is imported only here). Threaded (``max_concurrency``):
    ``ports`` waits while ``pid`` answers."""
    import ray

    return ray.remote(num_cpus=0, max_concurrency=4)(FrontendActor)
