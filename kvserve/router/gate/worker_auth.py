"""The gate in front of the router's WorkerLink: only a worker the launcher started, speaking for
itself, gets a session (``kvserve/router/table/worker_link.py``).

A WorkerLink stream is accepted only when

1. its ``kvserve-worker-credential`` metadata is a valid MAC under this cluster's worker key
   (``kvserve/workers/core/worker_credential.py``) — else UNAUTHENTICATED, before any message is read (a
   client token or no credential at all gets this);
2. the id it proves is one the launcher registered (``expect``) — else PERMISSION_DENIED;
3. its first message is a ``Hello`` for that same id — else PERMISSION_DENIED (INVALID_ARGUMENT
   when it is no Hello; DEADLINE_EXCEEDED when none comes within ``hello_timeout_s``).

A refused stream never reaches ``WorkerLinkService`` (its sessions table does not grow, no restart
is counted, no command is delivered). Each refusal is logged once per (peer host, reason), in a
bounded table, so a hostile peer cannot flood the log.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterable

import grpc

from kvserve.protos.kvserve.v1 import worker_pb2 as pb
from kvserve.protos.kvserve.v1 import worker_pb2_grpc
from kvserve.router.table.worker_link import WorkerLinkService
from kvserve.workers.core.worker_credential import WORKER_CREDENTIAL_HEADER, verify_worker_credential

logger = logging.getLogger(__name__)

DEFAULT_HELLO_TIMEOUT_S = 10.0
_MAX_LOGGED_REFUSALS = 1024


class WorkerLinkGate(worker_pb2_grpc.WorkerLinkServicer):
    """Authenticates each WorkerLink stream, then hands it to ``link``.

    Args:
        link: the router's WorkerLink service (sessions, seq de-dup, commands).
        worker_key: this cluster's worker key (hex), from the launcher.
        hello_timeout_s: longest an authenticated stream may take to send its Hello.
    """

    def __init__(
        self, link: WorkerLinkService, worker_key: str, hello_timeout_s: float = DEFAULT_HELLO_TIMEOUT_S
    ) -> None:
        bytes.fromhex(worker_key)  # NOTE: fail at start-up on a malformed key, not on the first worker
        self.link = link
        self._key = worker_key
        self.hello_timeout_s = hello_timeout_s
        self._expected: set[str] = set()
        self._logged: OrderedDict[tuple[str, str], None] = OrderedDict()
        self.refusals_total = 0

    def expect(self, worker_ids: Iterable[str]) -> None:
        """Admit these worker ids (the launcher calls this before it starts their actors)."""
        self._expected.update(worker_ids)

    async def Connect(  # noqa: N802 - gRPC method name
        self, request_iterator: AsyncIterator[pb.WorkerMessage], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.RouterCommand]:
        metadata = dict(context.invocation_metadata() or ())
        worker_id = verify_worker_credential(self._key, metadata.get(WORKER_CREDENTIAL_HEADER))
        if worker_id is None:
            why = (
                "a client token does not open WorkerLink"
                if "authorization" in metadata and WORKER_CREDENTIAL_HEADER not in metadata
                else "missing or invalid worker credential"
            )
            await self._refuse(context, grpc.StatusCode.UNAUTHENTICATED, why)
        if worker_id not in self._expected:
            await self._refuse(
                context, grpc.StatusCode.PERMISSION_DENIED, f"worker {worker_id!r} is not one this cluster started"
            )
        it = request_iterator.__aiter__()
        try:
            first = await asyncio.wait_for(anext(it, None), self.hello_timeout_s)
        except TimeoutError:
            await self._refuse(context, grpc.StatusCode.DEADLINE_EXCEEDED, f"no Hello within {self.hello_timeout_s}s")
        if first is None or first.WhichOneof("body") != "hello":
            await self._refuse(
                context, grpc.StatusCode.INVALID_ARGUMENT, "the first WorkerLink message must be a Hello"
            )
        if first.hello.worker_id != worker_id:
            await self._refuse(
                context,
                grpc.StatusCode.PERMISSION_DENIED,
                f"the credential of {worker_id!r} cannot say Hello as {first.hello.worker_id[:64]!r}",
            )
        # NOTE: aclosing: when the stream ends, the session's finally (on_disconnect) runs now.
        async with contextlib.aclosing(self.link.serve(first, it, context)) as commands:
            async for cmd in commands:
                yield cmd

    async def _refuse(self, context: grpc.aio.ServicerContext, code: grpc.StatusCode, why: str) -> None:
        self.refusals_total += 1
        key = (context.peer().rpartition(":")[0], why)
        if key not in self._logged:
            self._logged[key] = None
            while len(self._logged) > _MAX_LOGGED_REFUSALS:
                self._logged.popitem(last=False)
            logger.warning("WorkerLink from %s refused (%s): %s", key[0], code.name, why)
        await context.abort(code, f"WorkerLink refused: {why}")

