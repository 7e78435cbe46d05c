"""A frontend's connection to the router: every request it relays rides ONE ``GenerateStream`` per
caller credential (``KVServe.GenerateStream``, kvserve/router/requests/mux.py), unbatched here by request id.

Why one stream per credential, not one per frontend: the router applies a caller's API key (tenant
scope, priority bound, rate, per-key streams: kvserve/router/gate/tenancy.py) to the stream it arrives on, so the
frontend relays each caller on a stream opened with that caller's own ``authorization``. It holds no
credential of its own that could widen what a key may do. Without API keys (no auth, or one bearer
token) every request shares the one stream.

The frontend credential (``kvserve/router/gate/auth.py`` ``frontend_trusted``) rides every stream; it lets the
router count each relayed request against the end client the frontend names (``client``), so
``max_streams_per_client`` still holds per client across all frontends.

Guarantees carried over the relay:

* order and de-duplication are the router's (kvserve/router/requests/demux.py): a request's responses leave the
  router in order, once, and one stream keeps them in order;
* deadlines: each request carries its caller's remaining deadline (``timeout_ms``); the router
  queues it only if it can start in time, and the caller's call ending cancels it;
* cancel: ``cancel`` sends ``cancel_request_id``; the router aborts the request (blocks freed). An id
  stays taken here until the router says the request ended, so a reused id can never be mistaken
  for the old one (the router ends the whole stream on an id in use); an owned request is known to the
  router by its owner key instead (``RelayedRequest.wire_id``), so its client's id is free once its final
  output came on the data link;
* slow consumers: more than ``max_buffered_responses`` responses a caller has not read: the request
  is cancelled at the router and ends RESOURCE_EXHAUSTED, as on the router (README "Failure behaviour");
* the router stream breaking (the router died or restarts): every request on it that is not an owned,
  placed one ends UNAVAILABLE (before its first response the client library retries it); the next
  request opens a new stream.

Owned requests (docs/architecture.md section 2a; with a data service, ``kvserve/frontend/data_service.py``):
each request carries ``Owner{data address, a fresh key}`` and is registered in ``OwnedRequests``
(``kvserve/frontend/owned.py``) before it is sent, so its worker streams its outputs here directly and the
router's stream carries only ``placed`` / ``replays`` / ``errors``. A placed request outlives its router
stream: when the stream breaks, the connection re-opens its ``GenerateStream`` at once while it still has
live requests (a restarted router's replay notices must reach it). A replay notice is answered with a
``Resume`` carrying exactly the tokens the client got. A cancel also aborts the request on its data link
(it works while the router is away). Each owned request gets a resume token (its first
response's ``resume_token``, granted at the router); ``take_over`` is the other side: a client whose frontend
died resumes here (docs/architecture.md section 2a, "Resuming through another frontend").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import secrets
import uuid
from collections.abc import AsyncIterator

import grpc

from kvserve.frontend.owned import OwnedRequests
from kvserve.protos.kvserve.v1 import serving_pb2 as spb
from kvserve.protos.kvserve.v1 import serving_pb2_grpc
from kvserve.router.gate.auth import FRONTEND_CREDENTIAL_HEADER
from kvserve.router.requests.demux import merge_responses
from kvserve.router.requests.mux import batch_responses
from kvserve.router.requests.request import RouterError

logger = logging.getLogger(__name__)

# NOTE: a batch of requests is one message: the router's per-message receive cost is paid once per batch
# (issue 41, router CPU per request); bounded so that a batch stays far below gRPC's message size limit.
MAX_BATCH = 64
MAX_BATCH_BYTES = 1 << 20
REOPEN_BACKOFF_S = (0.05, 2.0)  # NOTE: (first, most) wait before re-opening a stream that ended with no batch read
_CODES = {c.value[0]: c for c in grpc.StatusCode}


def request_error(err: spb.RequestError) -> RouterError:
    """A ``RequestError`` of the mux as the RouterError the router raised for it."""
    trailers = (("retry-after-ms", str(err.retry_after_ms)),) if err.retry_after_ms else ()
    return RouterError(_CODES.get(err.code, grpc.StatusCode.UNKNOWN), err.message, trailers)


class RelayedRequest:
    """One request relayed on a ``MuxConnection``: its responses, in the router's order."""

    def __init__(self, connection: MuxConnection, request_id: str, max_buffered: int,
                 owner_key: str | None = None) -> None:  # fmt: skip
        self.connection, self.request_id, self.max_buffered = connection, request_id, max_buffered
        self.owner_key = owner_key  # its Owner.key when owned (its outputs come on the data links)
        # NOTE: the id the router knows it by: an owned request's is its key, so the client may reuse its own id
        # as soon as the final output came on the data link, before the router has seen that finish.
        self.wire_id = owner_key if owner_key is not None else request_id
        self.generation = 0  # the connection's stream it was sent on (``MuxConnection.generation``)
        self.queue: asyncio.Queue[spb.GenerateResponse | RouterError] = asyncio.Queue()
        self.finished = False  # its final response or error is in ``queue`` (or it was dropped)
        # The field a text or chat prompt was sent as (it reached the router as token ids).
        self.prompt_field: str | None = None
        self._first: spb.GenerateResponse | RouterError | None = None
        self._answered = asyncio.Event()
        # The secret its client may resume it with through another frontend (docs/architecture.md section 2a):
        # on its first response; "" = not resumable (not owned).
        self.resume_token = ""

    def put(self, item: spb.GenerateResponse | RouterError) -> None:
        if self.finished:
            return
        if isinstance(item, RouterError) and self.prompt_field and item.message.startswith("prompt.token_ids"):
            item = RouterError(item.code, self.prompt_field + item.message.removeprefix("prompt.token_ids"),
                               item.trailers)  # fmt: skip
        if isinstance(item, RouterError) or item.finish_reason:
            self.finished = True
        elif self.queue.qsize() >= self.max_buffered:  # a slow consumer: as the router treats one
            self.finished = True
            while not self.queue.empty():
                self.queue.get_nowait()
            self.connection.send_cancel(self.wire_id)
            item = RouterError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"client too slow: over {self.max_buffered} responses unread "
                               "(limit max_buffered_responses)")  # fmt: skip
        self.queue.put_nowait(item)
        if self._first is None:
            self._first = item
            self._answered.set()

    async def first(self) -> spb.GenerateResponse | RouterError:
        """The router's first answer (a response or a refusal), left in the queue."""
        await self._answered.wait()
        assert self._first is not None
        return self._first

    async def responses(self) -> AsyncIterator[spb.GenerateResponse]:
        """Responses until the final one; RouterError if the request ended abnormally. Responses
        that waited are merged (same worker only), as ``kvserve/router/requests/demux.py`` ``stream_responses`` does."""
        token = self.resume_token
        while True:
            item = await self.queue.get()
            if isinstance(item, RouterError):
                raise item
            while not item.finish_reason and not self.queue.empty():
                nxt = self.queue._queue[0]  # type: ignore[attr-defined]  # NOTE: peek
                if isinstance(nxt, RouterError) or nxt.worker_id != item.worker_id:
                    break
                item = merge_responses(item, self.queue.get_nowait())  # type: ignore[arg-type]
            if token:  # NOTE: at yield time, after any merge (a merge keeps the later response's fields)
                item.resume_token, token = token, ""
            yield item
            if item.finish_reason:
                return

    def ended(self) -> None:
        """It ended on its data link (``kvserve/frontend/owned.py``): the router sends an owned request no final
        response, so its id is free on the stream now."""
        self.connection.forget(self)

    def cancel(self) -> None:
        """The caller went away (cancel, deadline, disconnect): abort it at the router (and, owned and placed,
        on its worker's data link) unless it ended."""
        if not self.finished:
            self.finished = True
            self.connection.send_cancel(self.wire_id)
            if self._first is None:  # NOTE: wakes an ``admitted`` wait on it
                self._first = RouterError(grpc.StatusCode.CANCELLED, "cancelled by the client")
                self._answered.set()


