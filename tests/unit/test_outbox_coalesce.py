"""Outbox.put_step: a step's messages travel as one StepMessages, which folds into an earlier step's only
while the link has not taken it."""

from __future__ import annotations

from kvserve.protos.kvserve.v1 import worker_pb2 as pb
from kvserve.workers.transport.outbox import Outbox


def _outputs(step: int, *outs: tuple[str, list[int], int, str]) -> pb.StepOutputs:
    return pb.StepOutputs(
        decode_step=step,
        outputs=[
            pb.RequestOutput(
                request_id=rid, new_token_ids=ids, num_output_tokens=n, text_delta=f"<{step}>", finish_reason=fin
            )  # fmt: skip
            for rid, ids, n, fin in outs
        ],
    )


def _events(*seqs: int) -> pb.BlockEvents:
    return pb.BlockEvents(events=[pb.BlockEvent(seq=s, stored=pb.BlockStored(hashes=[s])) for s in seqs])


def _connected() -> Outbox:
    box = Outbox()
    box.open_stream([])  # marks it connected; nothing taken until the stream is iterated
    return box


def _log(box: Outbox) -> list[pb.WorkerMessage]:
    return list(box._log)


def test_a_step_is_one_message_in_step_order() -> None:
    box = _connected()
    assert box.put_step(_outputs(1, ("a", [10], 1, "")), _events(1), pb.PressureReport(seq=1))
    (msg,) = _log(box)
    assert msg.WhichOneof("body") == "step" and msg.seq == 1
    assert [f.name for f, _ in msg.step.ListFields()] == ["outputs", "events", "pressure"]


def test_untaken_steps_fold_into_one_message() -> None:
    box = _connected()
    assert box.put_step(_outputs(1, ("a", [10], 1, ""), ("b", [20], 1, "")), _events(1), pb.PressureReport(seq=1))
    assert not box.put_step(_outputs(2, ("a", [11], 2, ""), ("b", [21], 2, "length")), _events(2, 3), None)
    assert box.put_step(_outputs(3, ("a", [12], 3, "stop")), None, pb.PressureReport(seq=2))
    (msg,) = _log(box)
    assert msg.seq == 1 and box.last_seq == 1
    step = msg.step
    outs = {o.request_id: o for o in step.outputs.outputs}
    assert list(outs["a"].new_token_ids) == [10, 11, 12] and outs["a"].num_output_tokens == 3
    assert outs["a"].finish_reason == "stop" and outs["a"].text_delta == "<1><2><3>"
    assert list(outs["b"].new_token_ids) == [20, 21] and outs["b"].finish_reason == "length"
    assert step.outputs.decode_step == 3
    assert [e.seq for e in step.events.events] == [1, 2, 3]
    assert step.pressure.seq == 2  # the newer report replaced the older one
    assert box.num_coalesced == 2


def test_taken_messages_are_never_changed() -> None:
    box = Outbox()
    stream = box.open_stream([])
    box.put_step(_outputs(1, ("a", [10], 1, "")), None, None)
    taken = next(stream)
    assert taken.seq == 1
    box.put_step(_outputs(2, ("a", [11], 2, "")), None, None)
    assert list(taken.step.outputs.outputs[0].new_token_ids) == [10]
    assert [m.seq for m in _log(box)] == [1, 2]
    assert list(next(stream).step.outputs.outputs[0].new_token_ids) == [11]


def test_a_message_of_another_kind_ends_the_fold() -> None:
    box = _connected()
    box.put_step(_outputs(1, ("a", [10], 1, "")), None, None)
    box.put(pb.WorkerMessage(ack=pb.CommandAck(command_seq=1, ok=True)))
    box.put_step(_outputs(2, ("a", [11], 2, "")), None, None)
    assert [m.WhichOneof("body") for m in _log(box)] == ["step", "ack", "step"]
    assert box.num_coalesced == 0


def test_a_fold_keeps_the_older_report_without_a_newer_one() -> None:
    box = _connected()
    box.put_step(None, _events(1), pb.PressureReport(seq=1))
    box.put_step(_outputs(2, ("a", [10], 1, "")), _events(2), None)
    (msg,) = _log(box)
    assert [f.name for f, _ in msg.step.ListFields()] == ["outputs", "events", "pressure"]
    assert [e.seq for e in msg.step.events.events] == [1, 2] and msg.step.pressure.seq == 1


def test_non_contiguous_outputs_of_a_request_stay_apart() -> None:
    box = _connected()
    box.put_step(_outputs(1, ("a", [10], 1, "")), None, None)
    box.put_step(_outputs(2, ("a", [30, 31], 7, "")), None, None)  # starts at 5, not 1
    (msg,) = _log(box)
    assert [list(o.new_token_ids) for o in msg.step.outputs.outputs] == [[10], [30, 31]]


def test_pressure_is_dropped_while_disconnected_and_outputs_are_kept() -> None:
    box = Outbox()
    assert not box.put_step(_outputs(1, ("a", [10], 1, "")), None, pb.PressureReport(seq=1))
    (msg,) = _log(box)
    assert [f.name for f, _ in msg.step.ListFields()] == ["outputs"]


def test_replay_after_a_reconnect_sends_each_token_once() -> None:
    box = Outbox()
    stream = box.open_stream([])
    box.put_step(_outputs(1, ("a", [10], 1, "")), _events(1), pb.PressureReport(seq=1))
    sent = next(stream)
    box.disconnected()
    box.put_step(_outputs(2, ("a", [11], 2, "")), _events(2), None)
    box.put_step(_outputs(3, ("a", [12], 3, "")), _events(3), None)
    replay = box.open_stream([])
    again = [next(replay) for _ in range(len(_log(box)))]
    assert [m.seq for m in again] == [1, 2]
    assert again[0] == sent
    assert list(again[1].step.outputs.outputs[0].new_token_ids) == [11, 12]
    assert [e.seq for e in again[1].step.events.events] == [2, 3]
