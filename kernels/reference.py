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


def _gather_head_major(
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq]
    positions: torch.Tensor,  # [num_seqs, width] int64 token positions, each inside its sequence
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:  # 2 x [num_kv_heads, num_seqs, width, head_dim]
    """K and V of the given positions, laid out per KV head so attention runs as batched GEMMs.

    NOTE: one ``index_select`` of head_dim-sized rows per tensor: a row copy each (memcpy), where
    advanced indexing on the 5-D cache copies element by element; the per-head layout comes straight
    out of the gather instead of from a transpose copy afterwards.
    """
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    num_seqs, width = positions.shape
    slots = block_tables.long().gather(1, positions // block_size) * block_size + positions % block_size
    rows = (slots * num_kv_heads).unsqueeze(0) + torch.arange(num_kv_heads, device=slots.device).view(-1, 1, 1)
    rows = rows.view(-1)  # [num_kv_heads * num_seqs * width]
    flat = kv_cache.reshape(2, num_blocks * block_size * num_kv_heads, head_dim)
    shape = (num_kv_heads, num_seqs, width, head_dim)
    keys = flat[0].index_select(0, rows).view(shape).to(dtype)
    values = flat[1].index_select(0, rows).view(shape).to(dtype)
    return keys, values


def decode_attention(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32, padded with any valid id
    context_lens: torch.Tensor,  # [num_seqs] int32, tokens in cache incl. the query's own
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    """One query token per sequence attending to its whole cached context (or its last ``sliding_window``).

    The contexts are gathered padded to the longest one (padding repeats a real token of the same
    sequence and gets a ``-inf`` score), per KV head, and the ``group`` query heads sharing a KV head
    run as the rows of one small GEMM: ``[group, head_dim] x [head_dim, width]`` per (KV head, sequence).
    Positions outside a sequence's window are never read.
    """
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[3]
    group = num_heads // num_kv_heads
    if num_seqs == 0:
        return query.new_empty(query.shape)
    dev = query.device
    lens = context_lens.long()
    first = (lens - sliding_window).clamp_min(0) if sliding_window is not None else torch.zeros_like(lens)
    width = int((lens - first).max())
    pos = first.unsqueeze(1) + torch.arange(width, device=dev)  # [num_seqs, width]
    valid = pos < lens.unsqueeze(1)
    pos = torch.where(valid, pos, first.unsqueeze(1))  # padding reads the sequence's first visible token
    keys, values = _gather_head_major(kv_cache, block_tables, pos, query.dtype)  # [kv_heads, seqs, width, d]
    bias = torch.zeros(num_seqs, width, dtype=query.dtype, device=dev).masked_fill_(~valid, float("-inf"))
    q = query.reshape(num_seqs, num_kv_heads, group, head_dim).transpose(0, 1)  # [kv_heads, seqs, group, d]
    batch = num_kv_heads * num_seqs
    scores = torch.baddbmm(
        bias.expand(num_kv_heads, num_seqs, width).reshape(batch, 1, width),
        q.reshape(batch, group, head_dim),
        keys.view(batch, width, head_dim).transpose(1, 2),
        alpha=scale,
    )  # [kv_heads * seqs, group, width]
    probs = torch.softmax(scores.float(), dim=-1).to(query.dtype)
    out = torch.bmm(probs, values.view(batch, width, head_dim))  # [kv_heads * seqs, group, d]
    return out.view(num_kv_heads, num_seqs, num_heads // num_kv_heads, head_dim).transpose(0, 1).reshape(
        num_seqs, num_heads, head_dim
    )


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
    num_kv_heads = kv_cache.shape[3]
    out = torch.empty_like(query)
    starts = cu_seqlens_q.tolist()
    lens = context_lens.tolist()
    dev = query.device
    # NOTE: one iteration per sequence (not per token), each a single SDPA call. The 4-D form with
    # enable_gqa takes torch's fused CPU (flash) kernel: the query heads sharing a KV head read it in
    # place, and no [q_len, ctx] score matrix is materialized (3-D inputs fall back to the math path).
    gqa = num_kv_heads != num_heads
    for s, ctx in enumerate(lens):
        q0, q1 = starts[s], starts[s + 1]
        q_len = q1 - q0
        if q_len == 0:
            continue
        # Keys before the first query's window are never needed: do not read them.
        first = max(0, ctx - q_len - sliding_window + 1) if sliding_window is not None else 0
        k_pos = torch.arange(first, ctx, device=dev)
        keys, values = _gather_head_major(kv_cache, block_tables[s : s + 1], k_pos.unsqueeze(0), query.dtype)
        q = query[q0:q1].transpose(0, 1).unsqueeze(0)  # [1, num_heads, q_len, head_dim]
        k, v = keys.transpose(0, 1), values.transpose(0, 1)  # [1, kv_heads, ctx - first, head_dim]
        if first == 0 and q_len == ctx and sliding_window is None:
            # A whole prompt: plain causal attention, no mask tensor.
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            q_pos = torch.arange(ctx - q_len, ctx, device=dev).unsqueeze(1)
            mask = _window_mask(q_pos, k_pos.unsqueeze(0), sliding_window)  # [q_len, ctx - first]
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
        out[q0:q1] = o[0].transpose(0, 1)
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
