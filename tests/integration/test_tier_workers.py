"""Two worker actors of one node share a host tier: a prefix worker A computed and evicted is loaded,
not recomputed, by worker B, with the tokens of a recompute; block events and pressure reports say
which tier held what (real local Ray, real gRPC to a recording router on 127.0.0.1)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from kvserve.workers.core.block_hash import cache_extra, hash_blocks  # noqa: E402
from kvserve.workers.core.request import WorkerRequest  # noqa: E402
from kvserve.workers.core.sampling_params import SamplingParams  # noqa: E402
from kvserve.workers.engine.config import EngineConfig  # noqa: E402
from kvserve.workers.engine.engine import LLM  # noqa: E402
from kvserve.workers.transport.options import WorkerOptions  # noqa: E402
from kvserve.workers.transport.worker_actor import worker_actor_class  # noqa: E402
from tests.integration.worker_harness import RecordingRouter  # noqa: E402

BS = 4
PROMPT = list(range(100, 124))  # 6 full blocks
FILLERS = [list(range(300 + 50 * k, 340 + 50 * k)) for k in range(3)]  # push PROMPT out of a 16-block pool
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
FILL = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def _get(ref, timeout: float = 60.0):
    return ray.get(ref, timeout=timeout)


@pytest.fixture
def workers(ray_session, tiny_llama_dir: Path, tmp_path: Path) -> Iterator[tuple[RecordingRouter, dict]]:
    router = RecordingRouter().start()
    config = EngineConfig(model=str(tiny_llama_dir), block_size=BS, num_gpu_blocks=16, host_cache_memory="1MiB",
                          host_cache_dir=str(tmp_path / "host"), tier_load="always")  # fmt: skip
    cls = worker_actor_class().options(num_cpus=1)
    actors = {wid: cls.remote(wid, config, WorkerOptions(router_address=router.address), num_threads=1)
              for wid in ("wA", "wB")}  # fmt: skip
    try:
        _get([a.ready.remote() for a in actors.values()], timeout=120)
        yield router, actors
    finally:
        for a in actors.values():
            try:
                _get(a.shutdown.remote(), timeout=15)
            except Exception:  # noqa: BLE001 - tear down what can be torn down
                pass
            ray.kill(a)
        router.close()


def _tier_hashes(router: RecordingRouter, worker_id: str, tier: int) -> set[int]:
    """The hash set of one tier as a router would fold it from the worker's block events."""
    held: set[int] = set()
    for ev in router.block_events(worker_id):
        which = ev.WhichOneof("kind")
        if which == "stored" and ev.stored.tier == tier:
            held.update(ev.stored.hashes)
        elif which == "removed" and ev.removed.tier == tier:
            held.difference_update(ev.removed.hashes)
    return held


def test_prefix_evicted_on_a_is_loaded_by_b(workers, tiny_llama_dir: Path) -> None:
    from kvserve.protos.kvserve.v1 import worker_pb2 as pb

    router, actors = workers
    (expected,) = [o.token_ids for o in LLM(str(tiny_llama_dir), block_size=BS, num_gpu_blocks=64,
                                             enable_prefix_caching=False).generate([PROMPT], GREEDY)]  # fmt: skip
    model_id = _get(actors["wA"].ready.remote()).model_id
    hashes = set(hash_blocks(PROMPT, BS, cache_extra(model_id, None)))

    _get(actors["wA"].add_request.remote(WorkerRequest("a0", tuple(PROMPT), GREEDY)))
    assert router.wait_finished(["a0"])["a0"] == expected
    _get([actors["wA"].add_request.remote(WorkerRequest(f"f{k}", tuple(p), FILL)) for k, p in enumerate(FILLERS)])
    router.wait_finished([f"f{k}" for k in range(len(FILLERS))])
    # A's events: the prefix left its pool and reached the node's host tier.
    router.wait_for(lambda: hashes <= _tier_hashes(router, "wA", pb.TIER_HOST), what="A's host-tier events")
    assert not hashes & _tier_hashes(router, "wA", pb.TIER_DEVICE)

    _get(actors["wB"].add_request.remote(WorkerRequest("b0", tuple(PROMPT), GREEDY)))
    assert router.wait_finished(["b0"])["b0"] == expected
    (last,) = [o for o in router.outputs("b0") if o.finish_reason]
    assert last.num_cached_tokens == len(PROMPT)  # B computed only the last prompt token
    assert hashes <= _tier_hashes(router, "wB", pb.TIER_DEVICE)  # loaded blocks are B's device hits now
    stats = router.wait_for(
        lambda: next((r for r in router.pressure("wB") if r.prefix_cache_host_hit_tokens_total), None),
        what="B's pressure report with its host hits",
    )
    assert stats.prefix_cache_host_hit_tokens_total == len(PROMPT) and stats.prefix_cache_hit_tokens_total == 0
    assert stats.tier_bytes_loaded_total > 0 and stats.host_cache_bytes_capacity == 2**20
    assert 0 < stats.host_load_ratio and stats.recompute_ms_per_block > 0  # measured at start-up
    _get(actors["wB"].check_integrity.remote())
