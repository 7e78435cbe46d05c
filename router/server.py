"""gRPC servicers (client API + WorkerLink on one port) and the Router's Ray actor.

One ``grpc.aio`` server on the router's event loop serves ``kvserve.v1.KVServe`` for clients,
``kvserve.v1.WorkerLink`` for workers, the standard health service and server reflection (so
``grpcurl`` works with no .proto at hand). With an HTTP port, the OpenAI-compatible API
(``router/http_api.py``) runs on the same loop and the same Router.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from cluster import metrics
from protos.kvserve.v1 import serving_pb2 as spb
from protos.kvserve.v1 import serving_pb2_grpc, worker_pb2, worker_pb2_grpc
from router.auth import BearerAuthInterceptor
from router.config import RouterConfig
from router.http_api import HttpApiServer
from router.router import Router, RouterError

logger = logging.getLogger(__name__)

DEFAULT_WATCH_INTERVAL_MS = 500


class KVServeServicer(serving_pb2_grpc.KVServeServicer):
    def __init__(self, router: Router) -> None:
        self.router = router

    async def Generate(  # noqa: N802 - gRPC method name
        self, request: spb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[spb.GenerateResponse]:
        try:
            r = self.router.submit(request)
        except RouterError as e:
            await _abort(context, e)
            return
        try:
            async for response in self.router.stream(r):
                yield response
        except RouterError as e:
            await _abort(context, e)
        finally:
            # Cancelled by the client, past its deadline, or aborted: free its blocks now.
            if not r.finished:
                self.router.cancel(r)

    async def Abort(self, request: spb.AbortRequest, context: grpc.aio.ServicerContext) -> spb.AbortResponse:  # noqa: N802
        return spb.AbortResponse(found=self.router.abort(request.request_id))

    async def GetClusterStatus(  # noqa: N802
        self, request: spb.ClusterStatusRequest, context: grpc.aio.ServicerContext
    ) -> spb.ClusterStatus:
        return self.router.cluster_status()

    async def WatchBlockPressure(  # noqa: N802
        self, request: spb.WatchRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[spb.ClusterStatus]:
        interval = max(request.interval_ms or DEFAULT_WATCH_INTERVAL_MS, 50) / 1000
        while True:
            yield self.router.cluster_status()
            await asyncio.sleep(interval)


async def _abort(context: grpc.aio.ServicerContext, e: RouterError) -> None:
    if e.trailers:
        context.set_trailing_metadata(e.trailers)
    await context.abort(e.code, e.message)


def _read(path: str | None) -> bytes | None:
    return Path(path).read_bytes() if path else None


def build_server(router: Router, config: RouterConfig) -> tuple[grpc.aio.Server, int]:
    """The gRPC server with every service registered and its port bound (not started)."""
    options = [
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.so_reuseport", 0),
    ]
    interceptors = [BearerAuthInterceptor(config.auth_token)] if config.auth_token else []
    server = grpc.aio.server(interceptors=interceptors, options=options)
    serving_pb2_grpc.add_KVServeServicer_to_server(KVServeServicer(router), server)
    worker_pb2_grpc.add_WorkerLinkServicer_to_server(router.link, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = (
        spb.DESCRIPTOR.services_by_name["KVServe"].full_name,
        worker_pb2.DESCRIPTOR.services_by_name["WorkerLink"].full_name,
        health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
        reflection.SERVICE_NAME,
    )
    reflection.enable_server_reflection(names, server)
    address = f"{config.host}:{config.port}"
    if config.tls_cert:
        creds = grpc.ssl_server_credentials(
            [(_read(config.tls_key), _read(config.tls_cert))],
            root_certificates=_read(config.tls_client_ca),
            require_client_auth=bool(config.tls_client_ca),
        )
        port = server.add_secure_port(address, creds)
    else:
        port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"cannot bind the router's gRPC port at {address}")
    server._kvserve_health = health_servicer  # type: ignore[attr-defined]
    return server, port


class RouterService:
    """Router + gRPC server + health loop + metrics endpoint on the current event loop.

    Used directly in tests and wrapped as the ``RouterActor`` on a Ray cluster.
    """

    def __init__(self, config: RouterConfig, metrics_port: int | None = None, http_port: int | None = None) -> None:
        """
        Args:
            metrics_port: Prometheus ``/metrics`` (None = off).
            http_port: the OpenAI-compatible HTTP API (None = off, 0 = a free port: see ``http_port()``).
        """
        from workers.chat_template import ChatTemplate
        from workers.tokenizer import load_tokenizer

        self.config = config
        tokenizer = load_tokenizer(config.model) if config.model else None
        template = ChatTemplate.from_dir(config.model) if config.model else None
        self.router = Router(config, tokenizer=tokenizer, chat_template=template)
        self.metrics_port = metrics_port
        self.port = 0
        self._http_port = http_port
        self._http: HttpApiServer | None = None
        self._server: grpc.aio.Server | None = None
        self._health_task: asyncio.Task | None = None

    async def start(self) -> str:
        """Start serving; returns the bound ``host:port``."""
        server, self.port = build_server(self.router, self.config)
        await server.start()
        await server._kvserve_health.set("", health_pb2.HealthCheckResponse.SERVING)  # type: ignore[attr-defined]
        self._server = server
        self._health_task = asyncio.get_running_loop().create_task(self.router.health_loop())
        metrics.ROUTER_QUEUE_REQUESTS.set_function(lambda: self.router.queue.num_requests)
        metrics.ROUTER_QUEUE_BLOCKS.set_function(lambda: self.router.queue.num_blocks)
        if self.metrics_port is not None:
            metrics.start_metrics_server(self.metrics_port, self.config.host)
        if self._http_port is not None:
            # NOTE: on this loop, beside grpc.aio: one Router, one request table, no extra hop.
            self._http = HttpApiServer(self.router, self.config.host, self._http_port, self.config.auth_token)
            try:
                self._http_port = await self._http.start()
            except BaseException:
                await self.stop()
                raise
        logger.info("router serving on %s:%d", self.config.host, self.port)
        return f"{self.config.host}:{self.port}"

    async def add_worker(self, worker_id: str, handle: Any, info: dict[str, Any]) -> None:
        self.router.add_worker(worker_id, handle, info)
        entry = self.router.workers[worker_id]
        metrics.REPORT_AGE.labels(worker_id).set_function(
            lambda: time.monotonic() - entry.report_time if entry.report is not None else float("nan")
        )

    async def wait_for_workers(self, worker_ids: list[str], timeout: float = 120.0) -> None:
        await self.router.wait_for_workers(worker_ids, timeout)

    async def cluster_status(self) -> bytes:
        return self.router.cluster_status().SerializeToString()

    async def migrate(self, request_id: str, dst_worker_id: str) -> bool:
        return await self.router.migrate(request_id, dst_worker_id)

    async def address(self) -> str:
        return f"{self.config.host}:{self.port}"

    async def http_port(self) -> int | None:
        """The HTTP API's bound port (None = off)."""
        return self._http_port if self._http is not None else None

    async def stop(self, grace: float = 1.0) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
        if self._http is not None:
            await self._http.stop()
            self._http = None
        if self._server is not None:
            await self._server.stop(grace)
            self._server = None


def router_actor_class():
    """``ray.remote(RouterService)`` as an async actor (Ray is imported only here)."""
    import ray

    return ray.remote(num_cpus=0, max_concurrency=1000)(RouterService)
