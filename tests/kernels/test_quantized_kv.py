"""Quantized KV caches on the torch backend (fp8 and int8): the store quantizes as documented,
attention equals dequantize-then-reference, block moves are bit-exact, pool sizing counts the
smaller element (and int8's scales), swap and migration carry the scales, checkpoint fp8 scales apply."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvserve.kernels import reference
from kvserve.workers.core.request import WorkerRequest
from kvserve.workers.core.sampling_params import SamplingParams
from kvserve.workers.engine.config import EngineConfig
from kvserve.workers.engine.engine import LLM, LLMEngine
from kvserve.workers.engine.kv_cache import bytes_per_block

FP8 = torch.float8_e4m3fn
DTYPES = {"fp8": FP8, "int8": torch.int8, "fp16": torch.float16, "bf16": torch.bfloat16}


def _pool(dtype: torch.dtype, num_blocks: int = 16, block_size: int = 4, kv_heads: int = 2, head_dim: int = 32):
    cache = torch.zeros(2, num_blocks, block_size, kv_heads, head_dim, dtype=dtype)
    scales = torch.zeros(2, num_blocks, block_size, kv_heads) if dtype == torch.int8 else None
    return cache, scales


def test_fp8_store_saturates_instead_of_nan() -> None:
    cache, _ = _pool(FP8)
    key = torch.full((2, 2, 32), 1e4)
    reference.store_kv(key, -key, cache, torch.tensor([0, 5]))
    assert cache.float()[0].view(-1, 2, 32)[[0, 5]].eq(448.0).all()
    assert cache.float()[1].view(-1, 2, 32)[[0, 5]].eq(-448.0).all()
    assert not cache.float().isnan().any()


def test_fp8_fast_decode_equals_torch_cast_on_every_byte() -> None:
    raw = torch.arange(256, dtype=torch.uint8)
    expected = raw.view(FP8).float()
    finite = ~expected.isnan()
    assert torch.equal(reference.fp8_to_float(raw)[finite], expected[finite])


def test_int8_store_quantizes_per_token_and_head() -> None:
    g = torch.Generator().manual_seed(0)
    cache, scales = _pool(torch.int8)
    key = torch.randn(3, 2, 32, generator=g) * torch.tensor([0.01, 30.0]).view(1, 2, 1)  # heads of very different range
    value = torch.randn(3, 2, 32, generator=g)
    value[1, 0] = 0.0  # an all-zero row
    slots = torch.tensor([6, -1, 9])
    reference.store_kv(key, value, cache, slots, kv_scales=scales)
    flat, flat_scales = cache.view(2, -1, 2, 32), scales.view(2, -1, 2)
    for i, x in enumerate((key, value)):
        stored, s = flat[i][[6, 9]], flat_scales[i][[6, 9]]
        amax = x[[0, 2]].abs().amax(-1)
        torch.testing.assert_close(s, amax / 127)
        assert stored.abs().amax(-1).eq(127).all()  # the row's largest value uses the full range
        err = (stored.float() * s.unsqueeze(-1) - x[[0, 2]]).abs()
        assert (err <= s.unsqueeze(-1) / 2 * (1 + 1e-5)).all()
    assert not cache.view(2, -1, 2, 32)[:, [0, 1, 2, 3, 4, 5, 7, 8]].any()  # skipped slot wrote nothing
    reference.store_kv(value[1:2], value[1:2], cache, torch.tensor([3]), kv_scales=scales)
    assert flat_scales[:, 3, 0].eq(0).all() and not flat[:, 3, 0].any()


def test_kv_scales_are_required_exactly_for_int8() -> None:
    k = torch.randn(1, 2, 32)
    int8, scales = _pool(torch.int8)
    with pytest.raises(ValueError, match="needs kv_scales"):
        reference.store_kv(k, k, int8, torch.tensor([0]))
    with pytest.raises(ValueError, match="only for an int8"):
        reference.store_kv(k, k, _pool(FP8)[0], torch.tensor([0]), kv_scales=scales)
    with pytest.raises(ValueError, match="must be float32"):
        reference.store_kv(k, k, int8, torch.tensor([0]), kv_scales=scales[:, :4])


@pytest.mark.parametrize("kind", ["fp8", "int8", "bf16"])
@pytest.mark.parametrize("window", [None, 6])
def test_attention_equals_dequantize_then_reference(kind: str, window: int | None) -> None:
    g = torch.Generator().manual_seed(0)
    cache, scales = _pool(DTYPES[kind], num_blocks=24)
    lens = [5, 13, 22]
    tables = torch.randperm(24, generator=g)[:18].view(3, 6).int()
    slots = torch.cat([tables[s].long().repeat_interleave(4)[:n] * 4 + torch.arange(n) % 4 for s, n in enumerate(lens)])
    reference.store_kv(torch.randn(len(slots), 2, 32, generator=g), torch.randn(len(slots), 2, 32, generator=g),
                       cache, slots, kv_scales=scales)  # fmt: skip
    dequantized = reference.dequantize_cache(cache, scales)
    ctx = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(3, 8, 32, generator=g)
    got = reference.decode_attention(q, cache, tables, ctx, 0.3, window, kv_scales=scales)
    torch.testing.assert_close(got, reference.decode_attention(q, dequantized, tables, ctx, 0.3, window))
    cu = torch.tensor([0, 5, 9, 15], dtype=torch.int32)  # chunks of 5, 4 and 6 new tokens
    q = torch.randn(15, 8, 32, generator=g)
    got = reference.prefill_attention(q, cache, tables, cu, ctx, 0.3, window, kv_scales=scales)
    torch.testing.assert_close(got, reference.prefill_attention(q, dequantized, tables, cu, ctx, 0.3, window))


@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_block_moves_are_bit_exact(kind: str) -> None:
    src, _ = _pool(DTYPES[kind])
    src.view(torch.uint8).copy_(torch.randint(0, 255, src.shape, dtype=torch.uint8))
    host, _ = _pool(DTYPES[kind], num_blocks=8)
    reference.swap_blocks(src, host, torch.tensor([3, 9, 1]), torch.tensor([0, 7, 2]))
    back, _ = _pool(DTYPES[kind])
    reference.swap_blocks(host, back, torch.tensor([0, 7, 2]), torch.tensor([3, 9, 1]))
    assert torch.equal(back.view(torch.uint8)[:, [3, 9, 1]], src.view(torch.uint8)[:, [3, 9, 1]])
    reference.copy_blocks(src, torch.tensor([3]), torch.tensor([4]))
    assert torch.equal(src.view(torch.uint8)[:, 4], src.view(torch.uint8)[:, 3])


def test_pool_sizing_counts_the_element_and_the_scales(tiny_llama_dir: Path) -> None:
    fp32 = LLMEngine(EngineConfig(str(tiny_llama_dir), kv_cache_memory="4MiB"))
    fp8 = LLMEngine(EngineConfig(str(tiny_llama_dir), kv_cache_memory="4MiB", kv_cache_dtype="fp8"))
    int8 = LLMEngine(EngineConfig(str(tiny_llama_dir), kv_cache_memory="4MiB", kv_cache_dtype="int8"))
    bf16 = LLMEngine(EngineConfig(str(tiny_llama_dir), kv_cache_memory="4MiB", kv_cache_dtype="bf16"))
    assert fp8.pool.num_blocks == 4 * fp32.pool.num_blocks == 2 * bf16.pool.num_blocks
    assert fp8.kv_cache.layers[0].dtype == FP8 and fp8.kv_cache.scales is None
    mc = int8.model_config  # tiny: 4 layers, 2 KV heads, head_dim 32, block 16
    per_block = 2 * mc.num_layers * 16 * mc.num_kv_heads * (mc.head_dim * 1 + 4)
    assert bytes_per_block(mc, 16, torch.int8) == per_block
    assert int8.pool.num_blocks == 4 * 2**20 // per_block
    assert int8.kv_cache.scales is not None and int8.kv_cache.scales[0].shape == (2, int8.pool.num_blocks, 16, 2)


@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_swap_and_migration_keep_tokens(tiny_llama_dir: Path, kind: str) -> None:
    """Quantization may change tokens vs fp32; moving quantized KV (swap, migration) must not."""
    model = str(tiny_llama_dir)
    prompts = [list(range(10, 30)), list(range(40, 47)), list(range(50, 66))]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    expected = [o.token_ids for o in LLM(model, block_size=4, num_gpu_blocks=256, kv_cache_dtype=kind).generate(
        prompts, params)]  # fmt: skip
    tight = LLM(model, block_size=4, num_gpu_blocks=14, kv_cache_dtype=kind, preemption_mode="swap", swap_space=0.01)
    assert [o.token_ids for o in tight.generate(prompts, params, check_integrity=True)] == expected
    assert tight.engine.scheduler.num_preemptions["swap"] > 0
    a = LLMEngine(EngineConfig(model, block_size=4, num_gpu_blocks=64, kv_cache_dtype=kind, model_id="m"))
    b = LLMEngine(EngineConfig(model, block_size=4, num_gpu_blocks=64, kv_cache_dtype=kind, model_id="m"))
    a.add_request(WorkerRequest("r", prompts[0], params))
    tokens: list[int] = []
    for _ in range(5):
        tokens += [t for o in a.step() for t in o.new_token_ids]
    state = a.export_request("r")
    assert state is not None and state.kv_blocks is not None and state.kv_blocks[0].dtype == DTYPES[kind]
    assert (state.kv_scales is not None) == (kind == "int8")
    assert b.import_request(state)
    a.finish_export("r", migrated=True)
    while b.has_unfinished_requests():
        tokens += [t for o in b.step() for t in o.new_token_ids]
    assert tokens == expected[0]
    assert a.pool.stats().used == 0 and b.pool.stats().used == 0


def test_migration_between_kv_formats_is_refused_without_a_leak(tiny_llama_dir: Path) -> None:
    model = str(tiny_llama_dir)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    a = LLMEngine(EngineConfig(model, block_size=4, num_gpu_blocks=32, kv_cache_dtype="int8", model_id="m"))
    b = LLMEngine(EngineConfig(model, block_size=4, num_gpu_blocks=32, kv_cache_dtype="fp8", model_id="m"))
    a.add_request(WorkerRequest("r", list(range(10, 20)), params))
    a.step()
    state = a.export_request("r")
    assert state is not None
    with pytest.raises(ValueError, match="cannot go into"):
        b.import_request(state)
    assert b.pool.stats().used == 0 and not b.requests
    a.finish_export("r", migrated=False)  # it carries on where it was
    while a.has_unfinished_requests():
        a.step()
    assert a.pool.stats().used == 0


def test_checkpoint_fp8_scales_are_applied(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """``self_attn.k_scale``/``v_scale`` in the checkpoint: the fp8 cache holds k / k_scale, v / v_scale."""
    scaled = tmp_path / "scaled"
    shutil.copytree(tiny_llama_dir, scaled)
    weights = load_file(scaled / "model.safetensors")
    for i in range(4):
        weights[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(0.5)
        weights[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(0.25)
    save_file(weights, scaled / "model.safetensors")
    prompt = list(range(100, 113))
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    fp32 = LLM(str(tiny_llama_dir), block_size=4, num_gpu_blocks=8)
    fp8 = LLM(str(scaled), block_size=4, num_gpu_blocks=8, kv_cache_dtype="fp8")
    fp32.generate([prompt], params)
    fp8.generate([prompt], params)
    attn = fp8.engine.model.layers[0].self_attn
    assert (attn.k_scale, attn.v_scale) == (0.5, 0.25)
    # Same fresh pool, same allocation order: the same slots hold the prompt's K/V in both caches.
    k32, v32 = fp32.engine.kv_cache.layers[0].float()
    k8, v8 = fp8.engine.kv_cache.layers[0].view(torch.uint8)
    assert torch.equal(k8, (k32 / 0.5).clamp(-448, 448).to(FP8).view(torch.uint8))
    assert torch.equal(v8, (v32 / 0.25).clamp(-448, 448).to(FP8).view(torch.uint8))
    weights["model.layers.0.self_attn.k_scale"] = torch.tensor(0.0)
    save_file(weights, scaled / "model.safetensors")
    with pytest.raises(ValueError, match="positive finite"):
        LLM(str(scaled), num_gpu_blocks=8, kv_cache_dtype="fp8")


def test_fp8_fast_decode_on_a_large_vectorized_tensor() -> None:
    raw = torch.randint(0, 256, (1 << 16,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    expected = raw.view(FP8).float()
    finite = ~expected.isnan()
    assert torch.equal(reference.fp8_to_float(raw)[finite], expected[finite])


def test_int8_store_of_a_vanishing_row_is_zero_not_nan() -> None:
    cache, scales = _pool(torch.int8)
    x = torch.full((1, 2, 32), 1e-38)
    reference.store_kv(x, x, cache, torch.tensor([2]), kv_scales=scales)
    assert not reference.dequantize_cache(cache, scales).isnan().any()
    assert not cache.any()
