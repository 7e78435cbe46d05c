"""Owned requests on the worker (docs/architecture.md section 2a): a ``WorkerCore`` streams an owned request's
outputs to its owner over a data link, and only its progress to the router.

Real gRPC over 127.0.0.1, no Ray: the "router" and the "owner" each run the real ``WorkerLinkService``
(``tests/integration/worker_harness.py``'s recording server); the owner also checks the data credential.
One test has the real frontend's ``DataService`` + ``OwnedRequests`` (kvserve/frontend/) as the owner.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest

from kvserve.cluster.launch import worker_options_for
from kvserve.frontend.data_service import DataService
from kvserve.frontend.owned import OwnedRequests
from kvserve.protos.kvserve.v1 import serving_pb2 as spb
from kvserve.protos.kvserve.v1 import worker_pb2 as pb
from kvserve.router.gate.validation import ModelLimits, sampling_params
from kvserve.router.table.worker_link import WorkerLinkHandler
from kvserve.workers.core.add_command import add_commands
from kvserve.workers.core.request import WorkerRequest
from kvserve.workers.core.sampling_params import SamplingParams
from kvserve.workers.core.worker_credential import (
    WORKER_CREDENTIAL_HEADER,
    issue_data_credential,
    new_worker_key,
    verify_data_credential,
    verify_worker_credential,
)
from kvserve.workers.engine.config import EngineConfig
from kvserve.workers.transport import worker as worker_module
from kvserve.workers.transport.data_links import PROGRESS_INTERVAL_S
from kvserve.workers.transport.options import WorkerOptions
from kvserve.workers.transport.request_table import sampling_proto
from kvserve.workers.transport.worker import WorkerCore
from tests.integration.worker_harness import CountingWorkerLinkService, RecordingRouter

T = TypeVar("T")
FRONTEND_KEY = "test-frontend-key"
PROMPT = (5, 6, 7, 8, 9, 10, 11)
GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
# NOTE: a request that outlives the test's checks (~2 ms a token on the tiny model); tests abort it at the end
LONG = SamplingParams(max_tokens=3000, temperature=0.0, ignore_eos=True)


class DataCredentialService(CountingWorkerLinkService):
    """A frontend's data service as the worker sees it: the WorkerLink, refusing a stream without a valid
    data credential (``verify_data_credential`` with the frontend key), recording whom it proved."""

    def __init__(self, handler: WorkerLinkHandler, frontend_key: str) -> None:
        super().__init__(handler)
        self.frontend_key = frontend_key
        self.proven: list[str] = []
        self.refused = 0

    async def Connect(  # noqa: N802 - gRPC method name
        self, request_iterator: AsyncIterator[pb.WorkerMessage], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.RouterCommand]:
        metadata = dict(context.invocation_metadata() or ())
        worker_id = verify_data_credential(self.frontend_key, metadata.get(WORKER_CREDENTIAL_HEADER))
        if worker_id is None:
            self.refused += 1
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "no valid data credential")
        self.proven.append(worker_id)
        async for cmd in super().Connect(request_iterator, context):
            yield cmd


def _owner() -> RecordingRouter:
    owner = RecordingRouter()
    owner.service = DataCredentialService(owner.handler, FRONTEND_KEY)
    return owner.start()


def _closed_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"  # nothing listens there once the socket is closed


def _wait(predicate: Callable[[], T], timeout: float = 15.0, what: str = "condition") -> T:
    """Poll ``predicate`` until truthy (bounded: a deadline, never a fixed sleep); return its value."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        time.sleep(0.02)
    return value


@pytest.fixture
def router() -> Iterator[RecordingRouter]:
    r = RecordingRouter().start()
    yield r
    r.close()


@pytest.fixture
def owner() -> Iterator[RecordingRouter]:
    o = _owner()
    yield o
    o.close()


@pytest.fixture
def other_owner() -> Iterator[RecordingRouter]:
    """A second owner (set up before ``make_core``: torn down after the cores, so no link redials it)."""
    o = _owner()
    yield o
    o.close()


