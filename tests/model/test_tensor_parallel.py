"""Tensor parallelism on CPU (kvserve/workers/parallel): a real gloo group of spawned rank processes on
loopback. Greedy tokens of TP=2 equal HF transformers' (fp32) for Llama, Qwen2 (q/k/v biases) and Qwen3
(q/k norms, decoupled head_dim), with recompute and swap preemption and prefix-cache hits forced, and
across migrations to and from TP=1; logprobs within 1e-4 of TP=1; SmolLM2 at TP=3 (9 heads); each rank's
weights about 1/N of the model's."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch

from kvserve.workers.core.sampling_params import SamplingParams
from kvserve.workers.engine.engine import LLM
from kvserve.workers.engine.outputs import CompletionOutput
from kvserve.workers.models.loader import load_model
from kvserve.workers.models.random_model import init_random
from kvserve.workers.parallel.shard_loader import load_shard
from tests.model.workload import GREEDY, MIXED, PREFIX, PREFIX_A, PREFIX_B, N, rand_ids


@pytest.fixture(params=["llama", "qwen2", "qwen3"])
def model_dir(request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue(f"tiny_{request.param}_dir")


def _run(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[CompletionOutput]:
    outs = llm.generate(prompts, params, check_integrity=True)
    assert llm.engine.pool.stats().used == 0
    return outs


def test_tp2_greedy_matches_hf_with_preemption_and_prefix_hits(model_dir: Path, hf_greedy) -> None:
    # 32 blocks x 4 tokens: the mixed batch (~236 tokens) must preempt; the prefix prompts then hit the cache.
    llm = LLM(str(model_dir), device="cpu", block_size=4, num_gpu_blocks=32, tensor_parallel_size=2)
    try:
        assert llm.engine.model.config.num_kv_heads == 1  # 2 KV heads over 2 ranks
        mixed = _run(llm, MIXED)
        assert llm.engine.scheduler.num_preemptions["recompute"] > 0
        first = _run(llm, [PREFIX_A])
        later = _run(llm, [PREFIX_B, PREFIX])
        assert llm.engine.followers_alive()
    finally:
        llm.engine.close()
    prompts = [*MIXED, PREFIX_A, PREFIX_B, PREFIX]
    for i, (out, want) in enumerate(zip(mixed + first + later, hf_greedy(model_dir, prompts, N), strict=True)):
        assert out.token_ids == want, f"prompt {i}: first wrong token at " + str(
            next(j for j, (a, b) in enumerate(zip(out.token_ids, want, strict=False)) if a != b)
        )
    assert [o.num_cached_tokens for o in later] == [32, 32]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tp2_swap_preemption_matches_hf(arch: str, request: pytest.FixtureRequest, hf_greedy) -> None:
    """Every preemption a swap (the host space holds every victim): each rank swaps its heads of the same blocks."""
    model_dir = request.getfixturevalue(f"tiny_{arch}_dir")
    llm = LLM(str(model_dir), device="cpu", block_size=4, num_gpu_blocks=16, preemption_mode="swap",
              swap_space=0.01, tensor_parallel_size=2)  # fmt: skip
    try:
        outs = _run(llm, MIXED)
        counts = llm.engine.scheduler.num_preemptions
    finally:
        llm.engine.close()
    assert counts["swap"] > 0 and counts["recompute"] == 0
    assert [o.token_ids for o in outs] == hf_greedy(model_dir, MIXED, N)


def _steps(engine, rid: str, tokens: list[int], until: int | None = None) -> None:
    """Step ``engine`` until request ``rid`` has ``until`` tokens (None: until it finishes)."""
    for _ in range(500):
        if until is not None and len(tokens) >= until:
            return
        outs = engine.step()
        tokens.extend(t for o in outs if o.request_id == rid for t in o.new_token_ids)
        if any(o.request_id == rid and o.finished for o in outs):
            return
    raise AssertionError("request did not progress")


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_migration_between_tp2_and_tp1(arch: str, request: pytest.FixtureRequest, hf_greedy) -> None:
    """A request's KV (all heads, gathered from / scattered to the ranks) moves TP=2 -> TP=1 -> TP=2 mid-stream;
    every token is HF's, so the moved blocks hold exactly what recomputing them would."""
    from kvserve.workers.core.request import WorkerRequest

    model_dir = request.getfixturevalue(f"tiny_{arch}_dir")
    prompt = MIXED[4]  # 40 tokens: three 16-token blocks
    one = LLM(str(model_dir), device="cpu", num_gpu_blocks=64).engine
    group = LLM(str(model_dir), device="cpu", num_gpu_blocks=64, tensor_parallel_size=2).engine
    tokens: list[int] = []
    try:
        group.add_request(WorkerRequest("r", prompt, GREEDY))
        _steps(group, "r", tokens, until=6)
        for src, dst, until in ((group, one, 14), (one, group, None)):
            state = src.export_request("r")
            assert state is not None and state.num_computed_tokens >= len(prompt)
            assert state.kv_blocks is not None and state.kv_blocks[0].shape[3] == 2  # all the model's KV heads
            assert dst.import_request(state)
            assert src.finish_export("r", migrated=True)
            _steps(dst, "r", tokens, until=until)
        group.check_integrity()
        one.check_integrity()
    finally:
        group.close()
    assert tokens == hf_greedy(model_dir, [prompt], N)[0]


