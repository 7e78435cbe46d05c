"""Decode through padded batch-size buckets on static buffers (``cuda_graphs``) gives HF's greedy tokens.

On CPU the graphs' eager twin replays the same padded static buffers a CUDA graph would read, so these
tests run the bucket choice, the padding, the in-place filling and the eager fallback (prefill, mixed
steps, batches past the largest bucket) under preemption (recompute and swap), prefix hits and replay.
Small buckets (1, 2, 4) make most decode steps padded and some fall back.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvserve.workers.core.request import WorkerRequest
from kvserve.workers.core.sampling_params import SamplingParams
from kvserve.workers.engine.config import EngineConfig
from kvserve.workers.engine.cuda_graphs import decode_buckets
from kvserve.workers.engine.engine import LLM, LLMEngine
from tests.model.workload import BUCKETS, GREEDY, MIXED, PREFIX, N, rand_ids


@pytest.fixture(params=["llama", "qwen2"])
def model_dir(request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue(f"tiny_{request.param}_dir")


def _graph_llm(model_dir: Path, **kwargs: object) -> LLM:
    llm = LLM(str(model_dir), device="cpu", **kwargs)
    llm.engine.enable_decode_graphs(BUCKETS)
    _guard_unowned_blocks(llm.engine)
    return llm


def _guard_unowned_blocks(engine: LLMEngine) -> None:
    """Every graph step: no KV block outside the batch's own block tables changes (padding rows store
    nowhere), and the padded rows' slots are -1."""
    graphs = engine.runner.decode_graphs
    assert graphs is not None
    run = graphs.run

    def guarded(batch, block_size, *fix_ids):
        owned = {b for req, _ in batch for b in req.block_table}
        others = [b for b in range(engine.pool.num_blocks) if b not in owned]
        before = [layer[:, others].clone() for layer in engine.kv_cache.layers]
        out = run(batch, block_size, *fix_ids)
        bucket = graphs.bucket(len(batch))
        _, _, attn = graphs.buffers.inputs(bucket)
        assert attn.slot_mapping[len(batch) :].eq(-1).all()
        for old, layer in zip(before, engine.kv_cache.layers, strict=True):
            assert torch.equal(layer[:, others], old), "a graph step wrote a block outside its batch"
        return out

    graphs.run = guarded  # type: ignore[method-assign]


def _tokens(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    outs = llm.generate(prompts, params, check_integrity=True)
    engine = llm.engine
    assert not engine.has_unfinished_requests() and engine.pool.stats().used == 0
    return [o.token_ids for o in outs]


def test_buckets() -> None:
    assert decode_buckets(256) == [1, 2, 4, *range(8, 257, 8)]
    assert decode_buckets(12) == [1, 2, 4, 8, 12]
    assert decode_buckets(3) == [1, 2, 3]
    assert decode_buckets(1000)[-1] == 256


def test_graph_decode_matches_hf(model_dir: Path, hf_greedy) -> None:
    llm = _graph_llm(model_dir, block_size=16, num_gpu_blocks=64, max_num_seqs=3)
    assert _tokens(llm, MIXED) == hf_greedy(model_dir, MIXED, N)
    graphs = llm.engine.runner.decode_graphs
    assert graphs is not None and graphs.replays > 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_graph_decode_with_preemption_matches_hf(model_dir: Path, hf_greedy, mode: str) -> None:
    # 16 blocks x 4 tokens for ~240 tokens of work: preemption over and over; batches of 1..6 (5 and 6
    # run eagerly, past the largest bucket).
    swap = {"swap_space": 0.01} if mode == "swap" else {}
    llm = _graph_llm(model_dir, block_size=4, num_gpu_blocks=16, preemption_mode=mode, **swap)
    assert _tokens(llm, MIXED) == hf_greedy(model_dir, MIXED, N)
    assert llm.engine.scheduler.num_preemptions[mode] > 0
    assert llm.engine.runner.decode_graphs.replays > 0


def test_graph_decode_with_prefix_hits_matches_hf(model_dir: Path, hf_greedy) -> None:
    prompts = [PREFIX + rand_ids(5, 8), PREFIX + rand_ids(11, 9), PREFIX]
    ref = hf_greedy(model_dir, prompts, N)
    llm = _graph_llm(model_dir, block_size=16, num_gpu_blocks=64)
    assert _tokens(llm, prompts[:1]) == ref[:1]
    second = llm.generate(prompts[1:], GREEDY, check_integrity=True)
    assert [o.token_ids for o in second] == ref[1:]
    assert [o.num_cached_tokens for o in second] == [32, 32]  # both hit PREFIX's two blocks
    assert llm.engine.runner.decode_graphs.replays > 0


def test_graph_decode_equals_eager_when_sampling(tiny_llama_dir: Path) -> None:
    """Seeded sampling and logprobs read the same hidden rows on both paths."""
    params = SamplingParams(max_tokens=N, temperature=0.9, top_p=0.9, seed=3, ignore_eos=True, logprobs=2)
    eager = LLM(str(tiny_llama_dir), device="cpu", block_size=4, num_gpu_blocks=128, max_num_seqs=3)
    graph = _graph_llm(tiny_llama_dir, block_size=4, num_gpu_blocks=128, max_num_seqs=3)
    a = eager.generate(MIXED, params)
    b = graph.generate(MIXED, params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert graph.engine.runner.decode_graphs.replays > 0


def test_graph_decode_replay_continues_exactly(tiny_llama_dir: Path) -> None:
    """A resumed request (failover replay) on a graph engine produces the original's remaining tokens."""
    prompt = list(range(100, 112))
    original = LLM(str(tiny_llama_dir), device="cpu", block_size=4, num_gpu_blocks=128)
    tokens = original.generate([prompt], GREEDY)[0].token_ids
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), device="cpu", block_size=4, num_gpu_blocks=128))
    engine.enable_decode_graphs(BUCKETS)
    _guard_unowned_blocks(engine)
    engine.add_request(WorkerRequest("r", prompt, GREEDY, resume_output_ids=tokens[:7]))
    rest: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            rest.extend(out.new_token_ids)
    assert tokens[:7] + rest == tokens
    assert engine.runner.decode_graphs.replays > 0