@pytest.fixture
def make_core(tiny_llama_dir: Path) -> Iterator[Callable[..., WorkerCore]]:
    cores: list[WorkerCore] = []

    def make(worker_id: str, router_address: str, **options: object) -> WorkerCore:
        o = WorkerOptions(
            router_address=router_address, data_credential=issue_data_credential(FRONTEND_KEY, worker_id), **options
        )
        core = WorkerCore(worker_id, EngineConfig(model=str(tiny_llama_dir), num_gpu_blocks=512), o)
        core.start()
        cores.append(core)
        return core

    yield make
    for core in cores:
        core.stop()


def _live(core: WorkerCore) -> set[str]:
    return core._call(lambda: set(core.engine.requests))


def _owned(rid: str, key: str, owner: RecordingRouter, params: SamplingParams = LONG, **kw: object) -> WorkerRequest:
    return WorkerRequest(rid, PROMPT, params, owner=owner.address, owner_key=key, **kw)


def test_owned_tokens_reach_only_the_owner_and_the_router_gets_progress(
    router: RecordingRouter, owner: RecordingRouter, make_core: Callable[..., WorkerCore]
) -> None:
    core = make_core("w-own", router.address)
    core.add_request(WorkerRequest("ref#0", PROMPT, GREEDY))  # the same request, router-owned: the reference
    reference = router.wait_finished(["ref#0"])["ref#0"]
    assert len(reference) == GREEDY.max_tokens
    t0 = time.monotonic()
    core.add_request(_owned("r1#3", "k1", owner, GREEDY))
    tokens = owner.wait_finished(["k1#3"])["k1#3"]
    router.wait_finished(["r1#3"])
    elapsed = time.monotonic() - t0
    assert tokens == reference
    assert "".join(o.text_delta for o in owner.outputs("k1#3")), "the owner gets the text too"
    with owner.handler.cond:
        assert set(owner.handler.outputs) == {"k1#3"}, "the owner sees its own key, never the worker's id"
    assert owner.service.proven == ["w-own"] and owner.service.refused == 0
    with router.handler.cond:
        assert "k1#3" not in router.handler.outputs
    progress = router.outputs("r1#3")
    assert all(p.owned and not p.new_token_ids and not p.text_delta and not p.logprobs for p in progress)
    assert progress[0].num_output_tokens >= 1 and not progress[0].finish_reason
    assert progress[-1].finish_reason == "length" and progress[-1].num_output_tokens == GREEDY.max_tokens
    assert progress[-1].num_prompt_tokens == len(PROMPT)
    # NOTE: first + finish, plus one per progress interval the run took: never one per token
    assert len(progress) <= 2 + int(elapsed / PROGRESS_INTERVAL_S), [p.num_output_tokens for p in progress]
    assert core._call(lambda: dict(core._owners)) == {}, "a finished request is forgotten"


