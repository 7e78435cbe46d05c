"""The host/disk KV tiers under tensor parallelism (kvserve/workers/parallel/tiers.py) on a real gloo group:
each rank spills its KV heads of an evicted block to a file of its own layout (``tp=rank/size``), a prefix
evicted from the pool comes back from the host (or disk) tier on every rank and the tokens are HF's; a block one
rank lacks is loaded on none (the group agrees on the shortest run), and the rest is recomputed."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvserve.workers.core.block_hash import cache_extra, hash_blocks
from kvserve.workers.core.sampling_params import SamplingParams
from kvserve.workers.engine.block_store import layout_digest
from kvserve.workers.engine.engine import LLM

BS = 4
PROMPT = list(range(100, 124))  # 6 full blocks
FILLERS = [list(range(300 + 50 * k, 340 + 50 * k)) for k in range(3)]  # 11 blocks each: evict everything
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
FILL = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def _tiered_group(model: Path, directory: Path, tier: str = "host") -> LLM:
    where = ({"host_cache_memory": "1MiB", "host_cache_dir": str(directory)} if tier == "host" else
             {"disk_cache_dir": str(directory), "disk_cache_size": "1MiB"})  # fmt: skip
    return LLM(str(model), device="cpu", block_size=BS, num_gpu_blocks=16, tensor_parallel_size=2,
               tier_load="always", **where)  # fmt: skip


def _evict_prompt(llm: LLM) -> list[int]:
    """Run other prompts until none of PROMPT's blocks is left in the pool; wait for every rank's spills.
    Returns PROMPT's block hashes."""
    engine = llm.engine
    hashes = hash_blocks(PROMPT, BS, cache_extra(engine.model_id, None))
    llm.generate(FILLERS, FILL, check_integrity=True)
    assert all(engine.pool.cached_block(h) is None for h in hashes), "fix the test: not evicted"
    assert engine.tiers is not None
    engine.tiers.flush()
    return hashes


def _rank_file(host: Path, layout: str, rank: int, block_hash: int) -> Path:
    """Rank ``rank``'s file of a block, named by its own layout (rank 0's layout with its rank)."""
    fingerprint = layout_digest(layout.replace("|tp=0/2", f"|tp={rank}/2"))[:8].hex()
    return host / f"{fingerprint}-{block_hash:016x}.kvb"


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_tp2_prefix_from_a_tier_matches_hf(tiny_llama_dir: Path, tmp_path: Path, hf_greedy, tier: str) -> None:
    want = hf_greedy(tiny_llama_dir, [PROMPT], 8)[0]
    llm = _tiered_group(tiny_llama_dir, tmp_path, tier)
    engine = llm.engine
    try:
        assert llm.generate([PROMPT], GREEDY)[0].token_ids == want
        hashes = _evict_prompt(llm)
        assert engine.tiers is not None and "|tp=0/2" in engine.tiers.layout
        for rank in (0, 1):  # each rank's shard of each block, under its own name
            assert all(_rank_file(tmp_path, engine.tiers.layout, rank, h).exists() for h in hashes), rank
        (again,) = llm.generate([PROMPT], GREEDY, check_integrity=True)
        assert engine.scheduler.tier_hits[tier] == len(PROMPT) and again.num_cached_tokens == len(PROMPT)
        assert engine.tiers.stats.blocks_loaded[tier] == len(PROMPT) // BS
        assert engine.followers_alive()
    finally:
        engine.close()
    assert again.token_ids == want


def test_tp2_block_missing_on_one_rank_is_loaded_on_none(tiny_llama_dir: Path, tmp_path: Path, hf_greedy) -> None:
    """Rank 1's file of the prompt's third block is gone (evicted by its own LRU, a dropped spill): the group
    loads the two blocks every rank has and recomputes from the third on; tokens are still HF's."""
    want = hf_greedy(tiny_llama_dir, [PROMPT], 8)[0]
    llm = _tiered_group(tiny_llama_dir, tmp_path)
    engine = llm.engine
    try:
        llm.generate([PROMPT], GREEDY)
        hashes = _evict_prompt(llm)
        assert engine.tiers is not None
        _rank_file(tmp_path, engine.tiers.layout, 1, hashes[2]).unlink()
        (again,) = llm.generate([PROMPT], GREEDY, check_integrity=True)
        assert engine.tiers.stats.blocks_loaded["host"] == 2 and again.num_cached_tokens == 2 * BS
    finally:
        engine.close()
    assert again.token_ids == want
