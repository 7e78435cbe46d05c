"""A group's KV blocks as one cache's (migration): each rank holds its KV heads of every block; a migrated
block carries all the model's heads, so a request moves between a TP group and any other worker.

Read: every rank stacks its heads of the blocks, rank 0 gathers them and keeps one copy of each head (a
replicated head is on several ranks). Write: rank 0 broadcasts the full blocks and each rank keeps its heads.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from kvserve.kernels.reference import raw_bytes
from kvserve.workers.engine.kv_cache import KVCache
from kvserve.workers.parallel.sharding import ShardPlan


def _stack(cache: KVCache, block_ids: list[int], swapped: bool) -> torch.Tensor:
    """This rank's heads of the blocks, all layers: ``[layers, 2, n, block_size, heads, head_dim (bytes)]``
    as raw bytes (fp8 and int8 move bit-exact), int8 scales appended as bytes on the last dim."""
    layers = cache.swap_layers if swapped else cache.layers
    idx = torch.tensor(block_ids, dtype=torch.int64, device=layers[0].device)
    data = torch.stack([raw_bytes(layer)[:, idx] for layer in layers]).contiguous().view(torch.uint8)
    scales = cache.swap_scales if swapped else cache.scales
    if not scales:
        return data
    s = torch.stack([layer[:, idx] for layer in scales]).unsqueeze(-1).contiguous().view(torch.uint8)
    return torch.cat((data, s), dim=-1)


def _unstack(cache: KVCache, stacked: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    """Inverse of ``_stack`` for any number of heads: (per-layer data, per-layer scales or None)."""
    row = cache.layers[0].shape[-1] * cache.layers[0].element_size()
    data = stacked[..., :row].contiguous().view(cache.dtype)
    scales = None
    if cache.scales is not None:
        scales = list(stacked[..., row:].contiguous().view(torch.float32).squeeze(-1).unbind(0))
    return list(data.unbind(0)), scales


def gather_blocks(
    cache: KVCache, plan: ShardPlan, block_ids: list[int], swapped: bool
) -> tuple[list[torch.Tensor], list[torch.Tensor] | None] | None:
    """Every rank's call (collective): on rank 0 the blocks with all KV heads (``KVCache.read_blocks``'s
    format), None on the others."""
    local = _stack(cache, block_ids, swapped)
    if plan.rank != 0:
        dist.gather(local, None, dst=0)
        return None
    parts = [torch.empty_like(local) for _ in range(plan.size)]
    dist.gather(local, parts, dst=0)
    heads, seen = [], set()
    for rank, part in enumerate(parts):
        first = ShardPlan(plan.full, rank, plan.size).first_kv_head
        if first not in seen:  # NOTE: replicated heads: the first rank holding each gives it
            seen.add(first)
            heads.append(part)
    data, scales = _unstack(cache, torch.cat(heads, dim=4).cpu())
    return data, scales


def scatter_blocks(cache: KVCache, plan: ShardPlan, block_ids: list[int], full: torch.Tensor | None) -> None:
    """Every rank's call (collective): rank 0 passes the blocks with all heads as ``_stack`` lays them out
    (``stack_full``), the others None; each rank writes its heads."""
    n, c = len(block_ids), plan.full
    row = cache.layers[0].shape[-1] * cache.layers[0].element_size() + (4 if cache.scales is not None else 0)
    shape = (len(cache.layers), 2, n, cache.block_size, c.num_kv_heads, row)
    if full is None:
        full = torch.empty(shape, dtype=torch.uint8, device=cache.device)
    dist.broadcast(full, src=0)
    mine = full[:, :, :, :, plan.first_kv_head : plan.first_kv_head + plan.num_kv_heads]
    data, scales = _unstack(cache, mine)
    idx = torch.tensor(block_ids, dtype=torch.int64, device=cache.device)
    for layer, blocks in zip(cache.layers, data, strict=True):
        raw_bytes(layer)[:, idx] = raw_bytes(blocks)
    for layer, blocks in zip(cache.scales or [], scales or [], strict=True):
        layer[:, idx] = blocks


def stack_full(cache: KVCache, data: list[torch.Tensor], scales: list[torch.Tensor] | None) -> torch.Tensor:
    """``read_blocks``-format blocks (all heads) laid out as ``_stack`` does, on the cache's device."""
    stacked = torch.stack(data).to(cache.device).contiguous().view(torch.uint8)
    if scales is None:
        return stacked
    s = torch.stack(scales).to(cache.device).unsqueeze(-1).contiguous().view(torch.uint8)
    return torch.cat((stacked, s), dim=-1)
