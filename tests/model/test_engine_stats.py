"""``LLMEngine.make_stats``: the engine's report of itself, read after real steps on a tiny model."""

from __future__ import annotations

from pathlib import Path

from kvserve.workers.core.sampling_params import SamplingParams
from kvserve.workers.engine.engine import LLM

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PREFIX = list(range(100, 132))  # two full 16-token blocks the second request finds cached


def test_stats_follow_the_pool_and_the_scheduler(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir), device="cpu", block_size=16)
    engine = llm.engine
    before = engine.make_stats()
    assert (before.total_blocks, before.free_blocks, before.used_blocks) == (engine.pool.num_blocks,) * 2 + (0,)
    assert before.prefill_tokens_total == before.prefix_cache_query_tokens_total == 0

    llm.generate([PREFIX + [7]], GREEDY)
    llm.generate([PREFIX + [9]], GREEDY)
    s = engine.make_stats()
    assert s.num_running == s.num_waiting == s.num_swapped == s.used_blocks == s.tokens_in_flight == 0
    assert s.free_blocks + s.cached_evictable_blocks == s.total_blocks and s.cached_evictable_blocks > 0
    assert s.prefix_cache_query_tokens_total == 2 * (len(PREFIX) + 1)
    assert s.prefix_cache_hit_tokens_total == len(PREFIX), "the second prompt's two full blocks were cached"
    assert s.prefill_tokens_total > 0 and s.num_preemptions_total == s.num_swaps_total == 0
    assert s.host_cache_bytes_capacity == s.disk_cache_bytes_capacity == 0  # no tiers configured


def test_decode_graph_steps_are_counted(tiny_llama_dir: Path) -> None:
    """``decode_graph_steps_total``: the decode steps that replayed a graph (on CPU its eager twin runs the
    same path), none without graphs; prefill steps never count."""
    eager = LLM(str(tiny_llama_dir), device="cpu", block_size=16)
    eager.generate([[5, 6, 7]], GREEDY)
    assert eager.engine.make_stats().decode_graph_steps_total == 0

    llm = LLM(str(tiny_llama_dir), device="cpu", block_size=16)
    llm.engine.enable_decode_graphs([1, 2])
    llm.generate([[5, 6, 7], [8, 9]], GREEDY)  # one prefill step, then 5 decode steps of both requests
    graphs = llm.engine.runner.decode_graphs
    assert graphs is not None
    assert llm.engine.make_stats().decode_graph_steps_total == graphs.replays == GREEDY.max_tokens - 1
