"""The worker's ordered, resendable message log toward the router.

Every WorkerMessage gets the next sequence number and stays in the log until the router acks a
seq at or beyond it. After a reconnect the link replays the log from the start; the router drops
what it already has by seq. So a broken link never loses outputs that were produced.
Pressure reports and step heartbeats are not logged while disconnected: a fresh one follows the reconnect.

A step's messages (outputs, block events, pressure: ``put_step``) travel as one ``StepMessages``
(the router pays its per-message receive cost once per step), and coalesce with the previous
step's while the link has not taken that yet: when the router or the link thread falls behind the engine,
the next message it gets carries every step since, one ``RequestOutput`` per request with all its new
tokens (vLLM V1's ``RequestOutputCollector`` merges delta outputs for a slow consumer the same way).
So the work per message (serialising, the router's demux, the client's stream) stops growing with the
engine's step rate exactly when it would fall further behind, and nothing waits for a batch to fill.

With ``hold_s`` > 0 a step message that carries nothing a client waits for (owned requests' progress,
block events, pressure: docs/architecture.md §2a) is not taken until it is ``hold_s`` old, so every step
in that window folds into it: the router pays its per-message cost at most ``1 / hold_s`` times a second
per worker instead of once per step (issue 41: router CPU per request). A message with a router-owned
request's output (a client's token), or any message after it, goes at once, as does every other message.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Iterator

from kvserve.protos.kvserve.v1 import worker_pb2 as pb
from kvserve.workers.core.step_columns import append_entry, column_entries, entry_output

logger = logging.getLogger(__name__)


class Outbox:
    def __init__(self, max_messages: int = 100_000, hold_s: float = 0.0) -> None:
        self._cond = threading.Condition()
        self._log: deque[pb.WorkerMessage] = deque()
        self._seq = 0
        self._acked = 0
        self.max_messages = max_messages
        self.connected = False
        self._closed = False
        self._generation = 0  # bumps on every (re)connect; old stream generators end
        # Highest seq a stream has taken (over every connection): messages at or below it may have
        # reached the router and are never changed; only those above it may coalesce.
        self._taken = 0
        self.num_coalesced = 0  # steps folded into an earlier step's messages (a metric, for benches)
        self.hold_s = hold_s
        # (seq, monotonic birth) of the last message while it may still be held (None: it goes at once)
        self._holdable: tuple[int, float] | None = None

    @property
    def last_seq(self) -> int:
        return self._seq

    def put(self, msg: pb.WorkerMessage) -> int | None:
        """Stamp and log a message; returns its seq (None if dropped: pressure while disconnected)."""
        with self._cond:
            if not self.connected and msg.WhichOneof("body") in ("pressure", "heartbeat"):
                return None
            self._seq += 1
            msg.seq = self._seq
            self._log.append(msg)
            self._holdable = None
            if len(self._log) > self.max_messages:
                dropped = self._log.popleft()
                logger.warning("outbox full: dropped message seq %d (router unreachable?)", dropped.seq)
            self._cond.notify_all()
            return self._seq

    def put_step(
        self,
        outputs: pb.StepOutputs | None,
        events: pb.BlockEvents | None,
        pressure: pb.PressureReport | None,
    ) -> bool:
        """Log one engine step's messages as one ``StepMessages`` (outputs, block events, pressure).

        When the log's last message is an earlier step's and not yet taken, this step folds into
        it: outputs merge per request, events append, the newer pressure report replaces the older
        one.

        NOTE: the router then sees (O1+O2, E1+E2, P2) instead of (O1, E1, P1), (O2, E2, P2). Each
        request's finish still precedes the block events and pressure that free its blocks, and no
        block is reported free before its request finishes (docs/architecture.md, section 4); the
        router's state after it equals its state after the separate steps. Without a new report
        the older one stays (it was due; the next due report replaces it).

        Returns:
            whether ``pressure`` was logged (False: none given, or dropped while disconnected).
        """
        with self._cond:
            if not self.connected:
                pressure = None
            if outputs is None and events is None and pressure is None:
                return False
            last = self._log[-1] if self._log else None
            urgent = outputs is not None and not _progress_only(outputs)
            if last is not None and last.seq > self._taken and last.WhichOneof("body") == "step":
                _merge_step(last.step, outputs, events, pressure)
                self.num_coalesced += 1
                if urgent:
                    self._holdable = None
            else:
                self._seq += 1
                step = pb.StepMessages(outputs=outputs, events=events, pressure=pressure)
                self._log.append(pb.WorkerMessage(seq=self._seq, step=step))
                self._holdable = None if urgent or self.hold_s <= 0 else (self._seq, time.monotonic())
                while len(self._log) > self.max_messages:
                    dropped = self._log.popleft()
                    logger.warning("outbox full: dropped message seq %d (router unreachable?)", dropped.seq)
            self._cond.notify_all()
            return pressure is not None

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
                    while not self._closed and generation == self._generation:
                        held = self._held_for()
                        end = len(self._log) - (1 if held > 0 else 0)  # NOTE: only the last one is ever held
                        if end > 0 and self._log[end - 1].seq > cursor:
                            break
                        self._cond.wait(timeout=held if held > 0 and self._log[-1].seq > cursor else 0.5)
                    if self._closed or generation != self._generation:
                        return
                    i = end
                    while i > 0 and self._log[i - 1].seq > cursor:
                        i -= 1
                    batch = [self._log[j] for j in range(i, end)]
                    self._taken = max(self._taken, batch[-1].seq)
                for msg in batch:
                    cursor = msg.seq
                    yield msg

        return stream()

    def _held_for(self) -> float:
        """Seconds the last message is still held (0: it may go). Caller holds ``_cond``."""
        if self._holdable is None or not self._log or self._log[-1].seq != self._holdable[0]:
            return 0.0
        return max(0.0, self._holdable[1] + self.hold_s - time.monotonic())

    def disconnected(self) -> None:
        with self._cond:
            self.connected = False
            self._generation += 1
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()


def _progress_only(outputs: pb.StepOutputs) -> bool:
    """``outputs`` carries owned requests' progress only (no client waits on the router for it)."""
    return not outputs.HasField("columns") and all(o.owned for o in outputs.outputs)


