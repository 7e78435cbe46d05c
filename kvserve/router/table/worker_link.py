"""The router's end of WorkerLink: accepts each worker's stream, de-duplicates its messages by
seq, acks them, and delivers commands (resending unapplied ones after a reconnect).
Authentication is the server's ``BearerAuthInterceptor`` (kvserve/router/gate/auth.py).

Message handling is delegated to a ``WorkerLinkHandler`` (the router's request table, prefix
index and pressure table); this module only keeps the link honest.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc

from kvserve.protos.kvserve.v1 import worker_pb2 as pb
from kvserve.protos.kvserve.v1 import worker_pb2_grpc
from kvserve.workers.core.kv_events import AllBlocksCleared, BlockEvent, BlockRemoved, BlockStored
from kvserve.workers.core.worker_credential import LINK_ACCEPTED_HEADER

logger = logging.getLogger(__name__)


class WorkerLinkHandler:
    """Callbacks, run on the router's event loop. Override what you need."""

    def on_hello(self, worker_id: str, hello: pb.Hello, restarted: bool) -> None: ...

    def on_message(self, worker_id: str, msg: pb.WorkerMessage) -> None: ...

    def on_disconnect(self, worker_id: str) -> None: ...


@dataclass
class _Session:
    incarnation: str = ""
    last_seq: int = 0  # highest WorkerMessage.seq processed
    acked_seq: int = 0  # highest seq acked to the worker
    next_command_seq: int = 1
    unapplied: dict[int, pb.RouterCommand] = field(default_factory=dict)
    queue: asyncio.Queue | None = None
    generation: int = 0


