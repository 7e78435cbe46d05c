"""The KV pool of a tensor-parallel group: each rank sizes its own and the group takes the smallest.

Every rank holds the same block ids (its KV heads of each), so the group's pool is one number. Each rank
computes its own: the config's (``num_gpu_blocks``, or ``kv_cache_memory`` per rank) or, on CUDA without them,
``gpu_memory_utilization`` of its own card next to its own weights and activation peak
(``memory_budget.profile_kv_blocks``: every rank profiles the same shapes, so the forwards' collectives pair
up). Then one all-reduce MIN, at start-up, before any rank allocates: a rank whose card is fuller (another
process on it, a bigger shard) sizes the group.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from kvserve.workers.engine.config import EngineConfig
from kvserve.workers.engine.memory_budget import CudaMeter, MemoryMeter, ProfileShape, profile_kv_blocks
from kvserve.workers.models.model import CausalLM

logger = logging.getLogger(__name__)


def agree_num_blocks(size: int | ValueError, device: torch.device) -> int:
    """The group's pool: the minimum of every rank's ``size`` (a collective: every rank calls it once).

    A rank that could not size its pool passes its ValueError: the group then fails on every rank
    (that rank raises its own error, the others name it), never waits for it.
    """
    t = torch.tensor([size if isinstance(size, int) else 0], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    agreed = int(t.item())
    if isinstance(size, ValueError):
        raise size
    if agreed <= 0:
        raise ValueError("tensor-parallel group: another rank has no room for a KV block (its log says why)")
    return agreed


def group_num_blocks(
    config: EngineConfig,
    model: CausalLM,
    kv_dtype: torch.dtype,
    block_bytes: int,
    max_model_len: int,
    meter: MemoryMeter | None = None,
) -> int:
    """The group's pool in KV blocks of ``block_bytes`` (a rank's heads of a block): this rank's size, then the
    minimum over the ranks (``agree_num_blocks``: every rank calls this once, at start-up).

    This rank's size: the config's ``num_gpu_blocks``; else, without ``kv_cache_memory``, on CUDA or given a
    ``meter`` (the device's memory figures; default on CUDA ``CudaMeter``; given, it profiles whatever the
    device: tests on CPU), a profile of its own card (``memory_budget.profile_kv_blocks``); else
    ``kv_cache_memory`` over ``block_bytes``.

    Raises:
        ValueError: this rank's memory holds no block, or the profile leaves no room (the figures given); or
            another rank's did not.
    """
    device = next(model.parameters()).device
    size: int | ValueError
    # NOTE: a rank that cannot size its pool still meets the others in agree_num_blocks (it passes its
    # error), so no rank waits on a collective that never comes.
    try:
        if config.num_gpu_blocks is not None:
            size = config.num_gpu_blocks
        elif config.kv_cache_memory is None and (meter is not None or device.type == "cuda"):
            meter = meter if meter is not None else CudaMeter(device)
            shape = ProfileShape.of(config, kv_dtype, max_model_len)
            memory, size = profile_kv_blocks(meter, model, shape, block_bytes)
            logger.info("rank memory: %s -> %d KV blocks", memory.describe(), size)
        elif config.kv_cache_bytes // block_bytes > 0:
            size = config.kv_cache_bytes // block_bytes
        else:
            size = ValueError(f"kv_cache_memory={config.kv_cache_memory!r} holds no {block_bytes}-byte KV block")
    except ValueError as e:
        size = e
    return agree_num_blocks(size, device)