class MuxConnection:
    """One ``GenerateStream`` to the router for one caller credential (re-opened after a break while owned,
    placed requests are live on it).

    Args:
        stub: the router's KVServe stub.
        metadata: every call's metadata (the caller's ``authorization``, the frontend credential).
        max_buffered: the slow-consumer bound.
        owned: the frontend's owned requests (None: no data service, every request relayed through the router).
        data_address: ``Owner.address`` (the data service's advertised ``host:port``; "" = not owned).
    """

    def __init__(self, stub: serving_pb2_grpc.KVServeStub, metadata: tuple[tuple[str, str], ...],
                 max_buffered: int, owned: OwnedRequests | None = None, data_address: str = "") -> None:  # fmt: skip
        self.stub, self.metadata, self.max_buffered = stub, metadata, max_buffered
        self.owned = owned if data_address else None
        self.data_address = data_address
        self.live: dict[str, RelayedRequest] = {}  # by ``wire_id``
        self.by_client: dict[str, RelayedRequest] = {}  # the same, by the client's id
        self.closed = False
        self._stopping = False
        self.generation = 0  # bumps on every re-open
        self._outbox: asyncio.Queue[spb.GenerateStreamRequest | None] = asyncio.Queue()
        self._call = self._open()
        self._reader = asyncio.get_running_loop().create_task(self._read())

    def _open(self) -> grpc.aio.StreamStreamCall:
        # NOTE: wait_for_ready: a router restarting on the same port is waited for (within each
        # request's deadline), not failed at once.
        if self.owned is not None:
            # NOTE: says whose stream this is before any request: a restarted router's replay notices for the
            # requests it adopted (kvserve/router/requests/owned.py) find it even if no new request comes.
            self._outbox.put_nowait(spb.GenerateStreamRequest(owner=spb.Owner(address=self.data_address)))
        return self.stub.GenerateStream(self._requests(self._outbox), metadata=self.metadata, wait_for_ready=True)

    @staticmethod
    async def _requests(outbox: asyncio.Queue[spb.GenerateStreamRequest | None],
                        ) -> AsyncIterator[spb.GenerateStreamRequest]:  # fmt: skip
        carry: spb.GenerateStreamRequest | None = None
        while True:
            msg = carry if carry is not None else await outbox.get()
            carry = None
            if msg is None:
                return
            queued, size = [msg], msg.ByteSize()  # NOTE: what came while the last message was written: one batch
            while len(queued) < MAX_BATCH and not outbox.empty():
                if (more := outbox.get_nowait()) is None:
                    yield _one_message(queued)
                    return
                size += more.ByteSize()
                if size > MAX_BATCH_BYTES:
                    carry = more
                    break
                queued.append(more)
            yield _one_message(queued)

    def submit(self, request: spb.GenerateRequest, timeout_s: float | None, client: str) -> RelayedRequest:
        """Send ``request`` (its id set, its prompt as token ids) on the stream; owned (registered in
        ``owned`` before it is sent) when this connection has a data address.

        Raises:
            RouterError: ALREADY_EXISTS, its id is still live on this stream (as the router answers
                an id in use); UNAVAILABLE, the stream is closed.
        """
        rid = request.request_id
        if self.closed:
            raise RouterError(grpc.StatusCode.UNAVAILABLE, "the frontend lost its stream to the router; retry")
        if rid in self.by_client or rid in self.live:
            raise RouterError(grpc.StatusCode.ALREADY_EXISTS, f"request_id {rid!r} is in use")
        owner = None
        if self.owned is not None:
            owner = spb.Owner(address=self.data_address, key=uuid.uuid4().hex)
        rr = RelayedRequest(self, rid, self.max_buffered, owner.key if owner is not None else None)
        rr.generation = self.generation
        self.live[rr.wire_id] = rr
        self.by_client[rid] = rr
        grant = None
        if self.owned is not None and owner is not None:
            # NOTE: before the send: the worker's first output may come before the router's ``placed``.
            self.owned.register(owner.key, rr, list(request.token_ids.ids))
            wire = spb.GenerateRequest()
            wire.CopyFrom(request)
            wire.request_id = owner.key
            request = wire
            # NOTE: logprobs too: the worker keeps an owned request's to resend (kvserve/workers/transport/reown.py)
            rr.resume_token = secrets.token_hex(16)  # 128 bits
            grant = spb.ResumeGrant(token=rr.resume_token, request_id=rid)
        timeout_ms = 0 if timeout_s is None else max(1, math.ceil(timeout_s * 1000))
        # NOTE: token_columns: plain decode tokens come as columns, the router's cheapest path
        # (kvserve/router/requests/mux.py); on each request, not a message of its own, which a router that predates
        # the field could not answer (it ignores the field and sends responses only).
        self._outbox.put_nowait(spb.GenerateStreamRequest(generate=request, timeout_ms=timeout_ms, client=client,
                                                          token_columns=True, owner=owner,
                                                          resumable=grant))  # fmt: skip
        return rr

    def take_over(self, request: spb.GenerateRequest, client: str) -> RelayedRequest:
        """Ask the router to make this frontend the owner of ``request.request_id`` (its client resumes here with
        ``request.resume``: docs/architecture.md section 2a); its worker then resends its whole output here and
        ``OwnedRequests`` delivers only what follows the client's cursor. A refusal arrives on the handle.

        Raises:
            RouterError: as ``submit``; FAILED_PRECONDITION, this frontend owns no requests (no data service).
        """
        rid = request.request_id
        if self.owned is None:
            raise RouterError(grpc.StatusCode.FAILED_PRECONDITION, "this frontend resumes no streams (no data service)")
        if self.closed:
            raise RouterError(grpc.StatusCode.UNAVAILABLE, "the frontend lost its stream to the router; retry")
        if rid in self.by_client:
            raise RouterError(grpc.StatusCode.ALREADY_EXISTS, f"request_id {rid!r} is in use")
        owner = spb.Owner(address=self.data_address, key=uuid.uuid4().hex)
        rr = RelayedRequest(self, rid, self.max_buffered, owner.key)
        rr.generation = self.generation
        rr.resume_token = request.resume.token
        self.live[rr.wire_id] = rr
        self.by_client[rid] = rr
        state = self.owned.register(owner.key, rr, [])
        state.cursor = (request.resume.num_tokens, request.resume.num_text_chars)
        take = spb.TakeOver(request_id=rid, token=request.resume.token, owner=owner)
        self._outbox.put_nowait(spb.GenerateStreamRequest(take_over=take, client=client))
        return rr

    def send_cancel(self, request_id: str) -> None:
        """Cancel ``request_id`` (a ``wire_id``) at the router and, owned, on its worker's data link (where the
        router is away, that abort is what stops it)."""
        rr = self.live.get(request_id)
        if rr is not None and rr.owner_key is not None and self.owned is not None:
            self.owned.cancel(rr.owner_key)
            if rr.generation != self.generation:
                # NOTE: sent on a stream that broke since: the router it went to cannot end it, so its id is free now
                self.forget(rr)
        if not self.closed:
            self._outbox.put_nowait(spb.GenerateStreamRequest(cancel_request_id=request_id))

    def forget(self, rr: RelayedRequest) -> None:
        """``rr`` ended on its data link (the router sends an owned request no final response)."""
        if self.live.get(rr.wire_id) is rr:
            del self.live[rr.wire_id]
        if self.by_client.get(rr.request_id) is rr:
            del self.by_client[rr.request_id]

    async def _read(self) -> None:
        """Read every stream of this connection; re-open after a break while requests live on it."""
        why = "the router closed the stream"
        backoff = REOPEN_BACKOFF_S[0]
        try:
            while True:
                why, code, read_any = await self._read_call()
                if self._stopping:
                    why = "the frontend is stopping"
                    break
                if code == grpc.StatusCode.UNAUTHENTICATED:  # NOTE: the caller's credential, not the link
                    self._fail_all(RouterError(code, why))
                    break
                self._outbox.put_nowait(None)  # NOTE: ends the broken call's request generator
                self._outbox = asyncio.Queue()  # NOTE: at once: a submit from now on rides the next stream
                self.generation += 1
                self._on_break(why)
                if not self.live:
                    break
                backoff = REOPEN_BACKOFF_S[0] if read_any else min(backoff * 2, REOPEN_BACKOFF_S[1])
                if not read_any:
                    await asyncio.sleep(backoff)
                logger.info("router stream broke (%s): re-opening it for %d live requests", why, len(self.live))
                self._call = self._open()
        except asyncio.CancelledError:
            why = "the frontend is stopping"
        finally:
            self.closed = True
            self._fail_all(RouterError(grpc.StatusCode.UNAVAILABLE, f"{why}; retry"))
            logger.info("router stream closed: %s", why)

    async def _read_call(self) -> tuple[str, grpc.StatusCode | None, bool]:
        """Read the current call to its end: (why it ended, its status code or None, whether a batch came)."""
        read_any = False
        try:
            async for batch in self._call:
                read_any = True
                self._on_batch(batch)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.UNAUTHENTICATED:
                return e.details() or "unauthenticated", e.code(), read_any
            return f"stream to the router ended {e.code().name}: {e.details()}", e.code(), read_any
        return "the router closed the stream", None, read_any

    def _on_batch(self, batch: spb.GenerateBatch) -> None:
        owned = self.owned
        if owned is not None:
            for key in batch.placed:
                owned.placed(key)
            for key in batch.replays:
                ids = owned.replayed(key)
                if ids is not None:
                    self._outbox.put_nowait(spb.GenerateStreamRequest(resume=spb.Resume(owner_key=key,
                                                                                        output_ids=ids)))  # fmt: skip
        for resp in batch_responses(batch):
            rr = self.live.get(resp.request_id)
            if rr is None:
                continue
            rr.put(resp)
            if resp.finish_reason:
                self._ended(rr)
        for err in batch.errors:
            rr = self.live.get(err.request_id)
            if rr is None and owned is not None and err.request_id in owned.states:
                # NOTE: a request a restarted router adopted: its error comes under its key on this owner's
                # latest stream, which may be another caller's connection than the one it was sent on
                rr = owned.states[err.request_id].relayed  # type: ignore[assignment]
            if rr is not None:
                rr.put(request_error(err))
                rr.connection._ended(rr)

    def _ended(self, rr: RelayedRequest) -> None:
        self.forget(rr)
        if rr.owner_key is not None and self.owned is not None:
            self.owned.forget(rr.owner_key)

    def _on_break(self, why: str) -> None:
        """The stream broke: a request not placed ends UNAVAILABLE (its client retries it), one cancelled here
        is dropped (no router will answer its cancel); an owned, placed one stays live."""
        error = RouterError(grpc.StatusCode.UNAVAILABLE, f"{why}; retry")
        for rr in list(self.live.values()):
            if rr.finished:
                self.forget(rr)
            elif rr.owner_key is None or self.owned is None or not self.owned.is_placed(rr.owner_key):
                self.forget(rr)
                rr.put(error)
                if rr.owner_key is not None and self.owned is not None:
                    self.owned.forget(rr.owner_key)

    def _fail_all(self, error: RouterError) -> None:
        for rr in self.live.values():
            rr.put(error)
            if rr.owner_key is not None and self.owned is not None:
                self.owned.cancel(rr.owner_key)
        self.live.clear()
        self.by_client.clear()

    async def close(self) -> None:
        self._stopping = True
        self._outbox.put_nowait(None)
        self._call.cancel()
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._reader