def _merge_step(
    into: pb.StepMessages,
    outputs: pb.StepOutputs | None,
    events: pb.BlockEvents | None,
    pressure: pb.PressureReport | None,
) -> None:
    """Fold a later step's messages into an earlier step's ``StepMessages``."""
    if outputs is not None:
        if into.HasField("outputs"):
            _merge_outputs(into.outputs, outputs)
        else:
            into.outputs.CopyFrom(outputs)
    if events is not None:
        into.events.events.extend(events.events)
    if pressure is not None:
        into.pressure.CopyFrom(pressure)


def _merge_outputs(into: pb.StepOutputs, later: pb.StepOutputs) -> None:
    """Fold ``later``'s per-request news into ``into``: one ``RequestOutput`` per request, tokens,
    text and logprobs appended, counters and finish reason from the later step.

    Column entries stay columns (appended after ``into``'s: a request's entries keep their order,
    and the router reads a message's columns before its outputs), except an entry of a request with
    an output in ``into``, which folds into that output so that its tokens stay after it."""
    by_id = {o.request_id: o for o in into.outputs if not o.finish_reason}
    folded = []
    if later.HasField("columns"):
        for rid, new, total, text in column_entries(later.columns):
            if rid in by_id:
                folded.append(entry_output(rid, new, total, text))
            else:
                append_entry(into.columns, rid, new, total, text)
    for o in (*folded, *later.outputs):  # NOTE: within one step a request is in one of the two only
        prev = by_id.get(o.request_id)
        if prev is None or prev.num_output_tokens != o.num_output_tokens - len(o.new_token_ids):
            # NOTE: not contiguous (a resumed or re-imported request): keep it apart; the router's
            # demux places every output by its own num_output_tokens.
            into.outputs.append(o)
            continue
        prev.new_token_ids.extend(o.new_token_ids)
        prev.text_delta += o.text_delta
        prev.logprobs.extend(o.logprobs)
        prev.finish_reason, prev.error = o.finish_reason, o.error
        prev.num_output_tokens = o.num_output_tokens
        prev.num_cached_tokens, prev.num_prompt_tokens = o.num_cached_tokens, o.num_prompt_tokens
        prev.num_preemptions, prev.num_swaps = o.num_preemptions, o.num_swaps
    into.decode_step = later.decode_step
