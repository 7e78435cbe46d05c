"""fp8 KV cache on the torch backend: store saturates, attention equals dequantize-then-reference,
block moves are bit-exact, the pool holds 4x the fp32 blocks, swap and migration keep tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kernels import reference
from workers.config import EngineConfig
from workers.engine import LLM, LLMEngine
from workers.sampling_params import SamplingParams

FP8 = torch.float8_e4m3fn


def _pool(num_blocks: int = 16, block_size: int = 4, kv_heads: int = 2, head_dim: int = 32):
    return torch.zeros(2, num_blocks, block_size, kv_heads, head_dim, dtype=FP8)


def test_store_saturates_instead_of_nan() -> None:
    cache = _pool()
    key = torch.full((2, 2, 32), 1e4)
    reference.store_kv(key, -key, cache, torch.tensor([0, 5]))
    assert cache.float()[0].view(-1, 2, 32)[[0, 5]].eq(448.0).all()
    assert cache.float()[1].view(-1, 2, 32)[[0, 5]].eq(-448.0).all()
    assert not cache.float().isnan().any()


@pytest.mark.parametrize("window", [None, 6])
def test_attention_equals_dequantize_then_reference(window: int | None) -> None:
    g = torch.Generator().manual_seed(0)
    cache = _pool(num_blocks=24)
    lens = [5, 13, 22]
    tables = torch.randperm(24, generator=g)[:18].view(3, 6).int()
    slots = torch.cat([tables[s].long().repeat_interleave(4)[:n] * 4 + torch.arange(n) % 4 for s, n in enumerate(lens)])
    reference.store_kv(torch.randn(len(slots), 2, 32, generator=g), torch.randn(len(slots), 2, 32, generator=g),
                       cache, slots)  # fmt: skip
    dequantized = cache.float()
    ctx = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(3, 8, 32, generator=g)
    got = reference.decode_attention(q, cache, tables, ctx, 0.3, window)
    torch.testing.assert_close(got, reference.decode_attention(q, dequantized, tables, ctx, 0.3, window))
    cu = torch.tensor([0, 5, 9, 15], dtype=torch.int32)  # chunks of 5, 4 and 6 new tokens
    q = torch.randn(15, 8, 32, generator=g)
    got = reference.prefill_attention(q, cache, tables, cu, ctx, 0.3, window)
    torch.testing.assert_close(got, reference.prefill_attention(q, dequantized, tables, cu, ctx, 0.3, window))


def test_block_moves_are_bit_exact() -> None:
    src = _pool()
    src.view(torch.uint8).copy_(torch.randint(0, 255, src.shape, dtype=torch.uint8))
    host = _pool(num_blocks=8)
    reference.swap_blocks(src, host, torch.tensor([3, 9, 1]), torch.tensor([0, 7, 2]))
    back = _pool()
    reference.swap_blocks(host, back, torch.tensor([0, 7, 2]), torch.tensor([3, 9, 1]))
    assert torch.equal(back.view(torch.uint8)[:, [3, 9, 1]], src.view(torch.uint8)[:, [3, 9, 1]])
    reference.copy_blocks(src, torch.tensor([3]), torch.tensor([4]))
    assert torch.equal(src.view(torch.uint8)[:, 4], src.view(torch.uint8)[:, 3])


def test_pool_holds_four_times_the_fp32_blocks(tiny_llama_dir: Path) -> None:
    fp32 = LLMEngine(EngineConfig(str(tiny_llama_dir), kv_cache_memory="4MiB"))
    fp8 = LLMEngine(EngineConfig(str(tiny_llama_dir), kv_cache_memory="4MiB", kv_cache_dtype="fp8"))
    assert fp8.pool.num_blocks == 4 * fp32.pool.num_blocks
    assert fp8.kv_cache.layers[0].dtype == FP8


def test_fp8_swap_and_migration_keep_tokens(tiny_llama_dir: Path) -> None:
    """fp8 quantization may change tokens vs fp32; moving fp8 KV (swap, migration) must not."""
    model = str(tiny_llama_dir)
    prompts = [list(range(10, 30)), list(range(40, 47)), list(range(50, 66))]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    expected = [o.token_ids for o in LLM(model, block_size=4, num_gpu_blocks=256, kv_cache_dtype="fp8").generate(
        prompts, params)]  # fmt: skip
    tight = LLM(model, block_size=4, num_gpu_blocks=14, kv_cache_dtype="fp8", preemption_mode="swap", swap_space=0.01)
    assert [o.token_ids for o in tight.generate(prompts, params, check_integrity=True)] == expected
    assert tight.engine.scheduler.num_preemptions["swap"] > 0
    a = LLMEngine(EngineConfig(model, block_size=4, num_gpu_blocks=64, kv_cache_dtype="fp8", model_id="m"))
    b = LLMEngine(EngineConfig(model, block_size=4, num_gpu_blocks=64, kv_cache_dtype="fp8", model_id="m"))
    a.add_request("r", prompts[0], params)
    tokens: list[int] = []
    for _ in range(5):
        tokens += [t for o in a.step() for t in o.new_token_ids]
    state = a.export_request("r")
    assert state is not None and state.kv_blocks is not None and state.kv_blocks[0].dtype == FP8
    assert b.import_request(state)
    a.finish_export("r", migrated=True)
    while b.has_unfinished_requests():
        tokens += [t for o in b.step() for t in o.new_token_ids]
    assert tokens == expected[0]
    assert a.pool.stats().used == 0 and b.pool.stats().used == 0


def test_fp8_needs_the_torch_backend(tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSERVE_ATTENTION_BACKEND", "triton")
    with pytest.raises(ValueError, match="torch attention backend"):
        LLMEngine(EngineConfig(str(tiny_llama_dir), num_gpu_blocks=16, kv_cache_dtype="fp8"))
