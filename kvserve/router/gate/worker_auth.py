"""The gate in front of the router's WorkerLink: only a worker the launcher started, speaking for
itself, gets a session (``kvserve/router/table/worker_link.py``).

A WorkerLink stream is accepted only when

1. its ``kvserve-worker-credential`` metadata is a valid MAC under this cluster's worker key
   (``kvserve/workers/core/worker_credential.py``) — else UNAUTHENTICATED, before any message is read (a
   client token or no credential at all gets this);
2. the id it proves is one the launcher registered (``expect``) — else PERMISSION_DENIED;
3. its first message is a ``Hello`` for that same id — else PERMISSION_DENIED (INVALID_ARGUMENT
   when it is no Hello; DEADLINE_EXCEEDED when none comes within ``hello_timeout_s``);
4. (with ``bind``, as the router always runs) the Hello's ``incarnation`` is the one this router last
   gave a nonce to through Ray, and its ``kvserve-worker-link-proof`` metadata proves that nonce
   (``kvserve/workers/core/worker_credential.py``; each nonce opens one session: once used, the live
   process is handed the next) — else FAILED_PRECONDITION, and the router (at most
   every ``BIND_INTERVAL_S`` per worker) hands the worker's live actor a fresh nonce, so a real
   process that lacks one (just started or restarted, or a new router) gets in on its next try,
   while a copied credential in any other process never does (issue 42).

A refused stream never reaches ``WorkerLinkService`` (its sessions table does not grow, no restart
is counted, no command is delivered). Each refusal is logged once per (peer host, reason), in a
bounded table, so a hostile peer cannot flood the log.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable

import grpc

from kvserve.protos.kvserve.v1 import worker_pb2 as pb
from kvserve.protos.kvserve.v1 import worker_pb2_grpc
from kvserve.router.table.worker_link import WorkerLinkService
from kvserve.workers.core.worker_credential import (
    LINK_PROOF_HEADER,
    WORKER_CREDENTIAL_HEADER,
    issue_worker_credential,
    new_link_nonce,
    verify_link_proof,
    verify_worker_credential,
)

logger = logging.getLogger(__name__)

DEFAULT_HELLO_TIMEOUT_S = 10.0
BIND_INTERVAL_S = 0.5  # NOTE: bounds the Ray calls refused Hellos can cause (one per worker per interval)
_MAX_LOGGED_REFUSALS = 1024
# (worker id, nonce) -> the incarnation of the worker's live actor, now holding the nonce (None: no actor)
Binder = Callable[[str, str], Awaitable[str | None]]


class WorkerLinkGate(worker_pb2_grpc.WorkerLinkServicer):
    """Authenticates each WorkerLink stream, then hands it to ``link``.

    Args:
        link: the router's WorkerLink service (sessions, seq de-dup, commands).
        worker_key: this cluster's worker key (hex), from the launcher.
        hello_timeout_s: longest an authenticated stream may take to send its Hello.
        bind: hands a worker's live actor a nonce through Ray (``Worker.bind_link``) and returns its
            incarnation; None (only for tests of other layers, with no actors) leaves out rule 4.
    """

    def __init__(
        self,
        link: WorkerLinkService,
        worker_key: str,
        hello_timeout_s: float = DEFAULT_HELLO_TIMEOUT_S,
        bind: Binder | None = None,
    ) -> None:
        bytes.fromhex(worker_key)  # NOTE: fail at start-up on a malformed key, not on the first worker
        self.link = link
        self._key = worker_key
        self.hello_timeout_s = hello_timeout_s
        self._expected: set[str] = set()
        self._logged: OrderedDict[tuple[str, str], None] = OrderedDict()
        self.refusals_total = 0
        self._bind = bind
        self._bound: dict[str, tuple[str, str]] = {}  # worker id -> (incarnation, nonce) it was given
        self._binding: dict[str, asyncio.Task] = {}
        self._last_bind: dict[str, float] = {}
        self.bind_interval_s = BIND_INTERVAL_S

    def bind_soon(self, worker_id: str, now_anyway: bool = False) -> None:
        """Give ``worker_id``'s live actor a fresh nonce (in the background; at most one call in
        flight and, unless ``now_anyway`` (after an accepted Hello: not a refusal's doing), one per
        ``bind_interval_s`` per worker)."""
        if self._bind is None or worker_id not in self._expected:
            return
        task = self._binding.get(worker_id)
        now = time.monotonic()
        recent = now - self._last_bind.get(worker_id, float("-inf")) < self.bind_interval_s
        if (task is not None and not task.done()) or (recent and not now_anyway):
            return
        self._last_bind[worker_id] = now
        self._binding[worker_id] = asyncio.get_running_loop().create_task(self._bind_one(worker_id))

    async def _bind_one(self, worker_id: str) -> None:
        assert self._bind is not None
        nonce = new_link_nonce()
        try:
            incarnation = await self._bind(worker_id, nonce)
        except Exception as e:  # noqa: BLE001 - Ray errors of many kinds: the next refused Hello retries
            logger.info("worker %s: could not hand its actor a link nonce (%s)", worker_id, type(e).__name__)
            return
        if incarnation:
            self._bound[worker_id] = (incarnation, nonce)

    def _proven(self, worker_id: str, incarnation: str, proof: object) -> bool:
        """Rule 4: the Hello's incarnation holds this router's nonce, and the proof shows it."""
        bound = self._bound.get(worker_id)
        if bound is None or bound[0] != incarnation or not isinstance(proof, str | bytes):
            return False
        return verify_link_proof(issue_worker_credential(self._key, worker_id), incarnation, bound[1], proof)

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
        if self._bind is not None and not self._proven(worker_id, first.hello.incarnation,
                                                       metadata.get(LINK_PROOF_HEADER)):  # fmt: skip
            self.bind_soon(worker_id)  # NOTE: reaches the live actor only: a copy elsewhere never gets it
            await self._refuse(
                context,
                grpc.StatusCode.FAILED_PRECONDITION,
                f"worker {worker_id!r}: this process holds no link nonce of this router for its incarnation "
                "(the router hands one to the worker's actor through Ray; retry)",
            )
        if self._bind is not None:
            # NOTE: one-time: the nonce is spent on this Hello (a replay of it is refused), and the live
            # process gets its next one now, for its next reconnect.
            self._bound.pop(worker_id, None)
            self.bind_soon(worker_id, now_anyway=True)
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