def test_a_router_reconnect_gets_the_table_of_live_owned_requests(
    router: RecordingRouter, owner: RecordingRouter, make_core: Callable[..., WorkerCore]
) -> None:
    core = make_core("w-table", router.address)
    _wait(lambda: router.messages("w-table", "request_table"), what="the first connect's table")
    assert not router.messages("w-table", "request_table")[0].request_table.requests, "nothing owned yet"
    params = SamplingParams(max_tokens=3000, temperature=0.7, top_k=5, top_p=0.9, seed=7, logprobs=2)
    grant = ("t0k3n", "client-r2", "tenant-a", "10.0.0.9")
    core.add_request(_owned("r2#1", "k2", owner, params, priority=3, cache_salt="tenant-a", resume_grant=grant))
    core.add_request(WorkerRequest("plain#0", PROMPT, LONG))  # router-owned: never in the table
    owner.wait_tokens("k2#1", 3)
    router.restart()
    table = _wait(
        lambda: [m for m in router.messages("w-table", "request_table") if m.request_table.requests],
        what="the table after the reconnect",
    )[-1]
    kinds = [m.WhichOneof("body") for m in router.messages("w-table")]
    assert kinds[kinds.index("request_table", kinds.index("request_table") + 1) - 1] == "block_snapshot"
    (entry,) = table.request_table.requests
    assert (entry.request_id, entry.owner, entry.owner_key) == ("r2#1", owner.address, "k2")
    assert list(entry.prompt_ids) == list(PROMPT)
    assert (entry.priority, entry.cache_salt) == (3, "tenant-a")
    assert entry.num_output_tokens >= 3
    # its resume grant: a restarted router still lets its client resume through another frontend
    assert (entry.resume_token, entry.resume_request_id, entry.resume_tenant, entry.resume_client) == grant
    s = entry.sampling
    assert (s.max_tokens, s.top_k, s.seed, s.logprobs, s.ignore_eos) == (3000, 5, 7, 2, False)
    assert s.temperature == pytest.approx(0.7) and s.HasField("top_p") and s.top_p == pytest.approx(0.9)
    assert not entry.exporting
    # paused by a migration (exported, not yet freed): flagged, so a router restarted mid-migration can settle it
    assert core.export_request("r2#1") is not None
    n = len(router.messages("w-table", "request_table"))
    router.restart()
    table = _wait(lambda: router.messages("w-table", "request_table")[n:], what="the table after a second reconnect")
    (entry,) = table[-1].request_table.requests
    assert entry.request_id == "r2#1" and entry.exporting
    assert core.finish_export("r2#1", migrated=False)
    # a router-owned request paused so is listed too, with no owner (a restarted router frees it)
    assert core.export_request("plain#0") is not None
    n = len(router.messages("w-table", "request_table"))
    router.restart()
    table = _wait(lambda: router.messages("w-table", "request_table")[n:], what="the table after a third reconnect")
    entries = {e.request_id: e for e in table[-1].request_table.requests}
    assert not entries["r2#1"].exporting and entries["plain#0"].exporting and not entries["plain#0"].owner_key
    assert core.finish_export("plain#0", migrated=False)
    assert core.abort("r2#1") and core.abort("plain#0")


def test_an_owner_aborts_its_own_request_by_key_only(
    router: RecordingRouter, owner: RecordingRouter, other_owner: RecordingRouter, make_core: Callable[..., WorkerCore]
) -> None:
    other = other_owner
    core = make_core("w-abort", router.address)
    core.add_request(_owned("a#0", "k", owner))
    core.add_request(_owned("b#0", "k", other))  # the same key at another owner: not ``owner``'s
    owner.wait_tokens("k#0", 1)
    other.wait_tokens("k#0", 1)
    owner.send("w-abort", pb.RouterCommand(abort=pb.Abort(request_id="nobody")))
    owner.send("w-abort", pb.RouterCommand(abort=pb.Abort(request_id="k")))
    owner.wait_finished(["k#0"])
    assert owner.finish_reason("k#0") == "abort"
    acks = owner.wait_for(lambda: len(owner.acks("w-abort")) >= 2 and owner.acks("w-abort"), what="both acks")
    assert [(a.request_id, a.ok) for a in acks] == [("nobody", False), ("k", True)]
    router.wait_finished(["a#0"])
    assert router.finish_reason("a#0") == "abort" and router.outputs("a#0")[-1].owned
    assert _live(core) == {"b#0"}
    n = len(other.tokens("k#0"))
    other.wait_tokens("k#0", n + 3)  # the other owner's request runs on
    assert not other.finish_reason("k#0")
    assert core.abort("b#0")


