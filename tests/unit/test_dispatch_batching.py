"""The router keeps at most one add call in flight per worker: what is placed there meanwhile goes in the
next call, all together (``Dispatcher._send``), so a burst costs a few Ray calls per worker, not one per
request (issue 41: router CPU per request)."""

from __future__ import annotations

import asyncio
from typing import Any

from kvserve.router.config import RouterConfig
from kvserve.router.requests.router import Router
from tests.unit.test_liveness import _until
from tests.unit.test_router_failover import FakeWorker, _connect, _identity, _req


class _SlowAdds(FakeWorker):
    """Add calls answer only when the test says so; each call's dispatch ids are recorded."""

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[list[str]] = []
        self.pending: list[tuple[asyncio.Future, str, int]] = []

    def __getattr__(self, name: str) -> Any:
        method = super().__getattr__(name)
        outer = self

        class _M:
            def remote(self, *args: Any, **kwargs: Any) -> asyncio.Future:
                fut = method.remote(*args, **kwargs)
                if name in ("add_request", "add_requests"):
                    requests = [args[0]] if name == "add_request" else list(args[0])
                    outer.batches.append([r.request_id for r in requests])
                    fut = asyncio.get_running_loop().create_future()
                    outer.pending.append((fut, name, len(requests)))
                return fut

        return _M()

    def answer_all(self) -> None:
        for fut, name, n in self.pending:
            if not fut.done():
                fut.set_result(None if name == "add_request" else [None] * n)


def test_requests_placed_while_a_call_is_in_flight_go_in_one_call_after_it() -> None:
    async def test() -> None:
        router = Router(RouterConfig(port=0))
        worker = _SlowAdds()
        router.add_worker("a", worker, _identity("a"))
        _connect(router, "a", "inc-1")
        first = router.submit(_req("r0", max_tokens=4))
        await _until(lambda: worker.batches)
        burst = [router.submit(_req(f"r{i}", max_tokens=4)) for i in range(1, 7)]
        await asyncio.sleep(0.2)
        assert worker.batches == [[first.worker_rid]]  # nothing more while the first call is in flight
        worker.answer_all()
        await _until(lambda: len(worker.batches) == 2)
        assert worker.batches[1] == [r.worker_rid for r in burst]  # the burst in one call, in order
        worker.answer_all()
        await _until(lambda: all(r.worker_id == "a" for r in (first, *burst)))
        assert not router.dispatcher.adding

    asyncio.run(test())


def test_a_refusal_in_a_batch_ends_only_its_own_request() -> None:
    async def test() -> None:
        router = Router(RouterConfig(port=0))
        worker = _SlowAdds()
        router.add_worker("a", worker, _identity("a"))
        _connect(router, "a", "inc-1")
        router.submit(_req("r0", max_tokens=4))
        await _until(lambda: worker.batches)
        burst = [router.submit(_req(f"r{i}", max_tokens=4)) for i in range(1, 4)]
        worker.answer_all()
        await _until(lambda: len(worker.batches) == 2)
        fut, name, n = worker.pending[1]
        assert name == "add_requests" and n == 3
        fut.set_result([None, ("invalid", "prompt too long for this worker"), None])
        await _until(lambda: burst[1].finished)
        await _until(lambda: burst[0].worker_id == "a" and burst[2].worker_id == "a")
        assert not burst[0].finished and not burst[2].finished

    asyncio.run(test())
