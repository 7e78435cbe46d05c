"""A router that restarted mid-migration settles the copy the migration paused (kvserve/router/requests/exported.py):
freed once the running copy is adopted elsewhere, in either order; resumed and adopted where it is when no running
copy turns up; left alone while this router's own migration runs."""

from __future__ import annotations

import asyncio

from kvserve.protos.kvserve.v1 import serving_pb2 as spb
from kvserve.protos.kvserve.v1 import worker_pb2 as pb
from tests.unit.test_liveness import _until
from tests.unit.test_router_failover import _router, _run
from tests.unit.test_router_owned import OWNER

RID = "old#dead.3"
# NOTE: bounded waits: a copy freed only by the settle timer (60 s in the tests that set it) must fail, not pass late
WAIT_S = 5.0


def _table(exporting: bool, total: int = 2) -> pb.WorkerMessage:
    sampling = spb.SamplingParams(max_tokens=8, temperature=0.7, seed=5)
    entry = pb.OwnedRequest(request_id=RID, owner=OWNER.address, owner_key="k9", prompt_ids=[1, 2, 3, 4],
                            sampling=sampling, num_output_tokens=total, exporting=exporting)  # fmt: skip
    return pb.WorkerMessage(request_table=pb.RequestTable(requests=[entry]))


def _finishes(worker) -> list[tuple]:  # noqa: ANN001 - a FakeWorker
    return [args for name, args, _ in worker.calls if name == "finish_export"]


def test_the_paused_copy_is_freed_when_the_running_one_is_adopted_in_either_order() -> None:
    for paused_first in (True, False):

        async def test(paused_first: bool = paused_first) -> None:
            router, workers = _router()
            router.owned.exported.settle_s = 60.0  # NOTE: freed by the running copy's table, not by a timeout
            first, second = (("a", _table(True)), ("b", _table(False, 3)))[:: 1 if paused_first else -1]
            router.on_message(*first)
            router.on_message(*second)
            r = router.requests["old"]
            assert (r.worker_id, r.worker_rid, r.tokens_received) == ("b", RID, 3)
            await _until(lambda: _finishes(workers["a"]), WAIT_S)
            assert _finishes(workers["a"]) == [(RID, True)] and not _finishes(workers["b"])
            router.on_message("a", _table(True))  # the source reconnects before it got the call: freed again
            await _until(lambda: len(_finishes(workers["a"])) == 2, WAIT_S)
            assert router.requests["old"].worker_id == "b" and len(router.owned.exported) == 0

        _run(test)


def test_a_paused_copy_nobody_runs_is_resumed_and_adopted_where_it_is() -> None:
    async def test() -> None:
        router, workers = _router()
        router.owned.exported.settle_s = 0.05
        router.on_message("a", _table(True))
        assert "old" not in router.requests  # NOTE: not yet: the destination's table may still come
        await _until(lambda: _finishes(workers["a"]), WAIT_S)
        assert _finishes(workers["a"]) == [(RID, False)]
        r = router.requests["old"]
        assert (r.worker_id, r.worker_rid, r.tokens_received) == ("a", RID, 2)
        router.on_message("b", _table(False))  # a running copy too late: not adopted twice
        assert router.requests["old"] is r and not _finishes(workers["b"])

    _run(test)


def test_a_copy_paused_by_this_routers_own_migration_is_left_to_it() -> None:
    async def test() -> None:
        router, workers = _router()
        router.owned.exported.settle_s = 0.05
        router.mover.busy.add("a")
        router.on_message("a", _table(True))
        await asyncio.sleep(0.2)
        assert not _finishes(workers["a"]) and "old" not in router.requests and len(router.owned.exported) == 0

    _run(test)


def test_a_paused_copy_without_owner_is_freed_at_once() -> None:
    # NOTE: a router-owned request paused by the previous router: its client went with that router
    async def test() -> None:
        router, workers = _router()
        router.owned.exported.settle_s = 60.0
        message = _table(True)
        message.request_table.requests[0].ClearField("owner")
        message.request_table.requests[0].ClearField("owner_key")
        router.on_message("a", message)
        await _until(lambda: _finishes(workers["a"]), WAIT_S)
        assert _finishes(workers["a"]) == [(RID, True)] and "old" not in router.requests
        assert len(router.owned.exported) == 0

    _run(test)
