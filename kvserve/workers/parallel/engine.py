"""``TPEngine``: rank 0 of a tensor-parallel group, an ``LLMEngine`` whose model is its shard.

It starts the other ranks (``launchers``: Ray actors in the worker's placement group, or without Ray child
processes of this machine; both run ``follower``), joins them (``group``),
sends them the KV pool's size once, and from then on one ``step_message`` per step. Scheduling, the
block pool, prefix caching, preemption by recompute and sampling are rank 0's alone, unchanged: block
ids and tables are the same on every rank, each rank holds its KV heads of every block.

Swaps are broadcast (``LeaderKVCache``): each rank copies its heads of the same blocks; so are decode graph
steps (each rank replays its own graphs, ``runner``) and the host/disk tiers' spills and loads (each rank
its own shard's files, ``tiers``). Each rank sizes its KV pool (on CUDA: profiles its own card) and the
group takes the smallest (``sizing``). Migration moves blocks with all KV heads (``kv_blocks``): a request
moves between a group and any worker of the model, whatever its tensor-parallel size.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from kvserve.workers.engine.config import EngineConfig
from kvserve.workers.engine.engine import LLMEngine
from kvserve.workers.engine.memory_budget import MemoryMeter
from kvserve.workers.engine.model_runner import ModelRunner
from kvserve.workers.engine.sampler import Sampler
from kvserve.workers.engine.tiered_cache import TieredCache
from kvserve.workers.models.model import CausalLM
from kvserve.workers.parallel import group, launchers, sizing, step_message
from kvserve.workers.parallel.layers import ShardedCausalLM
from kvserve.workers.parallel.runner import LeaderKVCache, LeaderRunner
from kvserve.workers.parallel.shard_loader import load_shard
from kvserve.workers.parallel.tiers import GroupTieredCache

logger = logging.getLogger(__name__)


class TPEngine(LLMEngine):
    """An ``LLMEngine`` over ``tensor_parallel_size`` ranks; this process is rank 0. ``close()`` ends the
    other ranks (they also end when this process dies: their collective fails). ``meter``: every rank's
    device memory figures for sizing the pool (default: profile CUDA cards; given, it profiles on any
    device: tests; it must pickle, the other ranks get a copy)."""

    def __init__(self, config: EngineConfig, meter: MemoryMeter | None = None) -> None:
        self._ranks: launchers.RankLauncher | None = None
        self._closed = False
        self._meter = meter
        try:
            super().__init__(config)
        except BaseException:
            # NOTE: a start-up that fails after the group formed (a rank without room for the pool, a bad
            # checkpoint) must not leave its ranks running nor this process in the group: the worker's next
            # start (or the next engine of this process) joins a group afresh.
            self._abandon()
            raise

    def _load_model(self, max_positions: int) -> CausalLM:
        config, n = self.config, self.config.tensor_parallel_size
        ranks = launchers.for_this_process(n)
        ranks.check(self.device)
        if self.device.type == "cuda":
            self.device = group.rank_device(self.device, 0, ranks.own_device)
            torch.cuda.set_device(self.device)
        address = f"{ranks.host}:{group.free_port(ranks.host)}"
        dtype = str(self.dtype).removeprefix("torch.")
        threads, meter, own = torch.get_num_threads(), self._meter, ranks.own_device
        self._ranks = ranks
        ranks.start(lambda rank: (config, rank, address, dtype, max_positions, threads, meter, own))
        group.join(0, n, address, self.device)
        logger.info("tensor-parallel group of %d joined at %s (%s, %s)", n, address, dist.get_backend(),
                    type(ranks).__name__)  # fmt: skip
        return load_shard(config.model, 0, n, self.dtype, self.device, max_positions)

    def _num_blocks(self, block_bytes: int) -> int:
        assert isinstance(self.model, ShardedCausalLM)
        return sizing.group_num_blocks(self.config, self.model, self.kv_dtype, block_bytes, self.max_model_len,
                                       self._meter)  # fmt: skip

    def _make_runner(self) -> ModelRunner:
        # The pool's and swap space's sizes, once: every rank allocates the same block ids (its KV heads of
        # each); and the model id, which names the tiers' files.
        num_swap = self.swap_pool.num_blocks if self.swap_pool is not None else 0
        model_id = torch.tensor(list(self.model_id.encode()), dtype=torch.uint8, device=self.device)
        sizes = [self.kv_cache.num_blocks, num_swap, model_id.numel()]
        dist.broadcast(torch.tensor(sizes, dtype=torch.int64, device=self.device), src=0)
        dist.broadcast(model_id, src=0)
        # NOTE: the engine built its KVCache already; LeaderKVCache adds only the swap broadcasts (no state).
        self.kv_cache.__class__ = LeaderKVCache
        self.kv_cache.plan = self.model.plan
        return LeaderRunner(self.model, self.kv_cache, Sampler())

    def _make_tiers(self) -> TieredCache:
        assert isinstance(self.model, ShardedCausalLM)
        plan = self.model.plan
        return GroupTieredCache(self.config, self.kv_cache, self.pool, self.model_id, self.tier_cost,
                                shard=(plan.rank, plan.size))  # fmt: skip

    def _probe_runner(self, num_blocks: int) -> ModelRunner:
        # NOTE: the group's own step (every rank runs it) on pool blocks 0..num_blocks-1: free at start-up, and a
        # free block is written before it is read, so the probe's K/V there is never seen.
        return self.runner

    def close(self) -> None:
        """Stop the other ranks and leave the group (idempotent); the engine is unusable afterwards."""
        super().close()
        if self._closed:
            return
        self._closed = True
        try:
            step_message.send_stop(self.device)
        except RuntimeError as e:  # a rank already gone: nothing to stop there
            logger.warning("tensor-parallel group: stop not delivered (%s)", e)
        if self._ranks is not None:
            self._ranks.stop()
        group.leave()

    def _abandon(self) -> None:
        """End the other ranks and leave the group without a stop message (start-up failed part-way)."""
        self._closed = True
        if self._ranks is not None:
            self._ranks.kill()
        group.leave()

    def followers_alive(self) -> bool:
        """Whether every other rank (process or Ray actor) is still running."""
        return self._ranks is None or self._ranks.alive()
