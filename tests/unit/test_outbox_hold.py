"""Outbox hold (``hold_s``): a step message with nothing a client waits for (owned progress, block events,
pressure) waits up to ``hold_s`` so that later steps fold into it; a router-owned token never waits."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

from kvserve.protos.kvserve.v1 import worker_pb2 as pb
from kvserve.workers.transport.outbox import Outbox

HOLD_S = 0.3
# NOTE: tests of what is never held hold for a minute: were it held, ``wait_for`` would time out (no upper
# bound on a wall-clock time to assert, which a loaded box could break).
LONG_HOLD_S = 60.0


def _progress(step: int, rid: str, n: int) -> pb.StepOutputs:
    return pb.StepOutputs(decode_step=step, outputs=[pb.RequestOutput(request_id=rid, num_output_tokens=n, owned=True)])


def _token(step: int, rid: str, n: int) -> pb.StepOutputs:
    return pb.StepOutputs(
        decode_step=step, outputs=[pb.RequestOutput(request_id=rid, new_token_ids=[7], num_output_tokens=n)]
    )


def _events(*seqs: int) -> pb.BlockEvents:
    return pb.BlockEvents(events=[pb.BlockEvent(seq=s, stored=pb.BlockStored(hashes=[s])) for s in seqs])


class _Reader:
    """Takes the stream's messages on a thread, as the WorkerLink's sender does, each with its arrival time."""

    def __init__(self, stream: Iterator[pb.WorkerMessage]) -> None:
        self.got: list[tuple[float, pb.WorkerMessage]] = []
        self._cond = threading.Condition()
        threading.Thread(target=self._run, args=(stream,), daemon=True).start()

    def _run(self, stream: Iterator[pb.WorkerMessage]) -> None:
        for msg in stream:
            with self._cond:
                self.got.append((time.monotonic(), msg))
                self._cond.notify_all()

    def wait_for(self, n: int, timeout: float = 20.0) -> list[tuple[float, pb.WorkerMessage]]:
        with self._cond:
            assert self._cond.wait_for(lambda: len(self.got) >= n, timeout), f"got {len(self.got)} of {n} messages"
            return list(self.got)


def _held_box(hold_s: float = LONG_HOLD_S) -> tuple[Outbox, _Reader]:
    box = Outbox(hold_s=hold_s)
    return box, _Reader(box.open_stream([]))


def test_progress_events_and_pressure_of_steps_within_the_hold_go_as_one_message() -> None:
    box, reader = _held_box(HOLD_S)
    t0 = time.monotonic()
    box.put_step(_progress(1, "a", 1), _events(1), pb.PressureReport(seq=1))
    box.put_step(_progress(2, "b", 1), _events(2), None)
    box.put_step(None, _events(3), pb.PressureReport(seq=2))
    ((at, msg),) = reader.wait_for(1)
    assert at - t0 >= HOLD_S * 0.9  # NOTE: a lower bound only: a slow box may take it later, never sooner
    assert [o.request_id for o in msg.step.outputs.outputs] == ["a", "b"]
    assert [e.seq for e in msg.step.events.events] == [1, 2, 3] and msg.step.pressure.seq == 2
    assert box.num_coalesced == 2


def test_a_router_owned_token_is_never_held_and_takes_the_held_message_with_it() -> None:
    box, reader = _held_box()
    box.put_step(_progress(1, "a", 1), _events(1), None)
    box.put_step(_token(2, "r", 1), None, None)  # a client reads this token through the router
    ((_, msg),) = reader.wait_for(1)
    assert {o.request_id for o in msg.step.outputs.outputs} == {"a", "r"}


def test_a_token_alone_goes_at_once_and_other_messages_are_never_held() -> None:
    box, reader = _held_box()
    box.put_step(_token(1, "r", 1), None, None)
    box.put(pb.WorkerMessage(heartbeat=pb.StepHeartbeat()))
    reader.wait_for(2)


def test_a_message_behind_a_held_one_is_not_held() -> None:
    """A held step followed by another kind of message: both go, in order, at once."""
    box, reader = _held_box()
    box.put_step(_progress(1, "a", 1), None, None)
    box.put(pb.WorkerMessage(heartbeat=pb.StepHeartbeat()))
    got = reader.wait_for(2)
    assert [m.WhichOneof("body") for _, m in got] == ["step", "heartbeat"]


def test_without_a_hold_every_step_goes_at_once() -> None:
    box = Outbox()
    reader = _Reader(box.open_stream([]))
    box.put_step(_progress(1, "a", 1), _events(1), None)
    reader.wait_for(1)
