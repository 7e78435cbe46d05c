"""The engine's greedy tokens equal HF transformers' token for token, whatever the paging does.

Random tiny Llama, Qwen2 and Qwen3 checkpoints (Qwen3: q/k norms, head_dim decoupled); a batch of
mixed-length prompts (15/16/17 straddle a 16-token block boundary, 1 and 3 are shorter than a block,
40 spans three blocks) under block sizes 1 and 16, recompute and swap preemption, chunked prefill and
prefix-cache hits (partial and full). Every run checks pool integrity after each step and ends with every
block released.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvserve.workers.core.request import WorkerRequest
from kvserve.workers.engine.engine import LLM, LLMEngine
from kvserve.workers.engine.outputs import CompletionOutput
from tests.model.workload import GREEDY, MIXED, PREFIX, PREFIX_A, PREFIX_B, N, rand_ids


@pytest.fixture(params=["llama", "qwen2", "qwen3"])
def model_dir(request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue(f"tiny_{request.param}_dir")


def _llm(model_dir: Path, **kwargs: object) -> LLM:
    return LLM(str(model_dir), device="cpu", **kwargs)


def _assert_idle(engine: LLMEngine) -> None:
    """Nothing left running and every block back in the pool (cached blocks count as free)."""
    assert not engine.has_unfinished_requests()
    assert engine.requests == {}
    assert engine.pool.stats().used == 0, engine.pool.stats()
    if engine.swap_pool is not None:
        assert engine.swap_pool.stats().used == 0, engine.swap_pool.stats()
    engine.check_integrity()


def _generate(llm: LLM, prompts: list[list[int]]) -> list[CompletionOutput]:
    outs = llm.generate(prompts, GREEDY, check_integrity=True)
    _assert_idle(llm.engine)
    return outs


def _assert_tokens(outs: list[CompletionOutput], prompts: list[list[int]], ref: list[list[int]]) -> None:
    for i, (out, prompt, want) in enumerate(zip(outs, prompts, ref, strict=True)):
        assert out.prompt_token_ids == prompt
        first_diff = next((j for j, (a, b) in enumerate(zip(out.token_ids, want, strict=False)) if a != b), None)
        assert out.token_ids == want, f"prompt {i} (len {len(prompt)}): first wrong token at {first_diff}"
        assert out.finish_reason == "length"


@pytest.mark.parametrize("block_size", [16, 1])
def test_greedy_matches_hf(model_dir: Path, hf_greedy, block_size: int) -> None:
    ref = hf_greedy(model_dir, MIXED, N)
    llm = _llm(model_dir, block_size=block_size, num_gpu_blocks=1024 // block_size)
    outs = _generate(llm, MIXED)
    _assert_tokens(outs, MIXED, ref)
    assert all(o.num_preemptions == 0 for o in outs)  # the pool is big enough: plain batching


def test_recompute_preemption_matches_hf(model_dir: Path, hf_greedy) -> None:
    ref = hf_greedy(model_dir, MIXED, N)
    # 16 blocks x 4 tokens: the longest request (40 + 24 tokens) just fits alone, so the batch
    # (~240 tokens) must preempt over and over.
    llm = _llm(model_dir, block_size=4, num_gpu_blocks=16)
    outs = _generate(llm, MIXED)
    _assert_tokens(outs, MIXED, ref)
    assert any(o.num_preemptions > 0 for o in outs)
    counts = llm.engine.scheduler.num_preemptions
    assert counts["recompute"] > 0 and counts["swap"] == 0


@pytest.mark.parametrize("gemm", ["kvserve", "onednn"])
def test_each_cpu_gemm_matches_hf(model_dir: Path, hf_greedy, gemm: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whichever projection GEMM the start-up timing picks on a machine (``kvserve/workers/models/cpu_gemm.py``),
    tokens are HF's: each forced in turn, with recompute preemption (replayed prompts take prefill rows)."""
    from kvserve.kernels import cpu_ext

    if gemm == "kvserve" and not cpu_ext.available():
        pytest.skip("the C++ kernels are not built here")
    monkeypatch.setenv("KVSERVE_CPU_GEMM", gemm)
    ref = hf_greedy(model_dir, MIXED, N)
    llm = _llm(model_dir, block_size=4, num_gpu_blocks=16)
    assert llm.engine.runner.model.gemm_choice.packing == gemm
    outs = _generate(llm, MIXED)
    _assert_tokens(outs, MIXED, ref)
    assert llm.engine.scheduler.num_preemptions["recompute"] > 0