class RouterLink:
    """Every ``MuxConnection`` of one frontend to one router, by caller credential.

    Args:
        channel: a ``grpc.aio`` channel to the router.
        frontend_key: the cluster's frontend key (sent as the frontend credential; None: none sent,
            so the router counts every relayed request against this frontend's address).
        max_buffered: the slow-consumer bound (``router.max_buffered_responses``).
        owned: the frontend's owned requests and ``data_address`` its data service's advertised address
            (both set: every request is owned, docs/architecture.md section 2a; else relayed through the router).
    """

    def __init__(self, channel: grpc.aio.Channel, frontend_key: str | None, max_buffered: int,
                 owned: OwnedRequests | None = None, data_address: str = "") -> None:  # fmt: skip
        self.owned, self.data_address = owned, data_address
        self.channel = channel
        self.stub = serving_pb2_grpc.KVServeStub(channel)
        self.frontend_key = frontend_key
        self.max_buffered = max_buffered
        self._connections: dict[str | None, MuxConnection] = {}

    def metadata(self, authorization: str | None) -> tuple[tuple[str, str], ...]:
        """What a call on behalf of a caller carries: its own ``authorization`` and the frontend credential."""
        md: list[tuple[str, str]] = []
        if authorization:
            md.append(("authorization", authorization))
        if self.frontend_key:
            md.append((FRONTEND_CREDENTIAL_HEADER, self.frontend_key))
        return tuple(md)

    def submit(self, authorization: str | None, request: spb.GenerateRequest, timeout_s: float | None,
               client: str) -> RelayedRequest:  # fmt: skip
        """Relay one request (its ``request_id`` set) for a caller already authenticated here."""
        return self._connection(authorization).submit(request, timeout_s, client)

    def take_over(self, authorization: str | None, request: spb.GenerateRequest, client: str) -> RelayedRequest:
        """Resume a stream another frontend owned (``MuxConnection.take_over``) for a caller authenticated here."""
        return self._connection(authorization).take_over(request, client)

    def _connection(self, authorization: str | None) -> MuxConnection:
        conn = self._connections.get(authorization)
        if conn is None or conn.closed:
            conn = MuxConnection(self.stub, self.metadata(authorization), self.max_buffered, self.owned,
                                 self.data_address)  # fmt: skip
            self._connections[authorization] = conn
        return conn

    def abort(self, authorization: str | None, request_id: str) -> bool | None:
        """The Abort RPC for an owned request of this caller: it ends CANCELLED here and is aborted at the router
        and on its worker (the router knows it by its key, not by ``request_id``). None: not an owned request of
        this caller's (the caller's Abort goes to the router as it is)."""
        conn = self._connections.get(authorization)
        rr = conn.by_client.get(request_id) if conn is not None else None
        if rr is None or rr.owner_key is None:
            return None
        if rr.finished:
            return False
        rr.put(RouterError(grpc.StatusCode.CANCELLED, "aborted by Abort RPC"))
        rr.connection.send_cancel(rr.wire_id)
        return True

    def live_requests(self) -> int:
        return sum(len(c.live) for c in self._connections.values() if not c.closed)

    async def close(self) -> None:
        for conn in self._connections.values():
            await conn.close()
        self._connections.clear()


def _one_message(queued: list[spb.GenerateStreamRequest]) -> spb.GenerateStreamRequest:
    """``queued`` as one GenerateStream message: itself when alone, else a batch the router reads in order."""
    if len(queued) == 1:
        return queued[0]
    return spb.GenerateStreamRequest(batch=spb.GenerateStreamRequests(requests=queued))
