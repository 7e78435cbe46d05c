"""Worker actors on real local Ray, streaming over real gRPC to a recording router.

The router side is the real ``router.worker_link.WorkerLinkService`` (seq de-dup, acks, command
resend) hosted by ``worker_harness.RecordingRouter``; the workers are ``Worker`` actors
(``FaultWorker``: the production actor plus the stall faults of section 6, tests/integration/fault_worker.py)
from ``worker_actor_class(actor=FaultWorker)`` on the tiny random llama. Three workers serve the whole module:

* ``wA``, ``wB``: a roomy pool, ``stall_timeout_s=1.0``;
* ``wS``: a 12-block pool with swap preemption and a pressure report after every step.

Tests run in file order and share the router (the restart test restarts it under everyone).
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from kvserve.protos.kvserve.v1 import worker_pb2 as pb  # noqa: E402
from kvserve.workers.core.block_hash import cache_extra, hash_blocks  # noqa: E402
from kvserve.workers.core.identity import WorkerIdentity  # noqa: E402
from kvserve.workers.core.liveness import WorkerError  # noqa: E402
from kvserve.workers.core.request import WorkerRequest  # noqa: E402
from kvserve.workers.core.sampling_params import SamplingParams  # noqa: E402
from kvserve.workers.engine.config import EngineConfig  # noqa: E402
from kvserve.workers.engine.engine import LLM, LLMEngine  # noqa: E402
from kvserve.workers.engine.kv_cache import KVCache, bytes_per_block  # noqa: E402
from kvserve.workers.transport.options import WorkerOptions  # noqa: E402
from kvserve.workers.transport.worker_actor import worker_actor_class  # noqa: E402
from tests.integration.fault_worker import FaultWorker  # noqa: E402
from tests.integration.worker_harness import RecordingRouter  # noqa: E402

BLOCK_SIZE = 4
BIG_POOL = 512  # wA / wB: no eviction over the whole module
SWAP_POOL = 12  # wS: four 22-token requests (6 blocks each) cannot all fit
GREEDY16 = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
GREEDY12 = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
SEEDED16 = SamplingParams(max_tokens=16, temperature=0.8, top_k=50, seed=1234, ignore_eos=True)
VOCAB = 1000  # prompt ids are drawn below this (the tiny model's vocabulary is larger)


def _prompts(n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, VOCAB) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _engine_config(model_dir: Path, **kw: object) -> EngineConfig:
    return EngineConfig(model=str(model_dir), block_size=BLOCK_SIZE, **kw)  # type: ignore[arg-type]


def _swap_config(model_dir: Path) -> EngineConfig:
    return _engine_config(model_dir, num_gpu_blocks=SWAP_POOL, preemption_mode="swap", swap_space=0.01)


def _get(ref, timeout: float = 30.0):
    return ray.get(ref, timeout=timeout)


# ---- fixtures ---------------------------------------------------------------------------------
@dataclass
class Cluster:
    router: RecordingRouter
    actors: dict[str, object]  # worker id -> actor handle
    info: dict[str, WorkerIdentity]  # worker id -> ready() answer

    def actor(self, worker_id: str):
        return self.actors[worker_id]

    def stats(self, worker_id: str):
        return _get(self.actors[worker_id].stats.remote())

    def wait_idle(self, worker_id: str, timeout: float = 20.0):
        deadline = time.monotonic() + timeout
        while True:
            s = self.stats(worker_id)
            if s.num_running + s.num_waiting + s.num_swapped == 0 and s.used_blocks == 0:
                return s
            assert time.monotonic() < deadline, f"{worker_id} not idle: {s}"
            time.sleep(0.05)


@pytest.fixture(scope="module")
def router() -> Iterator[RecordingRouter]:
    r = RecordingRouter().start()
    yield r
    r.close()


@pytest.fixture(scope="module")
def cluster(ray_session, tiny_llama_dir: Path, router: RecordingRouter) -> Iterator[Cluster]:
    cls = worker_actor_class(actor=FaultWorker).options(num_cpus=1)
    roomy = _engine_config(tiny_llama_dir, num_gpu_blocks=BIG_POOL)
    specs = {
        "wA": (roomy, WorkerOptions(router_address=router.address, stall_timeout_s=1.0)),
        "wB": (roomy, WorkerOptions(router_address=router.address, stall_timeout_s=1.0)),
        "wS": (_swap_config(tiny_llama_dir), WorkerOptions(router_address=router.address, pressure_interval_ms=0)),
    }
    actors = {}
    try:
        for wid, (config, options) in specs.items():
            actors[wid] = cls.remote(wid, config, options, num_threads=1)
        info = dict(zip(actors, _get([a.ready.remote() for a in actors.values()], timeout=120), strict=True))
        for wid in actors:  # connected: the unprompted snapshot after connect has arrived
            router.wait_for(lambda w=wid: router.handler.workers.get(w) and router.handler.workers[w].snapshots,
                            timeout=30, what=f"{wid}'s first BlockSnapshot")  # fmt: skip
        yield Cluster(router, actors, info)
    finally:
        for a in actors.values():
            try:
                ray.get(a.shutdown.remote(), timeout=15)
            except Exception:  # noqa: BLE001 - tear down what can be torn down
                pass
            ray.kill(a)


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: Path):
    """``reference(prompts, params)`` -> token lists from the offline engine (a roomy pool, undisturbed)."""
    llm = LLM(str(tiny_llama_dir), block_size=BLOCK_SIZE, num_gpu_blocks=BIG_POOL)
    cache: dict[tuple, list[int]] = {}

    def run(prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
        todo = [p for p in prompts if (tuple(p), params) not in cache]
        if todo:
            for p, out in zip(todo, llm.generate(todo, params, check_integrity=True), strict=True):
                assert out.finish_reason == "length" and len(out.token_ids) == params.max_tokens
                cache[(tuple(p), params)] = out.token_ids
        return [cache[(tuple(p), params)] for p in prompts]

    return run


def _add(cluster: Cluster, worker_id: str, requests: dict[str, list[int]], params: SamplingParams) -> None:
    actor = cluster.actor(worker_id)
    _get([actor.add_request.remote(WorkerRequest(rid, tuple(p), params)) for rid, p in requests.items()])


def _assert_seq_consecutive(router: RecordingRouter, worker_id: str) -> None:
    """Every message the worker ever logged arrived exactly once: seqs 1..N, no gap, no repeat."""
    seqs = router.seqs(worker_id)
    assert seqs == list(range(1, len(seqs) + 1)), f"{worker_id}: seqs not 1..N: {seqs[:50]}..."


def _assert_pool_at_rest(cluster: Cluster, worker_id: str) -> None:
    _get(cluster.actor(worker_id).check_integrity.remote())
    s = cluster.wait_idle(worker_id)
    assert s.used_blocks == 0 and s.free_blocks + s.cached_evictable_blocks == s.total_blocks, s
    assert s.swap_blocks_free == s.swap_blocks_total, s


# ---- 1. streaming == offline ------------------------------------------------------------------
def _assert_contiguous(outs: list, num_tokens: int) -> None:
    """Each output starts where the one before ended (no gap, no duplicate) and they add up to
    ``num_tokens``. NOTE: one output may carry several steps' tokens (``Outbox.put_step`` folds
    steps the link has not sent yet), so the number of outputs is not fixed."""
    ends = [o.num_output_tokens for o in outs]
    starts = [o.num_output_tokens - len(o.new_token_ids) for o in outs]
    assert starts == [0, *ends[:-1]], (starts, ends)
    assert all(o.new_token_ids for o in outs) and ends[-1] == num_tokens, ends


def test_streamed_outputs_equal_offline_greedy(cluster: Cluster, reference) -> None:
    router = cluster.router
    prompts = _prompts(4, 5, 13, seed=1)
    placed = {"wA": {"t1-0": prompts[0], "t1-1": prompts[1]}, "wB": {"t1-2": prompts[2], "t1-3": prompts[3]}}
    for wid, reqs in placed.items():
        _add(cluster, wid, reqs, GREEDY12)
    expected = dict(zip(["t1-0", "t1-1", "t1-2", "t1-3"], reference(prompts, GREEDY12), strict=True))
    got = router.wait_finished(expected)
    assert got == expected
    for wid, reqs in placed.items():
        for rid in reqs:
            outs = router.outputs(rid)
            assert outs == router.outputs(rid, wid)  # all from the worker it was placed on
            _assert_contiguous(outs, GREEDY12.max_tokens)
            assert outs[-1].finish_reason == "length" and all(not o.finish_reason for o in outs[:-1])
            assert outs[-1].num_prompt_tokens == len(reqs[rid])
    for wid in placed:
        _assert_pool_at_rest(cluster, wid)


# ---- 2. pressure reports and block events -------------------------------------------------------
def test_pressure_reports_block_events_and_liveness(cluster: Cluster) -> None:
    router = cluster.router
    for wid in cluster.actors:  # right after connecting (after a fresh pressure report): a snapshot of the empty pool
        first = next(m for m in router.messages(wid) if m.WhichOneof("body") != "pressure")
        assert first.WhichOneof("body") == "block_snapshot", first
        assert first.block_snapshot.seq == 0 and not first.block_snapshot.hashes

    before = len(router.pressure("wA"))
    _add(cluster, "wA", {f"t2-{i}": p for i, p in enumerate(_prompts(3, 20, 30, seed=2))}, GREEDY16)
    router.wait_finished([f"t2-{i}" for i in range(3)])
    busy = router.pressure("wA")[before:]
    assert any(r.used_blocks > 0 and r.num_running > 0 for r in busy), "no report caught the work in flight"

    # Idle: reports keep coming (liveness) at least every ~idle_report_s, with a frozen step counter.
    t_idle = time.monotonic()
    time.sleep(3.2)
    idle = [(t, m.pressure) for t, m in router.timed_messages("wA", "pressure") if t >= t_idle]
    assert len(idle) >= 2, f"only {len(idle)} idle reports in 3.2 s"
    times = [t_idle] + [t for t, _ in idle]
    assert max(b - a for a, b in zip(times, times[1:], strict=False)) < 2.0, times
    stats = cluster.stats("wA")
    last = idle[-1][1]
    assert all(r.decode_steps == stats.decode_steps for _, r in idle)
    assert last.used_blocks == 0 and last.num_running == last.num_waiting == last.num_swapped == 0
    for field in ("total_blocks", "free_blocks", "used_blocks", "cached_evictable_blocks", "swap_blocks_total",
                  "swap_blocks_free", "num_running", "num_waiting", "num_swapped", "decode_steps"):  # fmt: skip
        assert getattr(last, field) == getattr(stats, field), (field, last, stats)
    assert last.num_preemptions_total == stats.num_preemptions_total and last.worker_id == "wA"

    for wid in ("wA", "wB"):
        reports = router.pressure(wid)
        seqs = [r.seq for r in reports]
        assert all(a < b for a, b in zip(seqs, seqs[1:], strict=False)), seqs
        steps = [r.decode_steps for r in reports]
        assert steps == sorted(steps) and steps[-1] > 0
        total = cluster.info[wid].total_blocks
        for r in reports:
            assert r.total_blocks == total and r.free_blocks + r.used_blocks + r.cached_evictable_blocks == total, r
        events = router.block_events(wid)
        assert [e.seq for e in events] == list(range(1, len(events) + 1))
        assert any(e.WhichOneof("kind") == "stored" for e in events)
        _assert_seq_consecutive(router, wid)
    assert not router.handler.errors


# ---- 3. swap under a tiny pool -------------------------------------------------------------------
def _time_swaps(engine: LLMEngine) -> dict[str, float]:
    """Wrap the engine's KVCache swap methods to count and time the blocks they move."""
    kv, acc = engine.kv_cache, {"out": 0, "in": 0, "t_out": 0.0, "t_in": 0.0}

    def timed(name: str, fn):
        def wrapper(mapping):
            t0 = time.perf_counter()
            fn(mapping)
            acc[f"t_{name}"] += time.perf_counter() - t0
            acc[name] += len(mapping)

        return wrapper

    kv.swap_out, kv.swap_in = timed("out", kv.swap_out), timed("in", kv.swap_in)
    return acc


