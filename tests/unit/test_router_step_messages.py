"""A worker step's one WorkerLink message (``StepMessages``): the router applies its outputs, then its
block events, then its pressure report, as it would the three messages sent apart."""

from __future__ import annotations

import asyncio

from kvserve.protos.kvserve.v1 import worker_pb2 as pb
from tests.unit.test_router_failover import _drain, _out, _req, _router, _settle


def _step(seq: int, outputs: list[pb.RequestOutput], hashes: list[int], report: pb.PressureReport) -> pb.WorkerMessage:
    events = pb.BlockEvents(events=[pb.BlockEvent(seq=i + 1, stored=pb.BlockStored(hashes=[h]))
                                    for i, h in enumerate(hashes)])  # fmt: skip
    step = pb.StepMessages(outputs=pb.StepOutputs(decode_step=seq, outputs=outputs), events=events, pressure=report)
    return pb.WorkerMessage(seq=seq, step=step)


def test_a_step_message_streams_its_outputs_indexes_its_blocks_and_applies_its_report() -> None:
    async def test() -> None:
        router, _ = _router()
        r = router.submit(_req(max_tokens=2))
        await _settle()
        w = r.worker_id
        assert w is not None and r.worker_rid in router.table[w].in_flight
        report = pb.PressureReport(seq=1, total_blocks=32, free_blocks=29, used_blocks=3, num_running=1)
        router.on_message(w, _step(1, [_out(r.worker_rid, [10], 1)], [111], report))
        assert [list(x.token_ids) for x in _drain(r.responses)] == [[10]]
        assert router.prefix_index.overlap(w, [111]) == 1
        assert router.table[w].report.free_blocks == 29
        # NOTE: the report came after the output that showed the request started on the worker, so
        # the blocks promised for it are now the report's to count (in_flight dropped it): a report
        # applied before the outputs would have left them counted twice.
        assert r.worker_rid not in router.table[w].in_flight
        done = pb.PressureReport(seq=2, total_blocks=32, free_blocks=32)
        router.on_message(w, _step(2, [_out(r.worker_rid, [11], 2, finish="length")], [], done))
        (final,) = _drain(r.responses)
        assert final.finish_reason == "length" and "r1" not in router.requests
        assert router.table[w].report.free_blocks == 32

    asyncio.run(test())