def test_an_owned_request_is_orphaned_by_its_owner_not_by_the_router(
    router: RecordingRouter, owner: RecordingRouter, make_core: Callable[..., WorkerCore]
) -> None:
    # The owner unreachable, the router there: the owned request goes, the router-owned one stays.
    core = make_core("w-orph1", router.address, orphan_timeout_s=0.5)
    gone = _closed_address()
    core.add_request(WorkerRequest("mine#0", PROMPT, LONG))
    t0 = time.monotonic()
    core.add_request(WorkerRequest("own#0", PROMPT, LONG, owner=gone, owner_key="k"))
    router.wait_finished(["own#0"])
    assert router.finish_reason("own#0") == "abort" and time.monotonic() - t0 > 0.5
    assert _live(core) == {"mine#0"}
    # ... and its link, used by no request any more, is closed: a dead owner is not redialled for ever
    _wait(lambda: gone not in core.data_links.addresses(), what="the dead owner's link closed")
    assert core.abort("mine#0")

    # The router unreachable, the owner there: the router-owned request goes, the owned one streams on.
    core = make_core("w-orph2", _closed_address(), orphan_timeout_s=0.5)
    core.add_request(WorkerRequest("mine#0", PROMPT, LONG))
    core.add_request(_owned("own#0", "k2", owner))
    _wait(lambda: "mine#0" not in _live(core), what="the router-owned orphan's abort")
    assert core.link is not None and core.link.disconnected_for() > 0.5
    n = len(owner.tokens("k2#0"))
    owner.wait_tokens("k2#0", n + 3)
    assert not owner.finish_reason("k2#0") and _live(core) == {"own#0"}
    assert core.abort("own#0")
    owner.wait_finished(["k2#0"])


def test_a_migrated_owned_request_streams_to_the_same_owner(
    router: RecordingRouter, owner: RecordingRouter, make_core: Callable[..., WorkerCore]
) -> None:
    # NOTE: long enough to be caught running after its first tokens (~2 ms a token), short enough to finish
    params = SamplingParams(max_tokens=600, temperature=0.0, ignore_eos=True)
    src, dst = make_core("w-src", router.address), make_core("w-dst", router.address)
    dst.add_request(WorkerRequest("ref#0", PROMPT, params))
    reference = router.wait_finished(["ref#0"])["ref#0"]
    grant = ("tok", "client-m", "", "10.0.0.9")
    src.add_request(_owned("m#0", "km", owner, params, resume_grant=grant))
    owner.wait_tokens("km#0", 5)
    state = src.export_request("m#0")
    assert state is not None and state.owner == (owner.address, "km") and state.resume_grant == grant
    assert dst.import_request(state)
    assert dst._call(lambda: dst._grants.get("m#0")) == grant  # its destination lists the grant from now on
    assert src.finish_export("m#0", migrated=True)
    assert src._call(lambda: (dict(src._owners), dict(src._grants))) == ({}, {})
    tokens = owner.wait_finished(["km#0"])["km#0"]
    assert tokens == reference
    assert owner.outputs("km#0", "w-src") and owner.outputs("km#0", "w-dst"), "both legs went to the owner"
    router.wait_finished(["m#0"])
    assert [p.owned for p in router.outputs("m#0", "w-dst")] and all(p.owned for p in router.outputs("m#0"))


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=7),
        SamplingParams(max_tokens=9, temperature=0.0),
        SamplingParams(
            max_tokens=100, temperature=0.5, top_k=3, top_p=0.75, seed=2**63 + 5, stop=("ab", "c"),
            stop_token_ids=(2, 9), ignore_eos=True, logprobs=0,
        ),
    ],
)  # fmt: skip
def test_the_tables_sampling_reads_back_equal_at_the_router(params: SamplingParams) -> None:
    """What a restarted router adopts runs as the worker runs it (the router's own proto reader)."""
    msg = sampling_proto(params)
    assert sampling_params(msg, num_prompt_tokens=10, limits=ModelLimits(vocab_size=100, max_model_len=200)) == params
    assert msg.HasField("top_p") == (params.top_p != 1.0) and msg.HasField("seed") == (params.seed is not None)