def test_swap_under_tiny_pool(cluster: Cluster, reference, tiny_llama_dir: Path) -> None:
    router = cluster.router
    prompts = _prompts(4, 6, 6, seed=3)  # 6 + 16 tokens = 6 blocks each; 4 x 6 > 12
    rids = [f"t3-{i}" for i in range(4)]
    before = len(router.pressure("wS"))
    _add(cluster, "wS", dict(zip(rids, prompts, strict=True)), GREEDY16)
    got = router.wait_finished(rids)
    expected = reference(prompts, GREEDY16)
    assert [got[r] for r in rids] == expected

    reports = router.pressure("wS")[before:]
    assert any(r.num_swapped > 0 for r in reports), "no report saw a swapped request"
    assert any(r.swap_blocks_free < r.swap_blocks_total for r in reports)
    assert max(o.num_swaps for r in rids for o in router.outputs(r)) > 0
    stats = cluster.stats("wS")
    assert stats.num_swaps_total > 0 and stats.num_swaps_total == stats.num_preemptions_total
    _assert_pool_at_rest(cluster, "wS")
    last = router.wait_for(lambda: _last_pressure(router, "wS", used=0), timeout=5, what="wS's final report")
    assert last.num_swaps_total == stats.num_swaps_total and last.swap_blocks_free == last.swap_blocks_total

    # The same workload in-process, with the KV copies counted and timed (CPU "device" <-> host).
    llm = LLM.from_config(_swap_config(tiny_llama_dir))
    acc = _time_swaps(llm.engine)
    outs = llm.generate(prompts, GREEDY16, check_integrity=True)
    assert [o.token_ids for o in outs] == expected
    assert acc["out"] > 0 and acc["in"] == acc["out"]
    block_bytes = bytes_per_block(llm.engine.model_config, BLOCK_SIZE, llm.engine.dtype)
    print(
        f"\n[swap] wS: {stats.num_swaps_total} swap preemptions; in-process replay: {acc['out']} blocks out "
        f"({acc['t_out'] * 1e6 / acc['out']:.1f} us/block), {acc['in']} blocks in "
        f"({acc['t_in'] * 1e6 / acc['in']:.1f} us/block), {block_bytes} B/block"
    )

    # Bulk copy cost per block, without the engine around it.
    mc, n = llm.engine.model_config, 256
    kv = KVCache(mc, n, BLOCK_SIZE, llm.engine.dtype, llm.engine.device, num_swap_blocks=n)
    mapping = [(i, n - 1 - i) for i in range(n)]
    for name, fn in (("swap_out", kv.swap_out), ("swap_in", kv.swap_in)):
        runs = []
        for _ in range(15):
            t0 = time.perf_counter()
            fn(mapping)
            runs.append((time.perf_counter() - t0) / n)
        dt = sorted(runs)[len(runs) // 2]
        print(f"[swap] bulk KVCache.{name} of {n} blocks: median {dt * 1e6:.2f} us/block "
              f"({block_bytes / dt / 2**30:.2f} GiB/s)")  # fmt: skip


def _last_pressure(router: RecordingRouter, worker_id: str, used: int):
    """The latest report of a worker if it shows ``used`` used blocks (caller holds the lock)."""
    msgs = router.handler.workers[worker_id].messages
    last = next((m.pressure for _, m in reversed(msgs) if m.WhichOneof("body") == "pressure"), None)
    return last if last is not None and last.used_blocks == used else None


# ---- 4. migration -----------------------------------------------------------------------------------
class _Export:
    """Export a request from a worker as soon as the router has seen ``n`` of its tokens."""

    def __init__(self, router: RecordingRouter, actor, request_id: str, n: int) -> None:
        self.fired = threading.Event()
        self.ref = None
        self.t_fire = 0.0

        def fire() -> None:
            self.t_fire = time.perf_counter()
            self.ref = actor.export_request.remote(request_id)  # non-blocking; on the router's loop
            self.fired.set()

        router.on_tokens(request_id, n, fire)

    def state(self):
        assert self.fired.wait(20), "export trigger never fired"
        state = _get(self.ref)
        return state, time.perf_counter() - self.t_fire


@pytest.mark.parametrize("params", [GREEDY16, SEEDED16], ids=["greedy", "seeded"])
def test_migration_via_actor_calls(cluster: Cluster, reference, params: SamplingParams) -> None:
    router, a, b = cluster.router, cluster.actor("wA"), cluster.actor("wB")
    rid = f"t4-{'greedy' if params.temperature == 0 else 'seeded'}"
    prompt = _prompts(1, 9, 9, seed=4)[0]
    export = _Export(router, a, rid, 4)
    _add(cluster, "wA", {rid: prompt}, params)
    state, t_export = export.state()
    assert state is not None, "request finished before the export"
    n_before = len(state.output_token_ids)
    assert 4 <= n_before < params.max_tokens and state.kv_blocks is not None
    t0 = time.perf_counter()
    assert _get(b.import_request.remote(state)) is True
    t_import = time.perf_counter() - t0
    assert _get(a.finish_export.remote(rid, True)) is True
    assert _get(a.finish_export.remote(rid, True)) is False  # once

    router.wait_finished([rid])
    tokens_a = router.wait_for(lambda: len(router.handler.outputs.get(rid, ())) and
                               _tokens_of(router, rid, "wA", n_before), what="A's tokens")  # fmt: skip
    tokens_b = router.tokens(rid, "wB")
    assert tokens_a == state.output_token_ids
    assert tokens_a + tokens_b == reference([prompt], params)[0]
    assert router.outputs(rid, "wB")[-1].num_output_tokens == params.max_tokens
    assert router.finish_reason(rid) == "length"
    _assert_pool_at_rest(cluster, "wA")
    _assert_pool_at_rest(cluster, "wB")
    n_blocks = state.kv_blocks[0].shape[1]
    print(
        f"\n[migrate {rid}] {n_before} tokens on A, {len(tokens_b)} on B; KV {state.kv_bytes} B "
        f"({n_blocks} blocks x {len(state.kv_blocks)} layers, {state.num_computed_tokens} tokens); "
        f"export {t_export * 1e3:.1f} ms (trigger -> state), import {t_import * 1e3:.1f} ms"
    )


def _tokens_of(router: RecordingRouter, rid: str, worker_id: str, n: int) -> list[int] | None:
    """The tokens a worker streamed for ``rid`` once there are ``n`` (caller holds the lock)."""
    toks = [t for w, o in router.handler.outputs.get(rid, ()) if w == worker_id for t in o.new_token_ids]
    return toks if len(toks) == n else None


def test_migration_that_does_not_fit_resumes_at_source(cluster: Cluster, reference) -> None:
    router, a, s = cluster.router, cluster.actor("wA"), cluster.actor("wS")
    rid = "t4-big"
    prompt = _prompts(1, 60, 60, seed=6)[0]  # 60 + outputs > 15 blocks: more than wS's whole pool
    export = _Export(router, a, rid, 3)
    _add(cluster, "wA", {rid: prompt}, GREEDY12)
    state, _ = export.state()
    assert state is not None and 3 <= len(state.output_token_ids) < GREEDY12.max_tokens
    assert _get(s.import_request.remote(state)) is None  # "not now": does not fit
    print(f"\n[migrate {rid}] refused by wS: {state.num_tokens} tokens, KV {state.kv_bytes} B")
    _assert_pool_at_rest(cluster, "wS")  # nothing allocated there
    assert _get(a.finish_export.remote(rid, False)) is True
    router.wait_finished([rid])
    assert {w for w, _ in router.handler.outputs[rid]} == {"wA"}
    assert router.tokens(rid) == reference([prompt], GREEDY12)[0]
    _assert_contiguous(router.outputs(rid), GREEDY12.max_tokens)
    _assert_pool_at_rest(cluster, "wA")


# ---- 5. router restart ------------------------------------------------------------------------------
def test_router_restart_replays_without_loss_or_duplicates(cluster: Cluster, reference) -> None:
    router = cluster.router
    workers = ("wA", "wB")
    prompts = _prompts(4, 8, 14, seed=7)
    placed = {"wA": ["t5-0", "t5-2"], "wB": ["t5-1", "t5-3"]}
    rid_prompt = dict(zip(["t5-0", "t5-1", "t5-2", "t5-3"], prompts, strict=True))
    hellos0 = {w: len(router.hellos(w)) for w in workers}
    disc0 = {w: router.disconnects(w) for w in workers}
    replayed0 = router.replayed()
    # Hold acks so what streams before the kill is surely replayed after it.
    router.set_ack_policy(ack_every=10**9, ack_interval_s=3600.0)
    time.sleep(0.3)  # streams waiting on the old 0.2 s interval pick the new one up
    try:
        # In flight across the kill: stop the router as soon as the first tokens arrived.
        _add(cluster, "wA", {"t5-0": rid_prompt["t5-0"]}, GREEDY16)
        _add(cluster, "wB", {"t5-1": rid_prompt["t5-1"]}, GREEDY16)
        router.wait_tokens("t5-0", 2)
        router.wait_tokens("t5-1", 2)
        unacked = router.stop()
    finally:
        router.set_ack_policy(ack_every=32, ack_interval_s=0.2)
    assert all(unacked[w] > 0 for w in workers), unacked
    router.wait_for(lambda: all(router.handler.workers[w].disconnects > disc0[w] for w in workers), 10,
                    "disconnects")  # fmt: skip
    # Produced entirely while the router is down.
    _add(cluster, "wA", {"t5-2": rid_prompt["t5-2"]}, GREEDY16)
    _add(cluster, "wB", {"t5-3": rid_prompt["t5-3"]}, GREEDY16)
    for w in workers:
        cluster.wait_idle(w)
    assert not router.outputs("t5-2") and not router.outputs("t5-3")
    t_restart = time.monotonic()
    router.start()
    router.wait_for(lambda: all(len([h for h in router.handler.hellos if h.worker_id == w]) > hellos0[w]
                                for w in workers), 15, "reconnect Hellos")  # fmt: skip
    expected = dict(zip(rid_prompt, reference(prompts, GREEDY16), strict=True))
    assert router.wait_finished(expected) == expected  # nothing lost, nothing doubled
    for w in workers:
        first, again = router.hellos(w)[0], router.hellos(w)[-1]
        assert again.hello.incarnation == first.hello.incarnation and not again.restarted
        assert again.hello.total_blocks == first.hello.total_blocks
        # NOTE: wait for it: it follows the replayed log on the stream, so it may still be in flight
        # when the last replayed output has arrived; the arrival time is what must be prompt.
        first_report = router.wait_for(
            lambda w=w, since=again.time: next(
                (t for t, m in router.handler.workers[w].messages if m.HasField("pressure") and t >= since), None
            ),
            timeout=5,
            what=f"a pressure report from {w} after the reconnect",
        )
        assert first_report - again.time < 0.5, "no fresh pressure report right after the reconnect"
        replayed = router.replayed().get(w, 0) - replayed0.get(w, 0)
        assert replayed >= unacked[w], (w, replayed, unacked[w])  # replayed, and dropped by the de-dup
        for rid in placed[w]:
            _assert_contiguous(router.outputs(rid, w), 16)
        snap = router.wait_for(
            lambda w=w: next((s for s in router.handler.workers[w].snapshots if s.time >= t_restart), None),
            timeout=5,
            what=f"a BlockSnapshot from {w} after the reconnect",
        )
        assert snap.snapshot.seq == snap.last_event_seq
        assert set(snap.snapshot.hashes) == snap.event_hashes

    # Ask again now that everything finished; cross-check with the engine's own hash chain.
    n_snaps = len(router.snapshots("wA"))
    seq = router.send("wA", pb.RouterCommand(request_snapshot=pb.RequestSnapshot()))
    router.wait_for(lambda: len(router.handler.workers["wA"].snapshots) > n_snaps, what="requested snapshot")
    snap = router.snapshots("wA")[-1]
    last_seq, hashes = router.event_hashes("wA")
    assert snap.snapshot.seq == last_seq and set(snap.snapshot.hashes) == hashes
    assert not any(e.WhichOneof("kind") == "removed" for e in router.block_events("wA"))  # no eviction yet
    extra = cache_extra(cluster.info["wA"].model_id, None)
    for rid in placed["wA"]:
        computed = rid_prompt[rid] + expected[rid][:-1]  # the last token's K/V is never computed
        assert set(hash_blocks(computed, BLOCK_SIZE, extra)) <= hashes
    router.wait_for(lambda: any(a.command_seq == seq and a.ok for a in
                                (m.ack for _, m in router.handler.workers["wA"].messages
                                 if m.WhichOneof("body") == "ack")), what="snapshot ack")  # fmt: skip
    for w in (*workers, "wS"):
        _assert_seq_consecutive(router, w)
    assert not router.handler.errors


# ---- 6. stall detection ---------------------------------------------------------------------------
def test_stalled_engine_fails_health_then_recovers(cluster: Cluster, reference) -> None:
    router, a = cluster.router, cluster.actor("wA")
    _get(a.check_health.remote())
    time.sleep(1.2)  # idle for longer than stall_timeout_s: idle is not a stall
    # NOTE: a 6 s stall, reported within it: the threshold is 1 s or 4x the worker's slowest step so far, which a
    # loaded box raises (a 3 s stall once ended 8 ms before a check under load ~10 saw it)
    _get(a.stall.remote(6.0))
    t0 = time.monotonic()
    _get(a.check_health.remote())  # the stall began just now: not yet stalled for stall_timeout_s
    prompt = _prompts(1, 7, 7, seed=8)[0]
    pending = a.add_request.remote(WorkerRequest("t6-0", tuple(prompt), GREEDY12))  # queued behind the stall
    deadline = t0 + 5.8
    while True:
        try:
            _get(a.check_health.remote())
        except WorkerError as e:
            assert "no progress" in str(e)
            break
        assert time.monotonic() < deadline, "check_health never reported the stall"
        time.sleep(0.1)
    assert time.monotonic() - t0 > 0.7
    _get(pending)
    assert router.wait_finished(["t6-0"])["t6-0"] == reference([prompt], GREEDY12)[0]
    _get(a.check_health.remote())
    _assert_pool_at_rest(cluster, "wA")


@pytest.mark.parametrize("computing", [True, False])
def test_a_long_step_is_slow_while_it_computes_and_stalled_when_it_does_not(
    cluster: Cluster, reference, computing: bool
) -> None:
    """A 3 s step (stall threshold 1 s): computing, it heartbeats and is never stalled; sleeping, it is.

    NOTE: one worker each: a 3 s step raises its worker's stall threshold to 12 s (4x the slowest step)."""
    wid = "wA" if computing else "wB"
    router, a = cluster.router, cluster.actor(wid)
    rid = f"t6b-{computing}"
    beats_before = _heartbeats(router, wid)
    _get(a.slow_next_step.remote(3.0, computing))
    prompt = _prompts(1, 7, 7, seed=9)[0]
    _get(a.add_request.remote(WorkerRequest(rid, tuple(prompt), GREEDY12)))
    t0, stalled_at, beats_at_stall = time.monotonic(), None, None
    while not router.finish_reason(rid) and time.monotonic() - t0 < 60:
        try:
            _get(a.check_health.remote())
        except WorkerError as e:
            assert "no progress" in str(e)
            if stalled_at is None:
                stalled_at, beats_at_stall = time.monotonic() - t0, _heartbeats(router, wid)
        time.sleep(0.1)
    assert router.wait_finished([rid])[rid] == reference([prompt], GREEDY12)[0]
    if computing:
        assert stalled_at is None, f"a computing step was called stalled after {stalled_at:.1f}s"
        assert _heartbeats(router, wid) > beats_before
    else:
        assert stalled_at is not None, "a sleeping step was never called stalled"
        # NOTE: up to the stall, none; the step's real work after its sleep may beat (it computes then)
        assert beats_at_stall == beats_before
    _get(a.check_health.remote())
    _assert_pool_at_rest(cluster, wid)


def _heartbeats(router: RecordingRouter, worker_id: str) -> int:
    return len(router.messages(worker_id, "heartbeat"))


# ---- 7. commands for unknown requests ---------------------------------------------------------------
def test_commands_for_unknown_requests_are_ignored(cluster: Cluster, reference) -> None:
    router = cluster.router
    commands = [
        pb.RouterCommand(abort=pb.Abort(request_id="nope")),
        pb.RouterCommand(preempt=pb.Preempt(request_id="nope", mode=pb.Preempt.SWAP)),
    ]
    seqs = [router.send("wB", c) for c in commands]

    def answered():
        acks = {a.command_seq: a for a in router.acks("wB")}
        return acks if all(s in acks for s in seqs) else None

    acks = router.wait_for(answered, what="acks")
    for s in seqs:
        assert acks[s].ok is False and acks[s].request_id == "nope"
    assert not router.unapplied("wB")  # every command answered, none to resend

    prompt = _prompts(1, 6, 6, seed=9)[0]
    _add(cluster, "wB", {"t7-0": prompt}, GREEDY12)
    assert router.wait_finished(["t7-0"])["t7-0"] == reference([prompt], GREEDY12)[0]
    _get(cluster.actor("wB").check_health.remote())
    _assert_pool_at_rest(cluster, "wB")
    _assert_seq_consecutive(router, "wB")
