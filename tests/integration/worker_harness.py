"""A recording test router: the real router-side ``WorkerLinkService`` on a grpc.aio server in a
background event-loop thread, with a handler that records everything the workers send.

Tests drive workers (Ray actors or ``WorkerCore``) pointed at ``router.address`` and read back what
arrived: tokens per request, pressure reports, block events and snapshots, acks, export results.
The server can be stopped and started again on the same port (a router restart) while the
``WorkerLinkService`` (its per-worker sessions: seq de-dup, acks, unapplied commands) survives, as
it would in a router actor whose gRPC server restarted.

Thread contract: handler callbacks run on the loop thread and append under ``_cond``; readers on
the test thread copy under the same lock. ``service.send`` runs on the loop thread (it touches
asyncio queues).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc

from kvserve.protos.kvserve.v1 import worker_pb2 as pb
from kvserve.protos.kvserve.v1 import worker_pb2_grpc
from kvserve.router.table.worker_link import WorkerLinkHandler, WorkerLinkService
from kvserve.workers.core.step_columns import column_entries, entry_output


@dataclass(frozen=True)
class HelloRecord:
    worker_id: str
    hello: pb.Hello
    restarted: bool
    time: float


@dataclass(frozen=True)
class SnapshotRecord:
    """A BlockSnapshot and, at its arrival, the hash set folded from the block events seen so far."""

    snapshot: pb.BlockSnapshot
    time: float
    last_event_seq: int  # seq of the last block event applied before the snapshot arrived
    event_hashes: frozenset[int]  # stored minus removed (reset by cleared), from events alone


@dataclass
class _WorkerRecord:
    messages: list[tuple[float, pb.WorkerMessage]] = field(default_factory=list)  # a step's parts apart
    seqs: list[int] = field(default_factory=list)  # of each message as it arrived (a step's once)
    hashes: set[int] = field(default_factory=set)  # the prefix index a router would build
    last_event_seq: int = 0
    snapshots: list[SnapshotRecord] = field(default_factory=list)
    disconnects: int = 0


@dataclass
class _Trigger:
    request_id: str
    min_tokens: int
    fn: Callable[[], object]
    fired: bool = False


class RecordingHandler(WorkerLinkHandler):
    """Records every Hello, message and disconnect (runs on the router's event loop)."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.hellos: list[HelloRecord] = []
        self.workers: dict[str, _WorkerRecord] = {}
        # request id -> [(worker id, RequestOutput)] in arrival order
        self.outputs: dict[str, list[tuple[str, pb.RequestOutput]]] = {}
        self.triggers: list[_Trigger] = []
        self.errors: list[str] = []  # handler-side consistency breaks (asserted by tests)

    def _rec(self, worker_id: str) -> _WorkerRecord:
        return self.workers.setdefault(worker_id, _WorkerRecord())

    def on_hello(self, worker_id: str, hello: pb.Hello, restarted: bool) -> None:
        with self.cond:
            copy = pb.Hello()
            copy.CopyFrom(hello)
            self.hellos.append(HelloRecord(worker_id, copy, restarted, time.monotonic()))
            self._rec(worker_id)
            self.cond.notify_all()

    def on_disconnect(self, worker_id: str) -> None:
        with self.cond:
            self._rec(worker_id).disconnects += 1
            self.cond.notify_all()

    def on_message(self, worker_id: str, msg: pb.WorkerMessage) -> None:
        with self.cond:
            self._rec(worker_id).seqs.append(msg.seq)
        for part in unbundle(msg):
            self._on_part(worker_id, part)

    def _on_part(self, worker_id: str, msg: pb.WorkerMessage) -> None:
        fire: list[_Trigger] = []
        with self.cond:
            rec = self._rec(worker_id)
            now = time.monotonic()
            rec.messages.append((now, msg))
            kind = msg.WhichOneof("body")
            if kind == "step_outputs":
                # NOTE: the columns first, as the router reads them (a request's entries precede its output)
                columns = [entry_output(*e) for e in column_entries(msg.step_outputs.columns)]
                for out in (*columns, *msg.step_outputs.outputs):
                    self.outputs.setdefault(out.request_id, []).append((worker_id, out))
                for t in self.triggers:
                    if not t.fired and self._num_tokens(t.request_id) >= t.min_tokens:
                        t.fired = True
                        fire.append(t)
            elif kind == "block_events":
                for ev in msg.block_events.events:
                    if ev.seq != rec.last_event_seq + 1:
                        self.errors.append(f"{worker_id}: block event seq {ev.seq} after {rec.last_event_seq}")
                    rec.last_event_seq = ev.seq
                    which = ev.WhichOneof("kind")
                    if which == "stored":
                        rec.hashes.update(ev.stored.hashes)
                    elif which == "removed":
                        rec.hashes.difference_update(ev.removed.hashes)
                    else:
                        rec.hashes.clear()
            elif kind == "block_snapshot":
                rec.snapshots.append(SnapshotRecord(msg.block_snapshot, now, rec.last_event_seq, frozenset(rec.hashes)))
            self.cond.notify_all()
        for t in fire:  # outside the lock: the callback may call back into the router
            t.fn()

    def _num_tokens(self, request_id: str) -> int:
        return sum(len(o.new_token_ids) for _, o in self.outputs.get(request_id, ()))


def unbundle(msg: pb.WorkerMessage) -> list[pb.WorkerMessage]:
    """A step's ``StepMessages`` as the messages it carries (outputs, events, pressure; each with the
    step's seq), so the recorder sees every kind as its own message; any other message as is."""
    if msg.WhichOneof("body") != "step":
        return [msg]
    step = msg.step
    parts = [("step_outputs", "outputs"), ("block_events", "events"), ("pressure", "pressure")]
    return [
        pb.WorkerMessage(seq=msg.seq, **{kind: getattr(step, field)}) for kind, field in parts if step.HasField(field)
    ]


class CountingWorkerLinkService(WorkerLinkService):
    """The real service, also counting the replayed messages its seq de-dup drops (per worker)."""

    def __init__(self, handler: WorkerLinkHandler, ack_every: int = 32, ack_interval_s: float = 0.2) -> None:
        super().__init__(handler, ack_every=ack_every, ack_interval_s=ack_interval_s)
        self.replayed: Counter[str] = Counter()

    async def Connect(  # noqa: N802 - gRPC method name
        self, request_iterator: AsyncIterator[pb.WorkerMessage], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.RouterCommand]:
        # NOTE: aclosing: when the stream ends, the inner generator's finally (on_disconnect) runs now.
        async with contextlib.aclosing(super().Connect(self._count(request_iterator), context)) as commands:
            async for cmd in commands:
                yield cmd

    async def _count(self, it: AsyncIterator[pb.WorkerMessage]) -> AsyncIterator[pb.WorkerMessage]:
        worker_id = None
        async for msg in it:
            if msg.WhichOneof("body") == "hello":
                worker_id = msg.hello.worker_id
            elif worker_id is not None and msg.seq <= self.sessions[worker_id].last_seq:
                self.replayed[worker_id] += 1
            yield msg


class RecordingRouter:
    """Owns the event-loop thread, the gRPC server and the ``WorkerLinkService``.

    Args:
        ack_every / ack_interval_s: passed to ``WorkerLinkService``.
    """

    def __init__(self, ack_every: int = 32, ack_interval_s: float = 0.2) -> None:
        self.handler = RecordingHandler()
        self.service = CountingWorkerLinkService(self.handler, ack_every=ack_every, ack_interval_s=ack_interval_s)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="recording-router", daemon=True)
        self._thread.start()
        self._server: grpc.aio.Server | None = None
        self.port = 0

    # ---- lifecycle -----------------------------------------------------------------------
    @property
    def address(self) -> str:
        assert self.port, "router not started"
        return f"127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        return self._server is not None

    def _run(self, coro, timeout: float = 10.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def start(self) -> RecordingRouter:
        """Serve on 127.0.0.1 (a free port the first time, the same port after a stop)."""
        assert self._server is None, "already serving"

        async def start() -> tuple[grpc.aio.Server, int]:
            server = grpc.aio.server()
            worker_pb2_grpc.add_WorkerLinkServicer_to_server(self.service, server)
            port = server.add_insecure_port(f"127.0.0.1:{self.port}")
            await server.start()
            return server, port

        deadline = time.monotonic() + 10
        while True:
            try:
                self._server, port = self._run(start())
                break
            except RuntimeError:  # the old socket may linger for a moment after a stop
                if not self.port or time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        assert port and (not self.port or port == self.port), f"bound port {port}, wanted {self.port}"
        self.port = port
        return self

    def stop(self, grace: float | None = 0) -> dict[str, int]:
        """Kill the gRPC server (streams are cut); the service and recordings stay.

        Returns, per worker, the messages processed but not yet acked at the cut (at least that
        many will be replayed, and dropped by the de-dup, after the worker reconnects).
        """
        server, self._server = self._server, None
        if server is None:
            return {}

        async def stop() -> dict[str, int]:
            unacked = {w: s.last_seq - s.acked_seq for w, s in self.service.sessions.items()}
            await server.stop(grace)
            return unacked

        return self._run(stop())

    def restart(self) -> None:
        self.stop()
        self.start()

    def close(self) -> None:
        self.stop()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)

    def set_ack_policy(self, ack_every: int, ack_interval_s: float) -> None:
        """Change how often the service acks (e.g. hold acks so a cut stream must be replayed);
        a stream waiting on the old interval picks the new one up after that wait."""

        async def apply() -> None:
            self.service.ack_every, self.service.ack_interval_s = ack_every, ack_interval_s

        self._run(apply())

    def unapplied(self, worker_id: str) -> list[pb.RouterCommand]:
        """Commands the service still holds for a worker (sent, not yet acked or answered)."""

        async def read() -> list[pb.RouterCommand]:
            s = self.service.sessions.get(worker_id)
            return list(s.unapplied.values()) if s else []

        return self._run(read())

    def replayed(self) -> dict[str, int]:
        """Per worker: replayed messages the service's seq de-dup has dropped so far."""

        async def read() -> dict[str, int]:
            return dict(self.service.replayed)

        return self._run(read())

    # ---- commands ------------------------------------------------------------------------
    def send(self, worker_id: str, command: pb.RouterCommand) -> int:
        """``service.send`` on the loop thread; returns the command's seq."""

        async def send() -> int:
            return self.service.send(worker_id, command)

        return self._run(send())

    def send_soon(self, worker_id: str, command: pb.RouterCommand) -> None:
        """Fire-and-forget ``service.send`` (safe from a handler callback on the loop thread)."""
        self.loop.call_soon_threadsafe(self.service.send, worker_id, command)

    def on_tokens(self, request_id: str, min_tokens: int, fn: Callable[[], object]) -> None:
        """Call ``fn`` once (on the loop thread) as soon as ``min_tokens`` tokens of the request arrived."""
        with self.handler.cond:
            self.handler.triggers.append(_Trigger(request_id, min_tokens, fn))

    # ---- waiting and reading ---------------------------------------------------------------
    def wait_for(self, predicate: Callable[[], object], timeout: float = 20.0, what: str = "condition"):
        """Block until ``predicate()`` (called under the recording lock) is truthy; return its value."""
        deadline = time.monotonic() + timeout
        with self.handler.cond:
            while True:
                value = predicate()
                if value:
                    return value
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
                self.handler.cond.wait(min(left, 0.1))

    def messages(self, worker_id: str, kind: str | None = None) -> list[pb.WorkerMessage]:
        with self.handler.cond:
            rec = self.handler.workers.get(worker_id)
            msgs = [m for _, m in rec.messages] if rec else []
        return [m for m in msgs if kind is None or m.WhichOneof("body") == kind]

    def seqs(self, worker_id: str) -> list[int]:
        """The seq of every message the worker's link delivered, in arrival order."""
        with self.handler.cond:
            rec = self.handler.workers.get(worker_id)
            return list(rec.seqs) if rec else []

    def timed_messages(self, worker_id: str, kind: str) -> list[tuple[float, pb.WorkerMessage]]:
        with self.handler.cond:
            rec = self.handler.workers.get(worker_id)
            msgs = list(rec.messages) if rec else []
        return [(t, m) for t, m in msgs if m.WhichOneof("body") == kind]

    def pressure(self, worker_id: str) -> list[pb.PressureReport]:
        return [m.pressure for m in self.messages(worker_id, "pressure")]

    def block_events(self, worker_id: str) -> list[pb.BlockEvent]:
        return [e for m in self.messages(worker_id, "block_events") for e in m.block_events.events]

    def snapshots(self, worker_id: str) -> list[SnapshotRecord]:
        with self.handler.cond:
            rec = self.handler.workers.get(worker_id)
            return list(rec.snapshots) if rec else []

    def event_hashes(self, worker_id: str) -> tuple[int, set[int]]:
        """(last block-event seq, hash set) folded from the events received so far."""
        with self.handler.cond:
            rec = self.handler.workers[worker_id]
            return rec.last_event_seq, set(rec.hashes)

    def hellos(self, worker_id: str) -> list[HelloRecord]:
        with self.handler.cond:
            return [h for h in self.handler.hellos if h.worker_id == worker_id]

    def disconnects(self, worker_id: str) -> int:
        with self.handler.cond:
            rec = self.handler.workers.get(worker_id)
            return rec.disconnects if rec else 0

    def acks(self, worker_id: str) -> list[pb.CommandAck]:
        return [m.ack for m in self.messages(worker_id, "ack")]

    def outputs(self, request_id: str, worker_id: str | None = None) -> list[pb.RequestOutput]:
        with self.handler.cond:
            outs = list(self.handler.outputs.get(request_id, ()))
        return [o for w, o in outs if worker_id is None or w == worker_id]

    def tokens(self, request_id: str, worker_id: str | None = None) -> list[int]:
        """Every token streamed for a request (from every worker, in arrival order, unless one is named)."""
        return [t for o in self.outputs(request_id, worker_id) for t in o.new_token_ids]

    def finish_reason(self, request_id: str) -> str:
        return next((o.finish_reason for o in self.outputs(request_id) if o.finish_reason), "")

    def _finished_unlocked(self, request_ids) -> bool:
        outs = self.handler.outputs
        return all(any(o.finish_reason for _, o in outs.get(rid, ())) for rid in request_ids)

    def wait_finished(self, request_ids, timeout: float = 30.0) -> dict[str, list[int]]:
        """Wait until every request streamed a finish reason; returns the tokens per request."""
        ids = list(request_ids)
        self.wait_for(lambda: self._finished_unlocked(ids), timeout, f"requests {ids} to finish")
        return {rid: self.tokens(rid) for rid in ids}

    def wait_tokens(self, request_id: str, n: int, timeout: float = 20.0) -> list[int]:
        self.wait_for(lambda: self.handler._num_tokens(request_id) >= n, timeout, f"{n} tokens of {request_id}")
        return self.tokens(request_id)