def test_progress_comes_on_a_preemption_and_each_interval_never_per_token(
    router: RecordingRouter, owner: RecordingRouter, make_core: Callable[..., WorkerCore],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    # NOTE: an interval no run reaches: only the first output, a preemption and the finish are due
    monkeypatch.setattr(worker_module, "PROGRESS_INTERVAL_S", 3600.0)
    core = make_core("w-prog", router.address)
    core.add_request(_owned("p#0", "kp", owner))
    router.wait_for(lambda: router.outputs("p#0"), what="the first progress")
    owner.wait_tokens("kp#0", 50)
    (first,) = router.outputs("p#0")  # 50 tokens at the owner, one message at the router
    assert first.owned and first.num_preemptions == 0 and not first.finish_reason
    assert core.preempt("p#0", "recompute")
    router.wait_for(lambda: len(router.outputs("p#0")) >= 2, what="the preemption's progress")
    after = router.outputs("p#0")
    assert len(after) == 2 and after[1].num_preemptions == 1 and not after[1].finish_reason
    monkeypatch.setattr(worker_module, "PROGRESS_INTERVAL_S", 0.05)  # now the interval alone is due
    router.wait_for(lambda: len(router.outputs("p#0")) >= 5, what="interval progress")
    progress = router.outputs("p#0")
    assert not any(p.finish_reason or p.new_token_ids for p in progress)
    counts = [p.num_output_tokens for p in progress]
    assert counts == sorted(counts) and counts[-1] > counts[1]
    assert core.abort("p#0")


# ---- the launcher's data credential ------------------------------------------------------------------
def test_the_launcher_issues_a_data_credential_only_with_a_frontend_key() -> None:
    base = WorkerOptions(orphan_timeout_s=3.0)
    worker_key = new_worker_key()
    o = worker_options_for(base, "worker-1", worker_key, "10.0.0.1:5000", frontend_key=FRONTEND_KEY)
    assert verify_data_credential(FRONTEND_KEY, o.data_credential) == "worker-1"
    assert verify_data_credential("another-frontend-key", o.data_credential) is None
    assert verify_worker_credential(worker_key, o.data_credential) is None, "a data credential opens no router link"
    assert FRONTEND_KEY not in repr(o), "the frontend key itself never reaches the worker"
    assert (o.router_address, o.orphan_timeout_s) == ("10.0.0.1:5000", 3.0)
    assert verify_worker_credential(worker_key, o.credential) == "worker-1"
    assert worker_options_for(base, "worker-1", worker_key, "10.0.0.1:5000").data_credential is None
    assert worker_options_for(base, "worker-1", worker_key, "10.0.0.1:5000", None).data_credential is None


# ---- against the real frontend's data service ----------------------------------------------------------
class Relay:
    """One client request as the frontend's ``OwnedRequests`` sees its relay (owned.py's ``RelayedRequest``
    protocol); called on the frontend's loop, read by the test once ``done`` is set."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.finished = False
        self.responses: list[spb.GenerateResponse] = []
        self.done = threading.Event()

    def put(self, item: spb.GenerateResponse) -> None:
        self.responses.append(item)
        self.finished = self.finished or bool(item.finish_reason)

    def ended(self) -> None:
        self.done.set()


class Frontend:
    """A frontend's real ``DataService`` + ``OwnedRequests`` on an event loop of its own (a thread)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="frontend", daemon=True)
        self._thread.start()
        self.owned = OwnedRequests()
        self.data = DataService(self.owned, FRONTEND_KEY, "127.0.0.1", 0)
        self.address = self._run(self.data.start())

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)

    def call(self, fn: Callable[[], T]) -> T:
        """``fn()`` on the frontend's loop (``OwnedRequests`` takes no locks)."""

        async def run() -> T:
            return fn()

        return self._run(run())

    def close(self) -> None:
        self._run(self.data.stop(grace=0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)
        self.loop.close()


@pytest.fixture
def frontend() -> Iterator[Frontend]:
    """Set up before ``make_core``: torn down after the cores, so no data link redials it."""
    f = Frontend()
    yield f
    f.close()


def test_the_real_frontend_relays_an_owned_request_and_aborts_what_it_does_not_own(
    router: RecordingRouter, frontend: Frontend, make_core: Callable[..., WorkerCore]
) -> None:
    core = make_core("w-front", router.address)
    core.add_request(WorkerRequest("ref#0", PROMPT, GREEDY))
    reference = router.wait_finished(["ref#0"])["ref#0"]
    relay = Relay("client-1")
    frontend.call(lambda: frontend.owned.register("fk", relay, list(PROMPT)))
    core.add_request(WorkerRequest("c1#2", PROMPT, GREEDY, owner=frontend.address, owner_key="fk"))
    assert relay.done.wait(15), "the frontend's relay never ended"
    got = frontend.call(lambda: list(relay.responses))
    assert [t for r in got for t in r.token_ids] == reference
    final = got[-1]
    assert final.finish_reason == "length" and final.usage.completion_tokens == GREEDY.max_tokens
    assert all(r.request_id == "client-1" and r.worker_id == "w-front" for r in got)
    assert frontend.data.gate.refusals_total == 0
    router.wait_finished(["c1#2"])
    assert all(p.owned and not p.new_token_ids for p in router.outputs("c1#2"))

    # A key the frontend does not own (forgotten, or never its own): it answers with an Abort on the data link.
    core.add_request(WorkerRequest("c2#0", PROMPT, LONG, owner=frontend.address, owner_key="stranger"))
    router.wait_finished(["c2#0"])
    assert router.finish_reason("c2#0") == "abort"
    # The client leaves: the frontend's cancel aborts its request on the data link (no router in between).
    leaving = Relay("client-3")
    frontend.call(lambda: frontend.owned.register("fk3", leaving, list(PROMPT)))
    core.add_request(WorkerRequest("c3#1", PROMPT, LONG, owner=frontend.address, owner_key="fk3"))
    _wait(lambda: frontend.call(lambda: frontend.owned.is_placed("fk3")), what="the first output at the frontend")
    frontend.call(lambda: frontend.owned.placed("fk3"))
    frontend.call(lambda: frontend.owned.cancel("fk3"))
    router.wait_finished(["c3#1"])
    assert router.finish_reason("c3#1") == "abort" and _live(core) == set()


def test_an_owner_that_refuses_the_data_link_orphans_its_requests(
    router: RecordingRouter, make_core: Callable[..., WorkerCore]
) -> None:
    # The owner is up but refuses every connect (it checks data credentials under another key): each refused
    # connect must not count as "up", or the refusals would keep resetting the orphan clock for ever.
    refusing = RecordingRouter()
    refusing.service = DataCredentialService(refusing.handler, new_worker_key())
    refusing.start()
    try:
        core = make_core("w-refused", router.address, orphan_timeout_s=3.0)  # NOTE: > the 2 s longest backoff
        t0 = time.monotonic()
        core.add_request(_owned("own#0", "k", refusing))
        _wait(lambda: refusing.service.refused >= 2, what="the owner refusing the link twice")
        _wait(lambda: "own#0" not in _live(core), timeout=30, what="the refused owner's request orphaned")
        assert time.monotonic() - t0 > 3.0 and not refusing.handler.hellos
        router.wait_finished(["own#0"])  # NOTE: the abort's progress reaches the router after the engine drops it
        assert router.finish_reason("own#0") == "abort"
    finally:
        refusing.close()


def test_an_owner_cannot_add_requests_over_its_data_link(
    router: RecordingRouter, owner: RecordingRouter, make_core: Callable[..., WorkerCore]
) -> None:
    """Trust boundary owner (frontend) -> worker: only the router adds requests; a data link carries aborts only.
    An owner that sends ``AddRequests`` (to run work past the router's admission, tenancy and placement) gets
    ``ok=False`` and nothing runs."""
    core = make_core("w-add", router.address)
    core.add_request(_owned("a#0", "k", owner))  # NOTE: so the worker dials the owner's data link
    owner.wait_tokens("k#0", 1)
    (command,) = add_commands([WorkerRequest("smuggled#0", (5, 6, 7), SamplingParams(max_tokens=4))])
    owner.send("w-add", pb.RouterCommand(add_requests=command))
    acks = owner.wait_for(lambda: owner.acks("w-add"), what="the ack")
    assert [(a.ok, list(a.refusals)) for a in acks] == [(False, [])]
    assert "smuggled#0" not in _live(core)
    assert core.abort("a#0")
    router.wait_finished(["a#0"])
    assert not router.outputs("smuggled#0")
