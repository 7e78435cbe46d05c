"""Rank 0's runner (the engine's, plus the step broadcast) and the other ranks' loop.

Rank 0 schedules, stages the batch's inputs, broadcasts them once (``step_message``) and runs its
shard; every other rank receives them and runs its shard of the same forward (the collectives inside
the model pair up), then contributes its slice of the sampled rows' logits. Only rank 0 samples.
"""

from __future__ import annotations

import logging

import torch

from kvserve.workers.engine.attention_metadata import AttentionMetadata
from kvserve.workers.engine.kv_cache import KVCache
from kvserve.workers.engine.model_runner import ModelRunner
from kvserve.workers.engine.request import Request
from kvserve.workers.parallel import kv_blocks, step_message
from kvserve.workers.parallel.layers import ShardedCausalLM
from kvserve.workers.parallel.sharding import ShardPlan

logger = logging.getLogger(__name__)


class LeaderKVCache(KVCache):
    """Rank 0's KV cache: every swap is broadcast before it runs here, so each rank copies its heads of the
    same blocks (the scheduler's swaps before a step, and the router's Preempt commands between steps);
    migration reads and writes blocks with all the model's KV heads, gathered from / scattered to the ranks
    (``kv_blocks``), so a request moves between a group and any worker of the model."""

    plan: ShardPlan  # set by TPEngine

    def swap_out(self, mapping: list[tuple[int, int]]) -> None:
        if mapping:
            step_message.send_swap(step_message.SWAP_OUT, mapping, self.device)
        super().swap_out(mapping)

    def swap_in(self, mapping: list[tuple[int, int]]) -> None:
        if mapping:
            step_message.send_swap(step_message.SWAP_IN, mapping, self.device)
        super().swap_in(mapping)

    def read_blocks(
        self, block_ids: list[int], swapped: bool = False
    ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        step_message.send_blocks_op(step_message.READ_BLOCKS, block_ids, swapped, self.device)
        out = kv_blocks.gather_blocks(self, self.plan, block_ids, swapped)
        assert out is not None
        return out

    def check_blocks(self, data: list[torch.Tensor], scales: list[torch.Tensor] | None) -> None:
        """Raise ValueError unless ``data`` holds blocks of this model with all its KV heads."""
        c = self.plan.full
        want = (self.block_size, c.num_kv_heads, c.head_dim)
        if len(data) != len(self.layers) or any(b.dtype != self.dtype or tuple(b.shape[2:]) != want for b in data):
            got = f"{len(data)} layers of {data[0].dtype if data else None}"
            raise ValueError(f"KV blocks ({got}) cannot go into this {len(self.layers)}-layer {self.dtype} cache")
        if (scales is None) != (self.scales is None) or (scales is not None and len(scales) != len(data)):
            raise ValueError(f"KV blocks {'with' if scales is not None else 'without'} scales cannot go into a "
                             f"{self.dtype} cache")  # fmt: skip

    def write_blocks(self, block_ids: list[int], data: list[torch.Tensor], scales: list[torch.Tensor] | None) -> None:
        self.check_blocks(data, scales)
        step_message.send_blocks_op(step_message.WRITE_BLOCKS, block_ids, False, self.device)
        kv_blocks.scatter_blocks(self, self.plan, block_ids, kv_blocks.stack_full(self, data, scales))


class LeaderRunner(ModelRunner):
    """``ModelRunner`` of rank 0: every staged batch is broadcast before its forward. Decode graphs are
    off (``capture_decode_graphs`` refuses): every step goes through ``prepare_inputs``, once."""

    def prepare_inputs(
        self, batch: list[tuple[Request, int]]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor, list[int]]:
        input_ids, positions, attn, sample_rows, sample_reqs = super().prepare_inputs(batch)
        step_message.send_step(input_ids, positions, attn, sample_rows if sample_reqs else sample_rows[:0])
        return input_ids, positions, attn, sample_rows, sample_reqs

    def capture_decode_graphs(self, buckets: object, max_model_len: int) -> None:
        raise ValueError("decode graphs are not captured under tensor parallelism (run with enforce_eager)")


@torch.inference_mode()
def follow(model: ShardedCausalLM, kv_cache: KVCache) -> int:
    """Run rank 0's steps on this rank's shard until it sends STOP; returns the number of steps run.

    Raises whatever the collectives raise when a peer dies (the caller's process then ends: a group
    never runs with a missing rank)."""
    steps = 0
    while True:
        msg = step_message.receive(kv_cache.device)
        if msg.kind == step_message.STOP:
            return steps
        if msg.kind == step_message.SWAP_OUT:
            kv_cache.swap_out(msg.pairs or [])
            continue
        if msg.kind == step_message.SWAP_IN:
            kv_cache.swap_in(msg.pairs or [])
            continue
        if msg.kind == step_message.READ_BLOCKS:
            kv_blocks.gather_blocks(kv_cache, model.plan, msg.block_ids or [], msg.swapped)
            continue
        if msg.kind == step_message.WRITE_BLOCKS:
            kv_blocks.scatter_blocks(kv_cache, model.plan, msg.block_ids or [], None)
            continue
        assert msg.input_ids is not None and msg.positions is not None and msg.attn is not None
        assert msg.sample_rows is not None
        hidden = model(msg.input_ids, msg.positions, kv_cache.layers, msg.attn, kv_cache.layer_scales)
        if msg.sample_rows.numel():
            if msg.sample_rows.numel() != hidden.shape[0]:
                hidden = hidden[msg.sample_rows]
            model.compute_logits(hidden)  # this rank's slice, gathered by rank 0
        steps += 1