def test_plain_torch_kernels_match_hf(model_dir: Path, hf_greedy, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fallback where the C++ CPU kernels are not built: the plain-torch reference, with preemption."""
    monkeypatch.setenv("KVSERVE_ATTENTION_BACKEND", "torch")
    ref = hf_greedy(model_dir, MIXED, N)
    llm = _llm(model_dir, block_size=4, num_gpu_blocks=16)
    outs = _generate(llm, MIXED)
    _assert_tokens(outs, MIXED, ref)
    assert llm.engine.scheduler.num_preemptions["recompute"] > 0


def test_swap_preemption_matches_hf(model_dir: Path, hf_greedy) -> None:
    ref = hf_greedy(model_dir, MIXED, N)
    llm = _llm(model_dir, block_size=4, num_gpu_blocks=16, preemption_mode="swap", swap_space=0.01)
    engine = llm.engine
    assert engine.swap_pool is not None
    swaps_seen: list[int] = []
    step = engine.step

    def spy_step():
        outs = step()
        swaps_seen.extend(o.num_swaps for o in outs)
        return outs

    engine.step = spy_step  # type: ignore[method-assign]
    outs = _generate(llm, MIXED)
    _assert_tokens(outs, MIXED, ref)
    counts = engine.scheduler.num_preemptions
    # The host space holds every victim, so each preemption is a swap, never a recompute.
    assert counts["swap"] > 0 and counts["recompute"] == 0
    assert max(swaps_seen) > 0  # the step outputs report it too
    assert engine.swap_pool.stats().used == 0


def test_chunked_prefill_matches_hf(model_dir: Path, hf_greedy) -> None:
    ref = hf_greedy(model_dir, MIXED, N)
    llm = _llm(model_dir, block_size=16, num_gpu_blocks=64, max_num_batched_tokens=8)
    scheduler = llm.engine.scheduler
    chunks: list[tuple[int, int, int]] = []  # (computed before, scheduled, num_tokens)
    schedule = scheduler.schedule

    def spy_schedule():
        out = schedule()
        chunks.extend((r.num_computed_tokens, n, r.num_tokens) for r, n in out.scheduled)
        assert out.num_batched_tokens <= 8
        return out

    scheduler.schedule = spy_schedule  # type: ignore[method-assign]
    outs = _generate(llm, MIXED)
    _assert_tokens(outs, MIXED, ref)
    # Some prefill stopped short of the sequence end (mid-prompt chunk), and some chunk resumed one.
    assert any(n > 1 and done + n < total for done, n, total in chunks)
    assert any(done > 0 and n > 1 for done, n, total in chunks)


@pytest.mark.parametrize("block_size", [16, 1])
def test_prefix_cache_hits_match_hf(model_dir: Path, hf_greedy, block_size: int) -> None:
    ref_a = hf_greedy(model_dir, [PREFIX_A], N)[0]
    # A follow-up turn: PREFIX_A (37 tokens) + 11 of its outputs = 48 tokens, 3 full blocks of 16.
    # Block 2 filled up during decode, so it is cached only if decode-filled blocks are hashed.
    follow = PREFIX_A + ref_a[:11] + rand_ids(5, 10)
    assert follow[48] != ref_a[11]
    prompts = [PREFIX_A, PREFIX_B, PREFIX, follow]
    ref = hf_greedy(model_dir, prompts, N)
    llm = _llm(model_dir, block_size=block_size, num_gpu_blocks=1024 // block_size)
    first = _generate(llm, [PREFIX_A])
    assert first[0].num_cached_tokens == 0
    # A second call: the first request's blocks are cached by now. PREFIX_B shares exactly the
    # 32-token PREFIX; PREFIX itself is a full hit (a multiple of the block size).
    later = _generate(llm, [PREFIX_B, PREFIX])
    last = _generate(llm, [follow])
    _assert_tokens(first + later + last, prompts, ref)
    assert [o.num_cached_tokens for o in later + last] == [32, 32, 48]
    assert llm.engine.scheduler.prefix_hits == 32 + 32 + 48


def test_full_prefix_hit_resubmitted(tiny_llama_dir: Path, hf_greedy) -> None:
    ref = hf_greedy(tiny_llama_dir, [PREFIX], N)
    llm = _llm(tiny_llama_dir, block_size=16, num_gpu_blocks=16)
    first = _generate(llm, [PREFIX])
    second = _generate(llm, [PREFIX])
    _assert_tokens(first + second, [PREFIX, PREFIX], ref + ref)
    assert (first[0].num_cached_tokens, second[0].num_cached_tokens) == (0, 32)


def test_full_prefix_hit_on_blocks_in_use(tiny_qwen2_dir: Path, hf_greedy) -> None:
    """A full hit on blocks another running request still holds: shared, never overwritten."""
    ref = hf_greedy(tiny_qwen2_dir, [PREFIX], N)[0]
    engine = _llm(tiny_qwen2_dir, block_size=16, num_gpu_blocks=16).engine
    tokens: dict[str, list[int]] = {"a": [], "b": []}
    cached: dict[str, int] = {}

    def step() -> None:
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
            cached[out.request_id] = out.num_cached_tokens
        engine.check_integrity()

    # Every KV write of a step must land in a block only the writing request holds.
    prepare = engine.runner.prepare_inputs

    def spy_prepare(batch):
        inputs = prepare(batch)
        slots = inputs[2].slot_mapping.tolist()
        written = {s // 16 for s in slots if s >= 0}
        assert all(engine.pool.ref_cnt[blk] == 1 for blk in written), (written, slots)
        return inputs

    engine.runner.prepare_inputs = spy_prepare  # type: ignore[method-assign]
    a = engine.add_request(WorkerRequest("a", PREFIX, GREEDY))
    step()  # a's prefill: its two full blocks are cached now, and still held by a
    shared = a.block_table[:2]
    kv_before = [layer[:, shared].clone() for layer in engine.kv_cache.layers]
    b = engine.add_request(WorkerRequest("b", PREFIX, GREEDY))
    step()  # b recomputes its last prompt token for logits, but must not rewrite a's block
    assert b.block_table[:2] == shared
    assert [engine.pool.ref_cnt[x] for x in shared] == [2, 2]
    for before, layer in zip(kv_before, engine.kv_cache.layers, strict=True):
        assert torch.equal(layer[:, shared], before)
    while engine.has_unfinished_requests():
        step()
    assert tokens == {"a": ref, "b": ref}
    assert cached == {"a": 0, "b": 32}
    _assert_idle(engine)
