"""Triton rotary embedding fused with the KV store: one launch rotates q and k in place in the qkv GEMM
output and writes k and v into their cache slots (the torch rope was five launches a layer on CUDA).

Same contract as ``reference.rope_store_kv`` (HF's neox rotation ``x * cos + rotate_half(x) * sin`` with
each product and the sum rounded to the dtype, as torch's ops round; fp32 bit-identical to the reference).

    ``_rope_store_kv_kernel``  grid (token, head tile) over the ``num_heads + num_kv_heads`` heads of q and k:
                               rotate each head row in place; a K head's program also stores the rotated
                               K row and its V row into the token's slot (float caches; ``STORE``).

fp8 and int8 caches (saturating or quantizing stores, with scales) rotate here and store through
``cache_ops.store_kv``: two launches.

NOTE: launched with FMA contraction off: ``x * cos + xr * sin`` must round each product, as torch does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.kernels import cache_ops

_FLOAT = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _rope_store_kv_kernel(
    qkv_ptr,  # [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim], rows of stride stride_qkv
    cos_ptr,  # [num_tokens, head_dim]
    sin_ptr,  # [num_tokens, head_dim], sin with its first half negated
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # same
    slot_ptr,  # [num_tokens], negative = do not store
    stride_qkv,
    stride_cos,
    stride_sin,
    stride_c_block,
    stride_c_slot,
    stride_c_head,
    num_heads,
    num_kv_heads,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    STORE: tl.constexpr,
):
    """One program = one token x BLOCK_H of its q|k heads. Each program reads its head rows whole before it
    writes them, so the in-place rotation never reads a rotated value. Contract: ``0 <= slot <
    num_blocks * block_size`` for every non-negative slot (not checked on device)."""
    tok = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = offs_d < HEAD_DIM
    mask = (offs_h < num_heads + num_kv_heads)[:, None] & d_mask[None, :]
    row = qkv_ptr + tok * stride_qkv + offs_h.to(tl.int64)[:, None] * HEAD_DIM
    x = tl.load(row + offs_d[None, :], mask=mask, other=0.0)
    # rotate_half(x) * sin == roll(x, half) * signed_sin
    xr = tl.load(row + ((offs_d + HEAD_DIM // 2) % HEAD_DIM)[None, :], mask=mask, other=0.0)
    cos = tl.load(cos_ptr + tok * stride_cos + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + tok * stride_sin + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    dtype = x.dtype
    a = (x.to(tl.float32) * cos[None, :]).to(dtype)
    b = (xr.to(tl.float32) * sin[None, :]).to(dtype)
    y = (a.to(tl.float32) + b.to(tl.float32)).to(dtype)
    tl.store(row + offs_d[None, :], y, mask=mask)
    if STORE:
        slot = tl.load(slot_ptr + tok).to(tl.int64)
        if slot >= 0:
            kv_mask = mask & (offs_h >= num_heads)[:, None]
            kv_head = tl.where(offs_h >= num_heads, offs_h - num_heads, 0).to(tl.int64)
            dst = (
                (slot // BLOCK_SIZE) * stride_c_block
                + (slot % BLOCK_SIZE) * stride_c_slot
                + kv_head[:, None] * stride_c_head
                + offs_d[None, :]
            )
            cache_ty = k_cache_ptr.dtype.element_ty
            tl.store(k_cache_ptr + dst, y.to(cache_ty), mask=kv_mask)
            # V head j sits num_kv_heads heads after K head j in the row.
            v = tl.load(row + num_kv_heads * HEAD_DIM + offs_d[None, :], mask=kv_mask, other=0.0)
            tl.store(v_cache_ptr + dst, v.to(cache_ty), mask=kv_mask)


def rope_store_kv(
    qkv: torch.Tensor,  # [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim]: q | k | v
    cos: torch.Tensor,  # [num_tokens, 1, head_dim]
    signed_sin: torch.Tensor,  # [num_tokens, 1, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int32/int64, negative = skip
    num_heads: int,
    num_kv_heads: int,
    kv_scales: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # q [T, H, D], k and v [T, KVH, D]: views of qkv
    """``reference.rope_store_kv``: ``qkv`` is rotated in place (callers must not read it afterwards).

    Raises:
        ValueError: shapes that disagree, a non-float ``qkv``, a strided ``qkv`` row, or what
            ``cache_ops.store_kv`` refuses.
    """
    name = "rope_store_kv"
    cache_ops._check_cache(name, kv_cache)  # noqa: SLF001 (the package's own cache check)
    if not cache_ops._triton_runs_on(qkv.device):  # noqa: SLF001
        raise ValueError(f"{name}: qkv is on {qkv.device}: Triton needs CUDA (or TRITON_INTERPRET=1 on CPU)")
    num_tokens, head_dim = qkv.shape[0], kv_cache.shape[-1]
    width = (num_heads + 2 * num_kv_heads) * head_dim
    if qkv.dim() != 2 or qkv.shape[1] != width or qkv.stride(1) != 1 or qkv.dtype not in _FLOAT:
        raise ValueError(
            f"{name}: qkv must be a float [num_tokens, {width}] with a contiguous last dim, got {qkv.dtype} "
            f"{tuple(qkv.shape)} (strides {qkv.stride()})"
        )
    if kv_cache.shape[3] != num_kv_heads or head_dim % 2:
        raise ValueError(f"{name}: kv_cache {tuple(kv_cache.shape)} does not hold {num_kv_heads} even-sized heads")
    for t, what in ((cos, "cos"), (signed_sin, "signed_sin")):
        if t.shape != (num_tokens, 1, head_dim) or t.stride(-1) != 1 or t.dtype != qkv.dtype:
            raise ValueError(f"{name}: {what} must be {qkv.dtype} [{num_tokens}, 1, {head_dim}], got "
                             f"{t.dtype} {tuple(t.shape)}")  # fmt: skip
    q_and_k = (num_heads + num_kv_heads) * head_dim
    q = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : q_and_k].view(num_tokens, num_kv_heads, head_dim)
    v = qkv[:, q_and_k:].view(num_tokens, num_kv_heads, head_dim)
    fused_store = kv_cache.dtype in _FLOAT
    if fused_store:
        cache_ops.check_kv_quantization(name, kv_cache, kv_scales)
        if slot_mapping.shape != (num_tokens,) or slot_mapping.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name}: slot_mapping must be int32/int64 [{num_tokens}], got {slot_mapping.dtype} "
                             f"{tuple(slot_mapping.shape)}")  # fmt: skip
    if num_tokens:
        heads = num_heads + num_kv_heads
        head_dim_pad = triton.next_power_of_2(head_dim)
        block_h = min(triton.next_power_of_2(heads), max(1, 4096 // head_dim_pad))
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        _rope_store_kv_kernel[(num_tokens, triton.cdiv(heads, block_h))](
            qkv, cos, signed_sin, k_cache, v_cache, slot_mapping.contiguous(), qkv.stride(0), cos.stride(0),
            signed_sin.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), num_heads, num_kv_heads,
            BLOCK_SIZE=kv_cache.shape[2], HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, BLOCK_H=block_h,
            STORE=fused_store, num_warps=4, enable_fp_fusion=False,
        )  # fmt: skip
    if not fused_store:
        cache_ops.store_kv(k, v, kv_cache, slot_mapping, kv_scales=kv_scales)
    return q, k, v
