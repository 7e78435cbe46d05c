"""The torch backend's fast CPU paths (in-place decode, windowed prefill) against a naive
gather-everything implementation written for clarity, on pools whose unused slots hold garbage."""

from __future__ import annotations

import pytest
import torch

from kvserve.kernels import reference


def _naive(query, kv_cache, block_tables, cu_q, context_lens, scale, window):  # noqa: ANN001
    """Per sequence: gather its whole context, mask causally (and by window), softmax, weight V."""
    block_size, kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = query.shape[1] // kv_heads
    out = torch.empty_like(query)
    for s in range(len(context_lens)):
        ctx, q0, q1 = int(context_lens[s]), int(cu_q[s]), int(cu_q[s + 1])
        blocks = block_tables[s, : -(-ctx // block_size)].long()
        k = kv_cache[0][blocks].flatten(0, 1)[:ctx].double().repeat_interleave(group, 1)  # [ctx, heads, d]
        v = kv_cache[1][blocks].flatten(0, 1)[:ctx].double().repeat_interleave(group, 1)
        q = query[q0:q1].double()  # [q_len, heads, d]
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        q_pos = torch.arange(ctx - (q1 - q0), ctx)[:, None]
        k_pos = torch.arange(ctx)[None, :]
        visible = k_pos <= q_pos
        if window is not None:
            visible &= k_pos > q_pos - window
        scores = scores.masked_fill(~visible, float("-inf"))
        out[q0:q1] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(query.dtype)
    return out


def _case(seed: int, lens: list[int], q_lens: list[int], block_size: int, heads: int, kv_heads: int):
    g = torch.Generator().manual_seed(seed)
    head_dim, num_blocks = 32, 256
    width = -(-max(lens) // block_size)
    kv_cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=g) * 1e3  # garbage
    # Shuffled ids, and the padding past each context points at garbage blocks too.
    tables = torch.randperm(num_blocks, generator=g)[: len(lens) * width].view(len(lens), width).int()
    for s, ctx in enumerate(lens):  # the slots in use hold sane values
        for t in range(ctx):
            kv_cache[:, tables[s, t // block_size], t % block_size] = torch.randn(2, kv_heads, head_dim, generator=g)
    cu_q = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    query = torch.randn(int(cu_q[-1]), heads, head_dim, generator=g)
    return query, kv_cache, tables, cu_q, torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("block_size,heads,kv_heads", [(4, 8, 2), (16, 4, 4), (1, 6, 3)])
def test_decode_matches_naive(window, block_size, heads, kv_heads) -> None:
    lens = [1, 7, 17, 30]
    query, kv_cache, tables, cu_q, ctx = _case(0, lens, [1] * len(lens), block_size, heads, kv_heads)
    got = reference.decode_attention(query, kv_cache, tables, ctx, 0.2, window)
    torch.testing.assert_close(got, _naive(query, kv_cache, tables, cu_q, ctx, 0.2, window), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [None, 6])
def test_prefill_with_cached_prefix_matches_naive(window) -> None:
    lens, q_lens = [9, 20, 32], [9, 4, 13]  # no prefix; 16 cached + 4 new; 19 cached + 13 new
    query, kv_cache, tables, cu_q, ctx = _case(1, lens, q_lens, 4, 8, 2)
    got = reference.prefill_attention(query, kv_cache, tables, cu_q, ctx, 0.2, window)
    torch.testing.assert_close(got, _naive(query, kv_cache, tables, cu_q, ctx, 0.2, window), rtol=1e-5, atol=1e-5)
