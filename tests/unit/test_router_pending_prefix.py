"""The router's placement follows pending prefixes: requests placed before any block event arrives.

``Router._choose`` ranks workers with ``PrefixIndex.affinity`` (blocks stored *or* pending there) and
``Router._place`` records each placed request's prompt blocks as pending on its worker until the
request ends. Built without Ray: fake worker handles whose ``add_request.remote`` is awaitable.
"""

from __future__ import annotations

import asyncio

import pytest

from kvserve.protos.kvserve.v1 import serving_pb2 as spb
from kvserve.protos.kvserve.v1 import worker_pb2 as pb
from kvserve.router.config import RouterConfig
from kvserve.router.requests.router import Router, RouterRequest
from kvserve.workers.core.identity import WorkerIdentity
from kvserve.workers.core.request import WorkerRequest

BS = 16
TOTAL_BLOCKS = 64
SHARED = list(range(100, 100 + 8 * BS))  # an 8-block prefix (a system prompt)
OTHER = list(range(300, 300 + 8 * BS))


class _Method:
    def __init__(self, calls: list[tuple[str, str]], worker_id: str) -> None:
        self.calls, self.worker_id = calls, worker_id

    async def remote(self, request: WorkerRequest) -> None:
        # NOTE: the router may tag the id it sends a worker (``r1#<incarnation>.<n>``); record the request's.
        self.calls.append((self.worker_id, request.request_id.partition("#")[0]))


class _Batch(_Method):
    async def remote(self, requests: list[WorkerRequest]) -> list[None]:  # type: ignore[override]
        for request in requests:
            await super().remote(request)
        return [None] * len(requests)


class _FakeWorker:
    """Stands for a Ray actor handle: ``await handle.add_request.remote(...)`` (or ``add_requests``, several
    placed while one call was in flight) records the call."""

    def __init__(self, calls: list[tuple[str, str]], worker_id: str) -> None:
        self.add_request = _Method(calls, worker_id)
        self.add_requests = _Batch(calls, worker_id)


def _router(monkeypatch: pytest.MonkeyPatch) -> tuple[Router, list[tuple[str, str]]]:
    calls: list[tuple[str, str]] = []
    router = Router(RouterConfig(port=0))
    for w in ("a", "b"):
        ident = WorkerIdentity(w, "m", block_size=BS, total_blocks=TOTAL_BLOCKS, max_model_len=1024, vocab_size=1000)
        router.add_worker(w, _FakeWorker(calls, w), ident)
    # NOTE: no WorkerLink streams here; a worker counts as connected (healthy) as after its Hello.
    monkeypatch.setattr(router.link, "connected", lambda worker_id: True)
    return router, calls


def _request(rid: str, prefix: list[int], tail: int) -> spb.GenerateRequest:
    return spb.GenerateRequest(
        request_id=rid,
        token_ids=spb.TokenIds(ids=prefix + [900 + tail] * 5),
        sampling=spb.SamplingParams(max_tokens=4, ignore_eos=True),
    )


async def _settle(router: Router) -> None:
    """Until every dispatch task (the fake add_request calls) has run."""
    while router._tasks:
        await asyncio.gather(*list(router._tasks))


def _worker_rid(r: RouterRequest) -> str:
    """The id the router sent the worker (and keys outputs and pending entries by), if it tags one."""
    return getattr(r, "worker_rid", None) or r.request_id


def _finish(router: Router, r: RouterRequest) -> None:
    """The worker's final output for ``r``."""
    assert r.worker_id is not None
    router._on_output(r.worker_id, pb.RequestOutput(
        request_id=_worker_rid(r), new_token_ids=[7], num_output_tokens=1, finish_reason="stop",
    ))  # fmt: skip


def test_same_prefix_back_to_back_share_a_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    async def scenario() -> None:
        router, calls = _router(monkeypatch)
        r1 = router.submit(_request("r1", SHARED, 1))
        r2 = router.submit(_request("r2", SHARED, 2))  # before any block event, before r1's dispatch ran
        assert r1.target == r2.target, "the second follows the first's pending prefix"
        r3 = router.submit(_request("r3", OTHER, 3))
        assert r3.target != r1.target, "another prefix goes by load: to the idle worker"
        await _settle(router)
        assert sorted(calls) == sorted([(r1.worker_id, "r1"), (r1.worker_id, "r2"), (r3.worker_id, "r3")])
        assert router.prefix_index.num_pending(r1.worker_id) == 2

    asyncio.run(scenario())


def test_without_pending_affinity_load_would_split_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """The control: the first test can fail. Placement by stored blocks only (no pending) sends the
    second same-prefix request to the other worker, because the first one's blocks load its worker."""

    async def scenario() -> None:
        router, _ = _router(monkeypatch)
        monkeypatch.setattr(router.prefix_index, "affinity", router.prefix_index.overlap)
        r1 = router.submit(_request("r1", SHARED, 1))
        r2 = router.submit(_request("r2", SHARED, 2))
        assert r1.target != r2.target
        await _settle(router)

    asyncio.run(scenario())


def test_a_finished_request_drops_its_pending_prefix(monkeypatch: pytest.MonkeyPatch) -> None:
    async def scenario() -> None:
        router, _ = _router(monkeypatch)
        r1 = router.submit(_request("r1", SHARED, 1))
        r2 = router.submit(_request("r2", SHARED, 2))
        await _settle(router)
        w = r1.worker_id
        assert w is not None and r2.worker_id == w
        index = router.prefix_index
        assert index.affinity(w, r1.block_hashes) == len(r1.block_hashes) == 8

        _finish(router, r1)
        assert r1.finished and "r1" not in router.requests
        assert index.num_pending(w) == 1, "r1's entry is gone, r2's stays"
        assert index.affinity(w, r1.block_hashes) == 8, "r2 still holds the prefix as pending"
        assert not index.drop_pending(_worker_rid(r1)), "nothing left to drop for r1"

        _finish(router, r2)
        assert index.num_pending() == 0
        assert index.affinity(w, r1.block_hashes) == 0, "no block event came: nothing stored, nothing pending"

    asyncio.run(scenario())


def test_a_cancelled_request_leaves_no_pending_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    async def scenario() -> None:
        router, _ = _router(monkeypatch)
        r1 = router.submit(_request("r1", SHARED, 1))
        await _settle(router)
        assert router.prefix_index.num_pending() == 1
        router.lifecycle.cancel(r1)  # on a worker: an abort goes out, whose final output ends it there
        _finish(router, r1)
        assert router.prefix_index.num_pending() == 0
        assert router.prefix_index.affinity(r1.worker_id, r1.block_hashes) == 0

    asyncio.run(scenario())