class WorkerLinkService(worker_pb2_grpc.WorkerLinkServicer):
    def __init__(
        self,
        handler: WorkerLinkHandler,
        ack_every: int = 32,
        ack_interval_s: float = 0.2,
    ) -> None:
        self.handler = handler
        self.ack_every = ack_every
        self.ack_interval_s = ack_interval_s
        self.sessions: dict[str, _Session] = {}

    def connected(self, worker_id: str) -> bool:
        s = self.sessions.get(worker_id)
        return s is not None and s.queue is not None

    def send(self, worker_id: str, command: pb.RouterCommand) -> int:
        """Queue a command for a worker (kept and resent until the worker reports applying it)."""
        s = self.sessions.setdefault(worker_id, _Session())
        command.seq = s.next_command_seq
        s.next_command_seq += 1
        s.unapplied[command.seq] = command
        if s.queue is not None:
            s.queue.put_nowait(command)
        return command.seq

    def withdraw(self, worker_id: str, seq: int) -> None:
        """Never resend command ``seq`` (one already on the wire may still arrive)."""
        s = self.sessions.get(worker_id)
        if s is not None:
            s.unapplied.pop(seq, None)

    def abort(self, worker_id: str, worker_rid: str) -> int:
        """Stop dispatch ``worker_rid`` on ``worker_id`` at its next step boundary (the one place an
        ``Abort`` is built; an abort of an id the worker no longer has is a no-op there)."""
        return self.send(worker_id, pb.RouterCommand(abort=pb.Abort(request_id=worker_rid)))

    async def Connect(  # noqa: N802 - gRPC method name
        self, request_iterator: AsyncIterator[pb.WorkerMessage], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.RouterCommand]:
        it = request_iterator.__aiter__()
        async for cmd in self.serve(await anext(it, None), it, context):
            yield cmd

    async def serve(
        self, first: pb.WorkerMessage | None, it: AsyncIterator[pb.WorkerMessage], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.RouterCommand]:
        """``Connect`` once its first message was read (the worker-auth layer reads it to check the
        Hello): the rest of the stream is read straight from gRPC's iterator, with no wrapper
        generator in between (the link carries a message per worker step)."""
        if first is None or first.WhichOneof("body") != "hello":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the first WorkerLink message must be a Hello")
        hello = first.hello
        worker_id = hello.worker_id
        s = self.sessions.setdefault(worker_id, _Session())
        restarted = bool(s.incarnation) and s.incarnation != hello.incarnation
        if s.incarnation != hello.incarnation:
            # A new process numbers its messages from 1 again; commands for the old one are moot.
            s.last_seq = s.acked_seq = 0
            s.unapplied.clear()
        s.incarnation = hello.incarnation
        if hello.last_command_seq >= s.next_command_seq:
            # NOTE: the worker drops a command whose seq it has seen (a resend): a restarted router (or frontend,
            # whose data service is this class) numbers its commands after what it applied from the previous
            # process, or its first Aborts and Reowns would vanish without an error. Nothing is unapplied here:
            # a new incarnation's Hello cleared it above, and the same one's last seq is below ours.
            s.next_command_seq = hello.last_command_seq + 1
        s.generation += 1
        generation = s.generation
        s.queue = queue = asyncio.Queue()
        for seq in sorted(s.unapplied):
            if seq > hello.last_command_seq:
                queue.put_nowait(s.unapplied[seq])
            else:
                del s.unapplied[seq]
        self.handler.on_hello(worker_id, hello, restarted)
        await context.send_initial_metadata(((LINK_ACCEPTED_HEADER, "1"),))
        # NOTE: an ack is due ``ack_every`` messages or ``ack_interval_s`` after the first unacked one, whichever
        # comes first: a timer armed by that message, not a wait that times out every interval (an idle link
        # then costs nothing; the timeouts were ~3 ms of CPU a second for two workers' links)
        ack_timer: asyncio.TimerHandle | None = None

        def ack_due() -> None:
            nonlocal ack_timer
            ack_timer = None
            queue.put_nowait(None)

        def unacked() -> None:
            nonlocal ack_timer
            if s.last_seq - s.acked_seq >= self.ack_every:
                queue.put_nowait(None)
            elif ack_timer is None:
                ack_timer = asyncio.get_running_loop().call_later(self.ack_interval_s, ack_due)

        reader = asyncio.create_task(self._read(worker_id, s, it, unacked))
        reader.add_done_callback(lambda _: queue.put_nowait(None))
        try:
            while True:
                cmd = await queue.get()
                if reader.done():
                    break
                if cmd is None and s.last_seq == s.acked_seq:
                    continue
                out = pb.RouterCommand() if cmd is None else _copy(cmd)
                out.acked_seq = s.acked_seq = s.last_seq
                yield out
        finally:
            reader.cancel()
            if ack_timer is not None:
                ack_timer.cancel()
            if s.generation == generation:
                s.queue = None
                self.handler.on_disconnect(worker_id)

    async def _read(
        self, worker_id: str, s: _Session, it: AsyncIterator[pb.WorkerMessage], unacked: Callable[[], None]
    ) -> None:
        try:
            async for msg in it:
                if msg.seq <= s.last_seq:
                    continue  # a replay after reconnect: already processed
                s.last_seq = msg.seq
                kind = msg.WhichOneof("body")
                if kind == "ack":
                    s.unapplied.pop(msg.ack.command_seq, None)
                try:
                    self.handler.on_message(worker_id, msg)
                except Exception:  # noqa: BLE001 - one bad message must not cut the link
                    logger.exception("handling %s from %s failed", kind, worker_id)
                unacked()
        except (grpc.aio.AioRpcError, asyncio.CancelledError):
            pass


def _copy(cmd: pb.RouterCommand) -> pb.RouterCommand:
    out = pb.RouterCommand()
    out.CopyFrom(cmd)
    return out


_TIERS = {pb.TIER_DEVICE: "device", pb.TIER_HOST: "host", pb.TIER_DISK: "disk"}


def block_event(e: pb.BlockEvent) -> BlockEvent:
    """A WorkerLink block event as the prefix index's dataclass (kvserve/workers/core/kv_events.py)."""
    kind = e.WhichOneof("kind")
    if kind == "stored":
        return BlockStored(e.seq, tuple(e.stored.hashes), _TIERS[e.stored.tier])
    if kind == "removed":
        return BlockRemoved(e.seq, tuple(e.removed.hashes), _TIERS[e.removed.tier])
    return AllBlocksCleared(e.seq)