def test_tp4_replicated_kv_heads_match_hf_and_migrate(tiny_qwen3_dir: Path, hf_greedy) -> None:
    """4 ranks over 2 KV heads: each KV head lives on two ranks (rank r reads head r*2//4). Tokens are HF's;
    a request moves to TP=1 with each head once (the gather keeps one copy of a replicated head)."""
    from kvserve.workers.core.request import WorkerRequest

    prompts = MIXED[:3]
    group = LLM(str(tiny_qwen3_dir), device="cpu", num_gpu_blocks=64, tensor_parallel_size=4)
    one = LLM(str(tiny_qwen3_dir), device="cpu", num_gpu_blocks=64).engine
    tokens: list[int] = []
    try:
        assert group.engine.model.config.num_kv_heads == 1 and group.engine.model.plan.first_kv_head == 0
        outs = _run(group, prompts)
        group.engine.add_request(WorkerRequest("r", MIXED[4], GREEDY))
        _steps(group.engine, "r", tokens, until=6)
        state = group.engine.export_request("r")
        assert state is not None and state.kv_blocks is not None and state.kv_blocks[0].shape[3] == 2
        assert one.import_request(state)
        assert group.engine.finish_export("r", migrated=True)
        _steps(one, "r", tokens)
    finally:
        group.engine.close()
    want = hf_greedy(tiny_qwen3_dir, [*prompts, MIXED[4]], N)
    assert [o.token_ids for o in outs] == want[:3]
    assert tokens == want[3]


def test_int8_kv_migration_between_tp2_and_tp1(tiny_llama_dir: Path) -> None:
    """int8 caches move their per-token scales with the blocks: the migrated stream equals one that never moved."""
    from kvserve.workers.core.request import WorkerRequest

    prompt = MIXED[4]
    kw = dict(device="cpu", num_gpu_blocks=64, kv_cache_dtype="int8")
    want = LLM(str(tiny_llama_dir), **kw).generate([prompt], GREEDY)[0].token_ids
    one = LLM(str(tiny_llama_dir), **kw).engine
    group = LLM(str(tiny_llama_dir), tensor_parallel_size=2, **kw).engine
    tokens: list[int] = []
    try:
        group.add_request(WorkerRequest("r", prompt, GREEDY))
        _steps(group, "r", tokens, until=6)
        for src, dst, until in ((group, one, 14), (one, group, None)):
            state = src.export_request("r")
            assert state is not None and state.kv_scales is not None
            assert dst.import_request(state)
            assert src.finish_export("r", migrated=True)
            _steps(dst, "r", tokens, until=until)
    finally:
        group.close()
    assert tokens == want


def test_tp2_logprobs_within_1e4_of_tp1(tiny_qwen2_dir: Path) -> None:
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=5)
    prompts = MIXED[:4]
    one = _run(LLM(str(tiny_qwen2_dir), device="cpu", num_gpu_blocks=64), prompts, params)
    llm = LLM(str(tiny_qwen2_dir), device="cpu", num_gpu_blocks=64, tensor_parallel_size=2)
    try:
        two = _run(llm, prompts, params)
    finally:
        llm.engine.close()
    worst = 0.0
    for a, b in zip(one, two, strict=True):
        assert a.token_ids == b.token_ids
        assert a.logprobs is not None and b.logprobs is not None
        for ea, eb in zip(a.logprobs, b.logprobs, strict=True):
            assert set(ea) == set(eb)
            worst = max(worst, *(abs(ea[t] - eb[t]) for t in ea))
    assert worst <= 1e-4, worst


def _weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every tensor the model holds (parameters and buffers, packed or not)."""
    tensors = itertools.chain(model.parameters(), model.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("size", ["tiny", "small"])
@pytest.mark.parametrize("tied", [True, False])
def test_weights_per_rank_about_half(tmp_path: Path, size: str, tied: bool) -> None:
    """Loading a shard allocates only the rank's slices (the group is not needed to load)."""
    init_random(tmp_path, arch="llama", size=size, seed=0)
    if tied:  # the LM head is the embedding (as SmolLM2's): the checkpoint's lm_head.weight goes unread
        config = json.loads((tmp_path / "config.json").read_text())
        (tmp_path / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    full = _weight_bytes(load_model(tmp_path))
    ranks = [_weight_bytes(load_shard(tmp_path, r, 2)) for r in range(2)]
    assert max(ranks) <= 0.55 * full, (ranks, full)


def test_smollm2_tp2_refused_tp3_matches_hf(smollm2_dir: Path, hf_greedy) -> None:
    """SmolLM2-135M has 9 attention heads and 3 KV heads: 2 ranks cannot split them (refused, with the
    reason); 3 ranks can (one KV head each) and give HF's tokens."""
    with pytest.raises(ValueError, match="9 attention heads"):
        load_shard(smollm2_dir, 0, 2)
    prompts = [rand_ids(20, 1), rand_ids(7, 2)]
    llm = LLM(str(smollm2_dir), device="cpu", num_gpu_blocks=64, tensor_parallel_size=3)
    try:
        outs = _run(llm, prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    finally:
        llm.engine.close()
    assert [o.token_ids for o in outs] == hf_greedy(smollm2_dir, prompts, 16)
