"""Sizing a tensor-parallel group's KV pool (kvserve/workers/parallel/sizing.py) on a real gloo group: each
rank profiles its own card through ``memory_budget.profile_kv_blocks`` (its shard's weights measured, its
forwards run; the card's figures from ``tp_meter.RankMeter``, the only part CUDA would measure) and the group
takes the smallest pool; a rank without room fails the group's start on every rank."""

from __future__ import annotations

import itertools
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist

from kvserve.workers.core.request import WorkerRequest
from kvserve.workers.core.sampling_params import SamplingParams
from kvserve.workers.engine.config import EngineConfig
from kvserve.workers.engine.kv_cache import bytes_per_block
from kvserve.workers.engine.memory_budget import CudaMemory, ProfileShape
from kvserve.workers.parallel.engine import TPEngine
from kvserve.workers.parallel.shard_loader import load_shard
from tests.model.tp_meter import RankMeter

MiB = 2**20
GiB = 2**30


def _config(model_dir: Path) -> EngineConfig:
    return EngineConfig(model=str(model_dir), device="cpu", block_size=4, tensor_parallel_size=2, max_num_seqs=4,
                        max_num_batched_tokens=64, gpu_memory_utilization=0.5)  # fmt: skip


def _expected_blocks(model_dir: Path, rank: int, meter: RankMeter) -> int:
    """What rank ``rank`` alone would allocate: its share next to its shard's weights, its step's and its
    decode graphs' peaks and their static inputs, no more than its free memory."""
    shard = load_shard(model_dir, rank, 2)
    weights = sum(t.numel() * t.element_size() for t in itertools.chain(shard.parameters(), shard.buffers()))
    max_len = shard.config.max_position_embeddings
    buffers = ProfileShape.of(_config(model_dir), torch.float32, max_len).graph_buffer_bytes
    assert buffers > 0
    memory = CudaMemory(meter.totals[rank], meter.frees[rank], 0.5, weights, meter.peak, meter.peak + buffers)
    return memory.kv_blocks(bytes_per_block(shard.config, 4, torch.float32))


def test_group_pool_is_the_smallest_rank_pool(tiny_llama_dir: Path, hf_greedy) -> None:
    # Rank 1's card is the fuller one: its free memory bounds it; rank 0's share bounds rank 0.
    meter = RankMeter(totals=(GiB, GiB), frees=(GiB, 3 * MiB), peak=MiB)
    want = [_expected_blocks(tiny_llama_dir, r, meter) for r in (0, 1)]
    assert want[1] < want[0]
    engine = TPEngine(_config(tiny_llama_dir), meter=meter)
    try:
        assert engine.kv_cache.num_blocks == engine.pool.num_blocks == want[1]
        prompt = list(range(100, 130))
        engine.add_request(WorkerRequest("r", prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)))
        tokens: list[int] = []
        while engine.has_unfinished_requests():
            tokens += [t for out in engine.step() for t in out.new_token_ids]
    finally:
        engine.close()
    assert tokens == hf_greedy(tiny_llama_dir, [prompt], 8)[0]


def test_a_rank_without_room_fails_the_group(tiny_llama_dir: Path) -> None:
    meter = RankMeter(totals=(GiB, GiB), frees=(GiB, 2 * MiB), peak=MiB)  # rank 1: peaks fill its free memory
    before = set(psutil.Process().children())
    with pytest.raises(ValueError, match="another rank has no room"):
        TPEngine(_config(tiny_llama_dir), meter=meter)
    # the failed start-up leaves nothing behind: this process out of the group, the other rank ended
    assert not dist.is_initialized(), "a failed start-up left this process in the group"
    assert not [p for p in psutil.Process().children() if p not in before and p.is_running()
                and p.status() != psutil.STATUS_ZOMBIE], "a failed start-up left a rank running"  # fmt: skip
