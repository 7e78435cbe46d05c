"""``TPEngine``: rank 0 of a tensor-parallel group, an ``LLMEngine`` whose model is its shard.

It starts the other ranks as processes of this machine (``follower``), joins them (``group``),
sends them the KV pool's size once, and from then on one ``step_message`` per step. Scheduling, the
block pool, prefix caching, preemption by recompute and sampling are rank 0's alone, unchanged: block
ids and tables are the same on every rank, each rank holds its KV heads of every block.

Swaps are broadcast (``LeaderKVCache``): each rank copies its heads of the same blocks. Not supported under
tensor parallelism (refused at start, never run half-way): the host/disk tiers (their block copies and files
are rank 0's only), CUDA decode graphs and CUDA pool profiling (give
``num_gpu_blocks`` or ``kv_cache_memory``). Migration moves blocks with all KV heads (``kv_blocks``): a
request moves between a group and any worker of the model, whatever its tensor-parallel size.
"""

from __future__ import annotations

import logging
import os
import pickle
import subprocess
import sys

import torch
import torch.distributed as dist

from kvserve.workers.engine.config import EngineConfig
from kvserve.workers.engine.engine import LLMEngine
from kvserve.workers.engine.model_runner import ModelRunner
from kvserve.workers.engine.sampler import Sampler
from kvserve.workers.models.model import CausalLM
from kvserve.workers.parallel import group, step_message
from kvserve.workers.parallel.runner import LeaderKVCache, LeaderRunner
from kvserve.workers.parallel.shard_loader import load_shard

logger = logging.getLogger(__name__)


def check_supported(config: EngineConfig, device: torch.device) -> None:
    """Raise ValueError for what a tensor-parallel engine does not do (see the module docstring)."""
    n = config.tensor_parallel_size
    if config.tiers_enabled:
        raise ValueError(f"tensor_parallel_size={n}: the host/disk KV tiers are not supported; "
                         "no host_cache_size/disk_cache_dir")  # fmt: skip
    if device.type == "cuda" and config.num_gpu_blocks is None and config.kv_cache_memory is None:
        raise ValueError(f"tensor_parallel_size={n} on CUDA: give num_gpu_blocks or kv_cache_memory (per rank)")
    if device.type == "cuda" and torch.cuda.device_count() < n:
        raise ValueError(f"tensor_parallel_size={n} needs {n} CUDA devices, {torch.cuda.device_count()} visible")


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank ``rank``'s device when the group runs on one machine's devices: cuda:rank, or the CPU."""
    return torch.device("cuda", rank) if device.type == "cuda" else device


class TPEngine(LLMEngine):
    """An ``LLMEngine`` over ``tensor_parallel_size`` ranks; this process is rank 0. ``close()`` ends the
    other ranks (they also end when this process dies: their collective fails)."""

    def __init__(self, config: EngineConfig) -> None:
        self._followers: list[subprocess.Popen] = []
        self._closed = False
        super().__init__(config)

    def _load_model(self, max_positions: int) -> CausalLM:
        config, n = self.config, self.config.tensor_parallel_size
        check_supported(config, self.device)
        if self.device.type == "cuda":
            self.device = rank_device(self.device, 0)
            torch.cuda.set_device(self.device)
        address = f"127.0.0.1:{group.free_port()}"
        dtype = str(self.dtype).removeprefix("torch.")
        # NOTE: fresh interpreters (``python -m kvserve.workers.parallel.follower``), neither fork (this process
        # holds torch threads, maybe CUDA) nor multiprocessing's spawn (it re-imports the caller's __main__:
        # a script without a main guard, or Ray's worker entry point).
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        for rank in range(1, n):
            p = subprocess.Popen(
                [sys.executable, "-m", "kvserve.workers.parallel.follower"], stdin=subprocess.PIPE, env=env
            )
            assert p.stdin is not None
            p.stdin.write(pickle.dumps((config, rank, address, dtype, max_positions, torch.get_num_threads())))
            p.stdin.close()
            self._followers.append(p)
        group.join(0, n, address, self.device)
        logger.info("tensor-parallel group of %d joined at %s (%s)", n, address, dist.get_backend())
        return load_shard(config.model, 0, n, self.dtype, self.device, max_positions)

    def _make_runner(self) -> ModelRunner:
        # The pool's and swap space's sizes, once: every rank allocates the same block ids (its KV heads of each).
        num_swap = self.swap_pool.num_blocks if self.swap_pool is not None else 0
        sizes = torch.tensor([self.kv_cache.num_blocks, num_swap], dtype=torch.int64, device=self.device)
        dist.broadcast(sizes, src=0)
        # NOTE: the engine built its KVCache already; LeaderKVCache adds only the swap broadcasts (no state).
        self.kv_cache.__class__ = LeaderKVCache
        self.kv_cache.plan = self.model.plan
        return LeaderRunner(self.model, self.kv_cache, Sampler())

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
        for p in self._followers:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        group.leave()

    def followers_alive(self) -> bool:
        """Whether every other rank's process is still running."""
        return all(p.poll() is None for p in self._followers)
