"""The Triton rope + KV store (``kernels.rope_store``) against ``reference.rope_store_kv``: the same bits in
q, k, v and the cache (fp32, fp16 under the interpreter), skipped slots untouched; fp8 and int8 caches
rotate here and store through ``cache_ops.store_kv``."""

from __future__ import annotations

import pytest
import torch

from kvserve.kernels import reference, rope_store

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _case(num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(num_tokens + head_dim)
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=g)
    angles = torch.rand(num_tokens, 1, head_dim // 2, generator=g) * 100
    emb = torch.cat((angles, angles), dim=-1)
    sin = emb.sin()
    signed_sin = torch.cat((-sin[..., : head_dim // 2], sin[..., head_dim // 2 :]), dim=-1)
    return qkv.to(DEVICE, dtype), emb.cos().to(DEVICE, dtype), signed_sin.to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(8, 2, 32), (9, 3, 64), (2, 1, 6)])
def test_matches_reference_bit_for_bit(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
    num_tokens, num_blocks, block_size = 13, 8, 4
    qkv, cos, signed_sin = _case(num_tokens, num_heads, num_kv_heads, head_dim, dtype)
    slots = torch.randperm(num_blocks * block_size, generator=torch.Generator().manual_seed(3))[:num_tokens]
    slots[::5] = -1  # skipped (already cached) tokens
    slots = slots.to(DEVICE)
    want_cache = torch.zeros(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=DEVICE)
    got_cache = want_cache.clone()
    want = reference.rope_store_kv(qkv.clone(), cos, signed_sin, want_cache, slots, num_heads, num_kv_heads)
    got_qkv = qkv.clone()
    got = rope_store.rope_store_kv(got_qkv, cos, signed_sin, got_cache, slots, num_heads, num_kv_heads)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(got_cache, want_cache)
    assert got[0].data_ptr() == got_qkv.data_ptr()  # rotated in place: views of qkv
    written = got_cache.view(2, num_blocks * block_size, -1).abs().sum(-1) != 0
    assert int(written[0].sum()) == int(written[1].sum()) == int((slots >= 0).sum())


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.int8])
def test_quantized_caches_store_through_store_kv(cache_dtype: torch.dtype) -> None:
    num_tokens, num_heads, num_kv_heads, head_dim = 6, 4, 2, 32
    qkv, cos, signed_sin = _case(num_tokens, num_heads, num_kv_heads, head_dim, torch.float32)
    slots = torch.arange(num_tokens, device=DEVICE)
    shape = (2, 4, 4, num_kv_heads, head_dim)
    want_cache = torch.zeros(shape, device=DEVICE).to(cache_dtype)
    got_cache = want_cache.clone()
    scales = (torch.zeros(shape[:4], device=DEVICE), torch.zeros(shape[:4], device=DEVICE))
    if cache_dtype != torch.int8:
        scales = (None, None)
    want = reference.rope_store_kv(qkv.clone(), cos, signed_sin, want_cache, slots, num_heads, num_kv_heads,
                                   kv_scales=scales[0])  # fmt: skip
    got = rope_store.rope_store_kv(qkv.clone(), cos, signed_sin, got_cache, slots, num_heads, num_kv_heads,
                                   kv_scales=scales[1])  # fmt: skip
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(got_cache.view(torch.uint8), want_cache.view(torch.uint8))
    if cache_dtype == torch.int8:
        assert torch.equal(scales[0], scales[1])


def test_refuses_bad_shapes() -> None:
    qkv, cos, signed_sin = _case(3, 2, 1, 8, torch.float32)
    cache = torch.zeros(2, 2, 2, 1, 8, device=DEVICE)
    with pytest.raises(ValueError, match="qkv must be"):
        rope_store.rope_store_kv(qkv[:, :-8], cos, signed_sin, cache, torch.arange(3, device=DEVICE), 2, 1)
    with pytest.raises(ValueError, match="cos must be"):
        rope_store.rope_store_kv(qkv, cos[:2], signed_sin, cache, torch.arange(3, device=DEVICE), 2, 1)
