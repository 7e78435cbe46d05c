"""A frontend's data service: the WorkerLink service its owned requests' workers dial
(docs/architecture.md section 2a).

A worker streams an owned request's outputs to the request's owner over a *data link*: a
``WorkerLink.Connect`` stream to this service, with the router's own WorkerLink protocol (Hello first,
seq de-dup, acks, commands resent after a reconnect: ``kvserve/router/table/worker_link.py``), handled by
the frontend's ``OwnedRequests`` (``kvserve/frontend/owned.py``).

A data link is accepted only when

1. its ``kvserve-worker-credential`` metadata is a valid *data credential* under the frontend key
   (``verify_data_credential``: issued by the launcher to each worker, never the router's worker
   credential) — else UNAUTHENTICATED, before any message is read;
2. its first message is a ``Hello`` for the id the credential proves — else PERMISSION_DENIED
   (INVALID_ARGUMENT when it is no Hello; DEADLINE_EXCEEDED when none comes in time).

NOTE: no nonce/bind step (the router's rule 4, ``kvserve/router/gate/worker_auth.py``): a data link
carries outputs of requests this frontend owns, by keys only it and their workers know, and commands
only for those keys; a copied data credential cannot reach the router's request table.

The port is its own (not the shared client port: a client must never reach WorkerLink), bound on the
frontend's host with the client ports' TLS (``router.tls_cert``/``tls_key``/``tls_client_ca``: the
workers dial it with their WorkerLink credentials, which trust the router's certificate).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
from collections.abc import AsyncIterator

import grpc

from kvserve.frontend.owned import OwnedRequests
from kvserve.protos.kvserve.v1 import worker_pb2 as pb
from kvserve.protos.kvserve.v1 import worker_pb2_grpc
from kvserve.router.table.worker_link import WorkerLinkService
from kvserve.workers.core.tls import add_port
from kvserve.workers.core.worker_credential import WORKER_CREDENTIAL_HEADER, verify_data_credential

logger = logging.getLogger(__name__)

DEFAULT_HELLO_TIMEOUT_S = 10.0
_WILDCARDS = ("0.0.0.0", "::", "")


class DataLinkGate(worker_pb2_grpc.WorkerLinkServicer):
    """Authenticates each data link (rules 1-2 above), then hands it to ``link``.

    Args:
        link: the frontend's WorkerLink service (its handler: ``OwnedRequests``).
        frontend_key: the cluster's frontend key (data credentials are MACs under a key derived from it).
        hello_timeout_s: longest an authenticated stream may take to send its Hello.
    """

    def __init__(self, link: WorkerLinkService, frontend_key: str,
                 hello_timeout_s: float = DEFAULT_HELLO_TIMEOUT_S) -> None:  # fmt: skip
        self.link = link
        self._key = frontend_key
        self.hello_timeout_s = hello_timeout_s
        self.refusals_total = 0

    async def Connect(  # noqa: N802 - gRPC method name
        self, request_iterator: AsyncIterator[pb.WorkerMessage], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.RouterCommand]:
        metadata = dict(context.invocation_metadata() or ())
        worker_id = verify_data_credential(self._key, metadata.get(WORKER_CREDENTIAL_HEADER))
        if worker_id is None:
            await self._refuse(context, grpc.StatusCode.UNAUTHENTICATED, "missing or invalid data credential")
        it = request_iterator.__aiter__()
        try:
            first = await asyncio.wait_for(anext(it, None), self.hello_timeout_s)
        except TimeoutError:
            await self._refuse(context, grpc.StatusCode.DEADLINE_EXCEEDED, f"no Hello within {self.hello_timeout_s}s")
        if first is None or first.WhichOneof("body") != "hello":
            await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, "the first data link message must be a Hello")
        if first.hello.worker_id != worker_id:
            await self._refuse(context, grpc.StatusCode.PERMISSION_DENIED,
                               f"the data credential of {worker_id!r} cannot say Hello as "
                               f"{first.hello.worker_id[:64]!r}")  # fmt: skip
        # NOTE: aclosing: when the stream ends, the session's finally (on_disconnect) runs now.
        async with contextlib.aclosing(self.link.serve(first, it, context)) as commands:
            async for cmd in commands:
                yield cmd

    async def _refuse(self, context: grpc.aio.ServicerContext, code: grpc.StatusCode, why: str) -> None:
        # NOTE: counted, logged at debug only: the port is reachable by anyone on the network, the log is not theirs
        self.refusals_total += 1
        logger.debug("data link from %s refused (%s): %s", context.peer(), code.name, why)
        await context.abort(code, f"data link refused: {why}")


def advertise_host(bind_host: str, data_host: str | None) -> str:
    """The host workers dial the data service at: ``data_host`` if set; the bind host when it is one address;
    for a wildcard bind, this node's address (as the launcher advertises the router's WorkerLink for a
    wildcard bind: kvserve/cluster/launch.py), 127.0.0.1 when it has none but loopback."""
    if data_host:
        return data_host
    if bind_host not in _WILDCARDS:
        return bind_host
    return node_ip()


def node_ip() -> str:
    """This node's outward address (the interface a route out leaves by; no packet is sent), or 127.0.0.1."""
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("10.255.255.255", 1))
        ip = s.getsockname()[0]
        if not ipaddress.ip_address(ip).is_unspecified:
            return str(ip)
    return "127.0.0.1"


def _join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


class DataService:
    """The frontend's data service on its own ``grpc.aio`` server (``start`` / ``stop``).

    Args:
        owned: the frontend's owned requests (the links' handler; its ``service`` is set here).
        frontend_key: the cluster's frontend key.
        host: the bind host (the frontend's ``router.host``).
        port: the port (0: a free one).
        tls: ``(cert, key, client CA)`` PEM paths as the frontend's client ports use them; cert None: plaintext.
        data_host: the host to advertise (None: ``advertise_host``'s choice).
        options: gRPC server options (message size bounds).
    """

    def __init__(self, owned: OwnedRequests, frontend_key: str, host: str, port: int = 0,
                 tls: tuple[str | None, str | None, str | None] = (None, None, None), data_host: str | None = None,
                 options: list[tuple[str, int]] | None = None) -> None:  # fmt: skip
        self.owned = owned
        self.link = WorkerLinkService(owned)
        owned.service = self.link
        self.gate = DataLinkGate(self.link, frontend_key)
        self.host, self.port, self.tls, self.data_host = host, port, tls, data_host
        self.options = options or []
        self.address = ""
        self._server: grpc.aio.Server | None = None

    async def start(self) -> str:
        """Bind and serve; returns the advertised ``host:port`` (``Owner.address``).

        Raises:
            OSError: the port cannot be bound.
        """
        server = grpc.aio.server(options=self.options)
        worker_pb2_grpc.add_WorkerLinkServicer_to_server(self.gate, server)
        port = add_port(server, _join(self.host, self.port), *self.tls)
        if port == 0:
            raise OSError(f"cannot bind the frontend's data service at {self.host}:{self.port}")
        await server.start()
        self._server = server
        self.port = port
        self.address = _join(advertise_host(self.host, self.data_host), port)
        logger.info("data service on %s:%d (advertised %s)", self.host, port, self.address)
        return self.address

    async def stop(self, grace: float = 1.0) -> None:
        if self._server is not None:
            await self._server.stop(grace)
            self._server = None
