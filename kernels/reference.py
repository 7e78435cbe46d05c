"""Plain-torch paged-attention and cache ops: the CPU backend and the Triton kernels' reference.

KV cache layout (fixed by DESIGN.md), one tensor per layer:
    kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim]   (0 = K, 1 = V)
Token ``t`` of a sequence lives in slot ``block_table[t // block_size] * block_size + t % block_size``.
A negative slot in ``slot_mapping`` means "do not store" (padding, or a token already cached).

Every function here has the same signature as its Triton twin in ``kernels.attention`` /
``kernels.cache_ops``; ``kernels.get_backend()`` picks one.
"""

from __future__ import annotations

import torch


def store_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, negative = skip
) -> None:
    """Write each token's K and V into its slot of the paged cache (in place)."""
    num_blocks, block_size = kv_cache.shape[1], kv_cache.shape[2]
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    flat = kv_cache.view(2, num_blocks * block_size, *kv_cache.shape[3:])
    flat[0].index_copy_(0, slot_mapping, key.to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, value.to(kv_cache.dtype))


def _window_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
    """Boolean mask [..., q, k]: True where query position may attend to key position."""
    allowed = k_pos <= q_pos
    if sliding_window is not None:
        # NOTE: same convention as HF Mistral: a query sees the last `sliding_window` tokens, itself included.
        allowed = allowed & (k_pos > q_pos - sliding_window)
    return allowed


def decode_attention(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32, padded with any valid id
    context_lens: torch.Tensor,  # [num_seqs] int32, tokens in cache incl. the query's own
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    """One query token per sequence attending to its whole cached context."""
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = num_heads // num_kv_heads
    max_len = int(context_lens.max()) if num_seqs else 0
    blocks = block_tables[:, : (max_len + block_size - 1) // block_size].long()
    # [num_seqs, ctx, num_kv_heads, head_dim]
    keys = kv_cache[0][blocks].flatten(1, 2)[:, :max_len].to(query.dtype)
    values = kv_cache[1][blocks].flatten(1, 2)[:, :max_len].to(query.dtype)
    q = query.view(num_seqs, num_kv_heads, group, head_dim)
    scores = torch.einsum("skgd,stkd->skgt", q, keys) * scale  # [num_seqs, kv_heads, group, ctx]
    k_pos = torch.arange(max_len, device=query.device)
    q_pos = (context_lens.long() - 1)[:, None]
    allowed = _window_mask(q_pos, k_pos[None, :], sliding_window)  # [num_seqs, ctx]
    scores = scores.masked_fill(~allowed[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(query.dtype)
    out = torch.einsum("skgt,stkd->skgd", probs, values)
    return out.reshape(num_seqs, num_heads, head_dim)


def prefill_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1] int32, query chunk boundaries
    context_lens: torch.Tensor,  # [num_seqs] int32, cached prefix + this chunk (all already stored)
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Variable-length query chunks attending causally to their cached prefix and to themselves.

    Sequence ``s`` owns queries ``cu_seqlens_q[s]:cu_seqlens_q[s+1]``; they sit at the last
    ``q_len`` positions of its ``context_lens[s]`` tokens, whose K/V are all in the cache already.
    """
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    starts = cu_seqlens_q.tolist()
    lens = context_lens.tolist()
    # NOTE: one iteration per sequence (not per token); each is a single batched SDPA call.
    for s, ctx in enumerate(lens):
        q0, q1 = starts[s], starts[s + 1]
        q_len = q1 - q0
        if q_len == 0:
            continue
        blocks = block_tables[s, : (ctx + block_size - 1) // block_size].long()
        keys = kv_cache[0][blocks].flatten(0, 1)[:ctx].to(query.dtype)  # [ctx, kv_heads, head_dim]
        values = kv_cache[1][blocks].flatten(0, 1)[:ctx].to(query.dtype)
        q_pos = torch.arange(ctx - q_len, ctx, device=query.device)[:, None]
        k_pos = torch.arange(ctx, device=query.device)[None, :]
        mask = _window_mask(q_pos, k_pos, sliding_window)  # [q_len, ctx]
        q = query[q0:q1].transpose(0, 1)  # [num_heads, q_len, head_dim]
        k = keys.transpose(0, 1).repeat_interleave(group, dim=0)  # [num_heads, ctx, head_dim]
        v = values.transpose(0, 1).repeat_interleave(group, dim=0)
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        out[q0:q1] = o.transpose(0, 1)
    return out


def copy_blocks(
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    src: torch.Tensor,  # [n] int64 block ids
    dst: torch.Tensor,  # [n] int64 block ids
) -> None:
    """Copy whole blocks inside one cache (copy-on-write)."""
    kv_cache[:, dst.long()] = kv_cache[:, src.long()]


def swap_blocks(
    src_cache: torch.Tensor,  # [2, num_src_blocks, block_size, num_kv_heads, head_dim]
    dst_cache: torch.Tensor,  # [2, num_dst_blocks, block_size, num_kv_heads, head_dim]
    src_ids: torch.Tensor,  # [n] int64 block ids in src_cache
    dst_ids: torch.Tensor,  # [n] int64 block ids in dst_cache
) -> None:
    """Move blocks between two caches (device pool <-> host swap space); bit-exact."""
    src_ids = src_ids.to(src_cache.device).long()
    gathered = src_cache[:, src_ids]
    dst_cache[:, dst_ids.to(dst_cache.device).long()] = gathered.to(dst_cache.device, non_blocking=True)
