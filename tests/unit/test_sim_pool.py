"""The realistic simulated worker's pool (kvserve/cluster/bench/sim_worker.py ``SimPool``): the block events
and counts a real worker's pool would produce for the same requests (issue 41 item 6)."""

from __future__ import annotations

import threading
from collections import Counter

from kvserve.cluster.bench.data_plane import stream_prompts
from kvserve.cluster.bench.sim_worker import SimPool, SimSpec, SimWorker, _Running
from kvserve.protos.kvserve.v1 import worker_pb2 as pb
from kvserve.workers.core.block_hash import cache_extra, hash_blocks
from kvserve.workers.core.request import WorkerRequest
from kvserve.workers.core.sampling_params import SamplingParams


def _sim(total_blocks: int) -> SimWorker:
    """A SimWorker's state and step logic, without its link or step thread."""
    w = SimWorker.__new__(SimWorker)
    w.worker_id, w.spec = "w", SimSpec(block_size=4, total_blocks=total_blocks, realistic=True)
    w._pool, w._extra = SimPool(total_blocks), cache_extra("sim", None)
    w._counters, w._cached_tokens = Counter(), {}
    return w


def _run(rid: str, prompt: list[int], max_tokens: int) -> _Running:
    return _Running(WorkerRequest(rid, tuple(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True)))


def test_prompt_blocks_are_stored_once_reused_then_evicted_least_recent_first() -> None:
    w = _sim(total_blocks=6)
    pool = w._pool
    a = _run("a", list(range(10)), 2)  # 2 full blocks + a partial one
    w._prefill(a)
    hashes = hash_blocks(list(range(10)), 4, cache_extra("sim", None))
    assert pool.events == [("stored", (hashes[0],)), ("stored", (hashes[1],))] and a.hashes == hashes
    assert (pool.free, pool.used, len(pool.cached)) == (3, 3, 0)
    w._grow(a, 10, 12)  # its partial block fills: stored under its own hash
    assert pool.events[-1] == ("stored", (a.hashes[2],)) and pool.partial == 0
    pool.events.clear()
    a.emitted = 2
    w._release(a)  # finished: its 3 full blocks stay cached
    assert (pool.free, pool.used, len(pool.cached)) == (3, 0, 3)

    b = _run("b", list(range(9)), 1)  # the same first 2 blocks: reused, nothing stored
    w._prefill(b)
    assert pool.events == [] and w._cached_tokens["b"] == 8 and w._counters["hit"] == 8
    assert (pool.free, len(pool.cached)) == (2, 1)  # a's third block still cached; b's partial took a free one
    c = _run("c", [100 + i for i in range(12)], 1)  # 3 new blocks: 2 free, then the cached one is evicted
    w._prefill(c)
    assert pool.events[-2:-1] == [("removed", (a.hashes[2],))]  # evicted to make room for c's last block
    assert [kind for kind, _ in pool.events].count("stored") == 3


def test_a_realistic_step_reports_what_a_real_worker_does() -> None:
    w = _sim(total_blocks=64)
    w.outbox = type("Box", (), {"put_step": lambda self, *a: setattr(self, "sent", a) or True})()
    w._lock = threading.Lock()
    w._running = {"a": _run("a", list(range(10)), 3)}
    w._steps = w._report_seq = w._event_seq = 0
    w._pressure = type("Always", (), {"due": lambda self, now, r: True, "sent": lambda self, now, r: None})()
    for _ in range(3):
        w._step()
    step, events, report = w.outbox.sent
    assert step.outputs[0].finish_reason == "length" and not w._running
    assert isinstance(report, pb.PressureReport)
    assert report.prefill_tokens_total == 10 and report.prefix_cache_query_tokens_total == 10
    assert report.cached_evictable_blocks == 3 and report.free_blocks == 61  # 12 + 1 tokens: 3 full + 1 partial


def test_realistic_streams_have_prompts_of_their_own() -> None:
    prompts = stream_prompts(64, realistic=True)
    assert len({tuple(p) for p in prompts}) == 64 and min(map(len, prompts)) >= 16 and max(map(len, prompts)) <= 256
    assert stream_prompts(3, realistic=False) == [list(range(1, 17))] * 3
