"""Tiered prefix cache on a real (tiny random) model: a prefix evicted from the pool comes back from
the host or disk tier bit-identical, so tokens equal a recompute and logprobs equal an undisturbed
prefix hit (a hit reruns only the last prompt token, whose logits differ from a whole-prompt forward
in the last bit already without tiers)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvserve.workers.core.block_hash import cache_extra, hash_blocks
from kvserve.workers.core.sampling_params import SamplingParams
from kvserve.workers.engine.engine import LLM, LLMEngine

BS = 4
PROMPT = list(range(100, 124))  # 6 full blocks
FILLERS = [list(range(300 + 50 * k, 340 + 50 * k)) for k in range(3)]  # 11 blocks each: evict everything
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=3)
SEEDED = SamplingParams(max_tokens=8, temperature=1.0, seed=7, ignore_eos=True, logprobs=3)
FILL = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def _tiered(model: Path, tmp_path: Path, **kw: object) -> LLM:
    args: dict[str, object] = {"host_cache_memory": "1MiB", "host_cache_dir": str(tmp_path / "host"),
                               "tier_load": "always", **kw}  # fmt: skip
    return LLM(str(model), block_size=BS, num_gpu_blocks=16, **args)  # type: ignore[arg-type]


def _prompt_hashes(engine: LLMEngine) -> list[int]:
    return hash_blocks(PROMPT, BS, cache_extra(engine.model_id, None))


def _evict_prompt(llm: LLM) -> None:
    """Run other prompts until none of PROMPT's blocks is left in the pool; wait for the spills."""
    engine = llm.engine
    llm.generate(FILLERS, FILL, check_integrity=True)
    assert all(engine.pool.cached_block(h) is None for h in _prompt_hashes(engine)), "fix the test: not evicted"
    assert engine.tiers is not None
    engine.tiers.flush()


@pytest.fixture(scope="module")
def oracles(tiny_llama_dir: Path) -> dict[str, tuple[list[int], list[dict[int, float]]]]:
    """Per sampling mode: tokens of a whole-prompt recompute, logprobs of an undisturbed pool hit."""
    out = {}
    for name, params in (("greedy", GREEDY), ("seeded", SEEDED)):
        (recompute,) = LLM(str(tiny_llama_dir), block_size=BS, num_gpu_blocks=64, enable_prefix_caching=False).generate(
            [PROMPT], params
        )
        undisturbed = LLM(str(tiny_llama_dir), block_size=BS, num_gpu_blocks=64)
        undisturbed.generate([PROMPT], params)
        (hit,) = undisturbed.generate([PROMPT], params)
        assert hit.num_cached_tokens == len(PROMPT) and hit.token_ids == recompute.token_ids
        assert hit.logprobs is not None
        out[name] = (recompute.token_ids, hit.logprobs)
    return out


@pytest.mark.parametrize("mode", ["greedy", "seeded"])
def test_evict_then_reload_from_host_is_identical(tiny_llama_dir: Path, tmp_path: Path, oracles, mode: str) -> None:  # type: ignore[no-untyped-def]
    params = GREEDY if mode == "greedy" else SEEDED
    tokens, logprobs = oracles[mode]
    llm = _tiered(tiny_llama_dir, tmp_path)
    engine = llm.engine
    (first,) = llm.generate([PROMPT], params, check_integrity=True)
    assert first.token_ids == tokens
    _evict_prompt(llm)
    assert engine.tiers is not None
    assert set(_prompt_hashes(engine)) <= set(engine.tiers.tier_hashes()["host"])
    (again,) = llm.generate([PROMPT], params, check_integrity=True)
    assert again.num_cached_tokens == len(PROMPT)
    assert engine.scheduler.tier_hits["host"] == len(PROMPT) and engine.scheduler.prefix_hits == 0
    assert again.token_ids == tokens
    assert again.logprobs == logprobs  # bit-identical KV: bit-identical logits
    assert engine.tiers.stats.blocks_loaded["host"] == len(PROMPT) // BS
    # The loaded blocks are registered in the pool again, and their events name their tiers.
    assert all(engine.pool.cached_block(h) is not None for h in _prompt_hashes(engine))
    engine.close()
    assert engine.tiers is None


def test_another_engine_on_the_node_loads_the_prefix(tiny_llama_dir: Path, tmp_path: Path, oracles) -> None:  # type: ignore[no-untyped-def]
    """Worker B never computed the prompt: it loads every block worker A spilled to the shared tier."""
    tokens, logprobs = oracles["greedy"]
    a = _tiered(tiny_llama_dir, tmp_path)
    a.generate([PROMPT], GREEDY)
    _evict_prompt(a)
    b = _tiered(tiny_llama_dir, tmp_path)
    (out,) = b.generate([PROMPT], GREEDY, check_integrity=True)
    assert out.num_cached_tokens == len(PROMPT) and b.engine.scheduler.tier_hits["host"] == len(PROMPT)
    assert out.token_ids == tokens and out.logprobs == logprobs


