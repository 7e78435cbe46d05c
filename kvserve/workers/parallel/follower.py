"""A rank > 0 of a tensor-parallel group: ``run`` joins the group, loads its shard, sizes its KV pool with the
group, allocates it as rank 0 says and runs rank 0's steps until told to stop. It runs in a process of its own
(``python -m kvserve.workers.parallel.follower`` reads its arguments, pickled by ``TPEngine``, from stdin) or in
a Ray actor of the worker's placement group (``rank_actor``), as ``launchers`` starts it. When rank 0 dies, the
next collective fails and ``run`` raises (the process exits non-zero): a group never runs with a missing rank."""

from __future__ import annotations

import logging
import pickle
import sys

import torch
import torch.distributed as dist

from kvserve.workers.engine.config import EngineConfig
from kvserve.workers.engine.kv_cache import KVCache, bytes_per_block, kv_storage_dtype
from kvserve.workers.engine.memory_budget import MemoryMeter
from kvserve.workers.engine.tier_cost import TierCostModel
from kvserve.workers.models.model_config import parse_dtype
from kvserve.workers.parallel import group, sizing
from kvserve.workers.parallel.runner import follow
from kvserve.workers.parallel.shard_loader import load_shard
from kvserve.workers.parallel.tiers import GroupTieredCache


def run(
    config: EngineConfig,
    rank: int,
    address: str,
    dtype: str,
    max_positions: int,
    num_threads: int,
    meter: MemoryMeter | None = None,
    own_device: bool = False,
) -> None:
    """Rank ``rank`` (> 0): join, load its shard, size its KV pool with the group (``sizing``), allocate it
    as rank 0 says, build its tiers if the group has them, run steps until STOP. ``own_device``: this
    process sees only its own CUDA card (a Ray actor), else rank r takes ``cuda:r`` (``group.rank_device``)."""
    torch.set_num_threads(num_threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu") if config.device == "auto" else (
        torch.device(config.device))  # fmt: skip
    device = group.rank_device(device, rank, own_device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    n = config.tensor_parallel_size
    group.join(rank, n, address, device)
    try:
        model = load_shard(config.model, rank, n, parse_dtype(dtype), device, max_positions)
        model.cpu_weights = config.cpu_weights
        kv_dtype = kv_storage_dtype(config.kv_cache_dtype, parse_dtype(dtype))
        block_bytes = bytes_per_block(model.config, config.block_size, kv_dtype)
        max_model_len = config.max_model_len or model.full_config.max_position_embeddings
        sizing.group_num_blocks(config, model, kv_dtype, block_bytes, max_model_len, meter)
        sizes = torch.empty(3, dtype=torch.int64, device=device)
        dist.broadcast(sizes, src=0)
        num_blocks, num_swap_blocks, id_bytes = sizes.tolist()
        model_id = torch.empty(id_bytes, dtype=torch.uint8, device=device)
        dist.broadcast(model_id, src=0)
        kv_cache = KVCache(model.config, num_blocks, config.block_size, kv_dtype, device, num_swap_blocks)
        if device.type == "cpu":
            model.pack_for_cpu()
        tiers = None
        if config.tiers_enabled:
            model_name = bytes(model_id.cpu().tolist()).decode()
            tiers = GroupTieredCache(config, kv_cache, None, model_name, TierCostModel(config.block_size),
                                     shard=(model.plan.rank, model.plan.size))  # fmt: skip
        try:
            follow(model, kv_cache, tiers)
        finally:
            if tiers is not None:
                tiers.close()  # the writes this rank queued land before it exits
    finally:
        group.leave()


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s tp-rank %(levelname)s %(name)s: %(message)s")
    run(*pickle.loads(sys.stdin.buffer.read()))


if __name__ == "__main__":
    main()
