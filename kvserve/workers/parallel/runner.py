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
from kvserve.workers.parallel import step_message
from kvserve.workers.parallel.layers import ShardedCausalLM

logger = logging.getLogger(__name__)


class LeaderKVCache(KVCache):
    """Rank 0's KV cache: every swap is broadcast before it runs here, so each rank copies its heads of the
    same blocks (the scheduler's swaps before a step, and the router's Preempt commands between steps)."""

    def swap_out(self, mapping: list[tuple[int, int]]) -> None:
        if mapping:
            step_message.send_swap(step_message.SWAP_OUT, mapping, self.device)
        super().swap_out(mapping)

    def swap_in(self, mapping: list[tuple[int, int]]) -> None:
        if mapping:
            step_message.send_swap(step_message.SWAP_IN, mapping, self.device)
        super().swap_in(mapping)


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
        assert msg.input_ids is not None and msg.positions is not None and msg.attn is not None
        assert msg.sample_rows is not None
        hidden = model(msg.input_ids, msg.positions, kv_cache.layers, msg.attn, kv_cache.layer_scales)
        if msg.sample_rows.numel():
            if msg.sample_rows.numel() != hidden.shape[0]:
                hidden = hidden[msg.sample_rows]
            model.compute_logits(hidden)  # this rank's slice, gathered by rank 0
        steps += 1