def test_disk_tier_takes_blocks_leaving_host_and_serves_them(tiny_llama_dir: Path, tmp_path: Path, oracles) -> None:  # type: ignore[no-untyped-def]
    tokens, logprobs = oracles["greedy"]
    disk = tmp_path / "disk"
    # A host tier of two blocks: the prompt's blocks move on to disk as later ones arrive.
    llm = _tiered(tiny_llama_dir, tmp_path, host_cache_memory=2 * 8400, disk_cache_dir=str(disk))
    engine = llm.engine
    assert engine.tiers is not None and engine.tiers.stores[0].capacity_bytes >= engine.tiers.stores[0].file_bytes
    llm.generate([PROMPT], GREEDY)
    _evict_prompt(llm)
    engine.tiers.publish_events()
    on_disk = set(engine.tiers.tier_hashes()["disk"])
    assert set(_prompt_hashes(engine)) <= on_disk
    (out,) = llm.generate([PROMPT], GREEDY, check_integrity=True)
    assert engine.scheduler.tier_hits["disk"] > 0
    assert out.num_cached_tokens == len(PROMPT) and out.token_ids == tokens and out.logprobs == logprobs
    events = engine.pool.drain_events()
    assert {getattr(e, "tier", None) for e in events} >= {"device", "host", "disk"}


def test_damaged_file_is_recomputed_not_served(tiny_llama_dir: Path, tmp_path: Path, oracles) -> None:  # type: ignore[no-untyped-def]
    tokens, logprobs = oracles["greedy"]
    llm = _tiered(tiny_llama_dir, tmp_path)
    engine = llm.engine
    llm.generate([PROMPT], GREEDY)
    _evict_prompt(llm)
    assert engine.tiers is not None
    path = engine.tiers.stores[0].path(_prompt_hashes(engine)[3])
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x40  # one flipped bit in the last layer's V
    path.write_bytes(bytes(data))
    (out,) = llm.generate([PROMPT], GREEDY, check_integrity=True)
    assert engine.scheduler.tier_hits["host"] == 3 * BS  # blocks 0-2 loaded; 3 on recomputed
    assert out.num_cached_tokens == 3 * BS and out.token_ids == tokens
    assert engine.tiers.stores[0].num_rejected == 1 and not path.exists()
    del logprobs  # a partial hit computes a different chunk: tokens are the oracle here


@pytest.mark.parametrize("cheaper", ["slow_load", "fast_recompute"])
def test_auto_recomputes_when_loading_is_measured_slower(tiny_llama_dir: Path, tmp_path: Path, oracles,  # type: ignore[no-untyped-def]
                                                         cheaper: str) -> None:  # fmt: skip
    """``--tier-load auto`` on a machine where recompute is the cheaper side (a GPU: prefill of a short
    prefix beats a host read): the block is in the tier, yet it is recomputed, and the tokens are the same."""
    tokens, _ = oracles["greedy"]
    llm = _tiered(tiny_llama_dir, tmp_path, tier_load="auto")
    engine = llm.engine
    assert engine.tier_cost.ratio("host") is not None  # measured at start-up
    llm.generate([PROMPT], GREEDY)
    _evict_prompt(llm)
    assert engine.tiers is not None and set(_prompt_hashes(engine)) <= set(engine.tiers.tier_hashes()["host"])
    for _ in range(50):  # the EMAs forget the start-up probe
        if cheaper == "slow_load":  # a load costs more than the whole prefill
            engine.tier_cost.record_load("host", 1, 1.0)
        else:  # a prefill token costs a nanosecond: recomputing a block beats reading it
            engine.tier_cost.record_prefill(1_000_000, 1e-3)
    assert not engine.tier_cost.load_pays("host")
    (out,) = llm.generate([PROMPT], GREEDY, check_integrity=True)
    assert engine.scheduler.tier_hits["host"] == 0 and out.num_cached_tokens == 0
    assert out.token_ids == tokens


def test_two_kv_layouts_share_one_disk_directory(tiny_llama_dir: Path, tmp_path: Path, oracles) -> None:  # type: ignore[no-untyped-def]
    """fp32 and bf16 KV of the same model (same block hashes, other bytes) in one ``--disk-cache-dir``:
    after a restart each gets every block of its prompt from disk, its own, and its own tokens. (With
    files named by the bare hash the second layout's spills found the first's files and were dropped:
    0 disk hits for it, for good.)"""
    disk = tmp_path / "disk"

    def disk_only(kv: str) -> LLM:
        return LLM(str(tiny_llama_dir), block_size=BS, num_gpu_blocks=16, kv_cache_dtype=kv,
                   disk_cache_dir=str(disk), tier_load="always")  # fmt: skip

    first: dict[str, list[int]] = {}
    for kv in ("auto", "bf16"):
        llm = disk_only(kv)
        (out,) = llm.generate([PROMPT], GREEDY)
        first[kv] = out.token_ids
        _evict_prompt(llm)
        llm.engine.close()
    assert first["auto"] == oracles["greedy"][0]
    for kv in ("auto", "bf16"):
        llm = disk_only(kv)  # a restarted worker: an empty pool, the directory as it was left
        (out,) = llm.generate([PROMPT], GREEDY, check_integrity=True)
        assert llm.engine.scheduler.tier_hits["disk"] == len(PROMPT), kv
        assert out.num_cached_tokens == len(PROMPT) and out.token_ids == first[kv], kv
        assert llm.engine.tiers is not None and llm.engine.tiers.stores[0].num_rejected == 0
        llm.engine.close()
