"""The worker's ordered, resendable message log toward the router.

Every WorkerMessage gets the next sequence number and stays in the log until the router acks a
seq at or beyond it. After a reconnect the link replays the log from the start; the router drops
what it already has by seq. So a broken link never loses outputs that were produced.
Pressure reports are not logged while disconnected: a fresh one follows the reconnect.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Iterator

from protos.kvserve.v1 import worker_pb2 as pb

logger = logging.getLogger(__name__)


class Outbox:
    def __init__(self, max_messages: int = 100_000) -> None:
        self._cond = threading.Condition()
        self._log: deque[pb.WorkerMessage] = deque()
        self._seq = 0
        self._acked = 0
        self.max_messages = max_messages
        self.connected = False
        self._closed = False
        self._generation = 0  # bumps on every (re)connect; old stream generators end

    @property
    def last_seq(self) -> int:
        return self._seq

    def put(self, msg: pb.WorkerMessage) -> int | None:
        """Stamp and log a message; returns its seq (None if dropped: pressure while disconnected)."""
        with self._cond:
            if not self.connected and msg.WhichOneof("body") == "pressure":
                return None
            self._seq += 1
            msg.seq = self._seq
            self._log.append(msg)
            if len(self._log) > self.max_messages:
                dropped = self._log.popleft()
                logger.warning("outbox full: dropped message seq %d (router unreachable?)", dropped.seq)
            self._cond.notify_all()
            return self._seq

    def ack(self, seq: int) -> None:
        """The router has processed every message up to ``seq``."""
        with self._cond:
            self._acked = max(self._acked, seq)
            while self._log and self._log[0].seq <= self._acked:
                self._log.popleft()

    def pending(self) -> int:
        with self._cond:
            return len(self._log)

    def open_stream(self, first: list[pb.WorkerMessage]) -> Iterator[pb.WorkerMessage]:
        """Messages for one connection: ``first`` (unlogged: Hello), then the whole log, then live ones."""
        with self._cond:
            self._generation += 1
            generation = self._generation
            self.connected = True

        def stream() -> Iterator[pb.WorkerMessage]:
            yield from first
            cursor = 0
            while True:
                with self._cond:
                    while not self._closed and generation == self._generation and (
                        not self._log or self._log[-1].seq <= cursor
                    ):
                        self._cond.wait(timeout=0.5)
                    if self._closed or generation != self._generation:
                        return
                    i = len(self._log)
                    while i > 0 and self._log[i - 1].seq > cursor:
                        i -= 1
                    batch = [self._log[j] for j in range(i, len(self._log))]
                for msg in batch:
                    cursor = msg.seq
                    yield msg

        return stream()

    def disconnected(self) -> None:
        with self._cond:
            self.connected = False
            self._generation += 1
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
