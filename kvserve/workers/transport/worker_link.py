"""The worker's end of WorkerLink: one gRPC bidi stream to the router, reconnecting with backoff.

Outgoing messages come from the ``Outbox`` (replayed after a reconnect); incoming commands are
handed to ``on_command`` (which only enqueues into the engine's inbox). Acks for our messages
ride on the router's commands (``acked_seq``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import grpc

from kvserve.protos.kvserve.v1 import worker_pb2 as pb
from kvserve.protos.kvserve.v1 import worker_pb2_grpc
from kvserve.workers.core.reconnect import RECONNECT_OPTIONS
from kvserve.workers.core.worker_credential import (
    LINK_ACCEPTED_HEADER,
    LINK_PROOF_HEADER,
    WORKER_CREDENTIAL_HEADER,
    link_proof,
)
from kvserve.workers.transport.outbox import Outbox

logger = logging.getLogger(__name__)


class WorkerLinkClient:
    """Keeps one Connect stream to ``address`` open until ``stop()``.

    Args:
        address: router's host:port.
        outbox: the worker's message log.
        hello: builds this connection's Hello (called on every connect).
        on_connect: called after a (re)connect, e.g. to queue a block snapshot.
        on_command: receives every RouterCommand with a command set (already de-duplicated).
        credential: this worker's credential (``kvserve/workers/core/worker_credential.py``), sent as
            ``kvserve-worker-credential`` metadata; the router refuses a WorkerLink without it.
            Once the router has given this process its nonce (``bind``), each connect also carries
            the proof binding it to this incarnation (``kvserve-worker-link-proof``).
    """

    def __init__(
        self,
        address: str,
        outbox: Outbox,
        hello: Callable[[], pb.Hello],
        on_connect: Callable[[], None],
        on_command: Callable[[pb.RouterCommand], None],
        credential: str | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        max_backoff_s: float = 2.0,
        first_backoff_s: float = 0.05,
    ) -> None:
        self.address = address
        self.outbox = outbox
        self._hello = hello
        self._on_connect = on_connect
        self._on_command = on_command
        self._credential = credential
        self._metadata = ((WORKER_CREDENTIAL_HEADER, credential),) if credential else ()
        self._nonce: str | None = None  # the router's one-time nonce for this process (``bind``)
        self._credentials = credentials
        self._max_backoff = max_backoff_s
        self._first_backoff = first_backoff_s
        self._stop = threading.Event()
        self._retry_now = threading.Event()  # NOTE: set by ``bind`` and ``stop``: ends a backoff wait early
        self._connected = threading.Event()
        self._disconnected_since = time.monotonic()
        self.last_command_seq = 0
        self.num_connects = 0
        self._call: grpc.Future | None = None
        self._thread = threading.Thread(target=self._run, name="worker-link", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def bind(self, nonce: str) -> None:
        """The router's nonce for this process (it comes through Ray: ``Worker.bind_link``); the next
        connect proves it. A later nonce replaces it (a new router, or the router re-issued one)."""
        self._nonce = nonce
        # NOTE: a new router binds its nonce once it has registered this worker: it refused the connects before
        # (FAILED_PRECONDITION), so connect now rather than after a backoff grown meanwhile (a router restart).
        self._retry_now.set()

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    def disconnected_for(self) -> float:
        """Seconds since the link was last connected (0.0 while connected, counted from start
        before the first connect)."""
        return 0.0 if self._connected.is_set() else time.monotonic() - self._disconnected_since

    def stop(self) -> None:
        self._stop.set()
        self._retry_now.set()
        if self._call is not None:
            self._call.cancel()
        self.outbox.close()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        backoff = self._first_backoff
        while not self._stop.is_set():
            try:
                self._session()
                backoff = self._first_backoff
            except grpc.RpcError as e:
                code = e.code() if hasattr(e, "code") else None
                if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                    logger.error("router %s refused this worker: %s", self.address, e.details())
                elif not self._stop.is_set():
                    logger.info("WorkerLink to %s broken (%s); reconnecting in %.2fs", self.address, code, backoff)
            except grpc.FutureTimeoutError:
                logger.info("router %s not reachable yet; retrying in %.2fs", self.address, backoff)
            except Exception:  # noqa: BLE001 - a link bug must not kill the worker; log and retry
                logger.exception("WorkerLink session failed")
            finally:
                if self._connected.is_set():
                    self._disconnected_since = time.monotonic()
                self._connected.clear()
                self.outbox.disconnected()
            if self._retry_now.wait(backoff):
                self._retry_now.clear()
                backoff = self._first_backoff
            else:
                backoff = min(backoff * 2, self._max_backoff)

    def _session(self) -> None:
        options = [("grpc.keepalive_time_ms", 10_000), ("grpc.max_receive_message_length", 64 << 20),
                   *RECONNECT_OPTIONS]  # fmt: skip
        if self._credentials is not None:
            channel = grpc.secure_channel(self.address, self._credentials, options=options)
        else:
            channel = grpc.insecure_channel(self.address, options=options)
        with channel:
            grpc.channel_ready_future(channel).result(timeout=5)
            stub = worker_pb2_grpc.WorkerLinkStub(channel)
            hello = pb.WorkerMessage(hello=self._hello())
            hello.hello.last_command_seq = self.last_command_seq
            metadata = self._metadata
            if self._credential and self._nonce:
                proof = link_proof(self._credential, hello.hello.incarnation, self._nonce)
                metadata = (*metadata, (LINK_PROOF_HEADER, proof))
            call = stub.Connect(self.outbox.open_stream([hello]), metadata=metadata)
            self._call = call
            self.num_connects += 1  # NOTE: attempts that reached the server, refused or not
            # NOTE: up only once the server says it accepted the Hello: a refusal (bad credential, an owner
            # that is not ours, a router without our nonce) ends the call before that header, and the link
            # stays down, so ``disconnected_for`` keeps counting and the owner's requests orphan in time
            accepted = dict(call.initial_metadata() or ()).get(LINK_ACCEPTED_HEADER) == "1"
            if not accepted or call.done():
                for _ in call:  # NOTE: raises the refusal's status (none: the server ended the stream)
                    pass
                return
            self._connected.set()
            self._on_connect()
            for cmd in call:
                if cmd.acked_seq:
                    self.outbox.ack(cmd.acked_seq)
                if cmd.WhichOneof("command") is None or cmd.seq <= self.last_command_seq:
                    continue
                self.last_command_seq = cmd.seq
                self._on_command(cmd)
