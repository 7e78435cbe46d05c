"""Rank 0's runner (the engine's, plus the step broadcast) and the other ranks' loop.

Rank 0 schedules, stages the batch's inputs, broadcasts them once (``step_message``) and runs its
shard; every other rank receives them and runs its shard of the same forward (the collectives inside
the model pair up), then contributes its slice of the sampled rows' logits. Only rank 0 samples.

Decode graphs: every rank captures the same buckets (``CAPTURE``); a graph step's staged static-buffer rows
are broadcast (``GRAPH_STEP``) and every rank replays the same bucket. A graph holds the forward's
all-reduces and the greedy head's all-gather, so on CUDA it needs NCCL (collectives capturable since NCCL
2.9.6); gloo collectives are host-driven and cannot be captured, and the group never uses gloo on CUDA
(``group.join``). A step that samples from full logits gathers them after the replay, eagerly. On CPU the
eager twin (``EagerGraph``) runs the same protocol.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from kvserve.workers.engine.attention_metadata import AttentionMetadata
from kvserve.workers.engine.cuda_graphs import DecodeGraphs, Forward, Outputs
from kvserve.workers.engine.kv_cache import KVCache
from kvserve.workers.engine.model_runner import ModelRunner
from kvserve.workers.engine.request import Request
from kvserve.workers.engine.tiered_cache import TieredCache
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


def graph_forward(model: ShardedCausalLM, cache: KVCache) -> Forward:
    """The forward a decode graph captures, the same on every rank: the shard's forward (its all-reduces) and
    the greedy head (``greedy_token_ids_every_rank``: one all-gather of per-rank maxima, no logits gather)."""

    def forward(ids: torch.Tensor, positions: torch.Tensor, attn: object) -> Outputs:
        hidden = model(ids, positions, cache.layers, attn, cache.layer_scales)  # type: ignore[arg-type]
        return hidden, model.greedy_token_ids_every_rank(hidden)

    return forward


def needs_logits(batch: list[tuple[Request, int]], sample_reqs: list[int]) -> bool:
    """Whether rank 0's runner computes the sampled rows' logits after a graph replay (one more gather).
    NOTE: the predicate of ``ModelRunner.execute``'s greedy shortcut; the ranks' collectives pair only if
    the two agree (the TP graph tests run greedy, seeded-sampling and logprob requests)."""
    params = [batch[j][0].sampling_params for j in sample_reqs]
    return bool(params) and not all(p.greedy and p.logprobs is None for p in params)


class LeaderDecodeGraphs(DecodeGraphs):
    """Rank 0's decode graphs: the staged rows go to the other ranks before each replay."""

    def __init__(self, forward: Forward, buckets: Sequence[int], max_blocks: int, device: torch.device,
                 block_size: int) -> None:  # fmt: skip
        super().__init__(forward, buckets, max_blocks, device)
        self.block_size = block_size

    def staged(self, batch: list[tuple[Request, int]], batch_size: int, sample_reqs: list[int]) -> None:
        ids, positions, attn = self.buffers.inputs(batch_size)
        # The block-table columns the contexts reach (each decode's context ends after its new token).
        longest = max(req.num_computed_tokens + 1 for req, _ in batch)
        width = min(-(-longest // self.block_size), self.buffers.max_blocks)
        rows = torch.tensor(sample_reqs, dtype=torch.int64, device=self.device)
        step_message.send_graph_step(step_message.GraphRows(
            batch_size, len(batch), ids, positions, attn.slot_mapping, attn.decode_context_lens,
            attn.decode_block_tables[:, :width], rows, needs_logits(batch, sample_reqs),
        ))  # fmt: skip


def load_rows(graphs: DecodeGraphs, rows: step_message.GraphRows) -> None:
    """A follower's side of ``LeaderDecodeGraphs.staged``: rank 0's rows into this rank's static buffers."""
    ids, positions, attn = graphs.buffers.inputs(rows.batch_size)
    width = rows.block_table.shape[1]
    ids.copy_(rows.input_ids)
    positions.copy_(rows.positions)
    attn.slot_mapping.copy_(rows.slots)
    attn.decode_context_lens.copy_(rows.context_lens)
    attn.decode_block_tables[:, :width].copy_(rows.block_table)


class LeaderRunner(ModelRunner):
    """``ModelRunner`` of rank 0: every staged batch is broadcast before its forward, once per step: an eager
    step's inputs (``prepare_inputs``) or a graph step's static-buffer rows (``LeaderDecodeGraphs``)."""

    def prepare_inputs(
        self, batch: list[tuple[Request, int]]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor, list[int]]:
        input_ids, positions, attn, sample_rows, sample_reqs = super().prepare_inputs(batch)
        step_message.send_step(input_ids, positions, attn, sample_rows if sample_reqs else sample_rows[:0])
        return input_ids, positions, attn, sample_rows, sample_reqs

    def capture_decode_graphs(self, buckets: Sequence[int], max_model_len: int) -> None:
        """``ModelRunner.capture_decode_graphs`` on every rank of the group (one ``CAPTURE`` message)."""
        assert isinstance(self.model, ShardedCausalLM)
        buckets, max_blocks = sorted(set(buckets)), -(-max_model_len // self.block_size)
        step_message.send_capture(buckets, max_blocks, self.device)
        graphs = LeaderDecodeGraphs(graph_forward(self.model, self.kv_cache), buckets, max_blocks, self.device,
                                    self.block_size)  # fmt: skip
        graphs.capture()
        self.decode_graphs = graphs


@torch.inference_mode()
def follow(model: ShardedCausalLM, kv_cache: KVCache, tiers: TieredCache | None = None) -> int:
    """Run rank 0's steps on this rank's shard until it sends STOP; returns the number of steps run.
    ``tiers``: this rank's host/disk tiers (``parallel.tiers``), when the group has them.

    Raises whatever the collectives raise when a peer dies (the caller's process then ends: a group
    never runs with a missing rank)."""
    steps = 0
    graphs: DecodeGraphs | None = None
    while True:
        msg = step_message.receive(kv_cache.device)
        if msg.kind == step_message.STOP:
            return steps
        if msg.kind == step_message.TIER_SPILL:
            assert tiers is not None, "a tier spill in a group without tiers"
            tiers.spill(list(zip(msg.block_ids or [], msg.hashes or [], strict=True)))
            continue
        if msg.kind == step_message.TIER_LOAD:
            assert tiers is not None, "a tier load in a group without tiers"
            tiers.load_run(msg.hashes or [], msg.block_ids or [], msg.tiers or [])
            continue
        if msg.kind == step_message.TIER_FLUSH:
            assert tiers is not None, "a tier flush in a group without tiers"
            tiers.flush()
            continue
        if msg.kind == step_message.CAPTURE:
            graphs = DecodeGraphs(graph_forward(model, kv_cache), msg.buckets or [], msg.max_blocks, kv_cache.device)
            graphs.capture()
            continue
        if msg.kind == step_message.GRAPH_STEP:
            assert graphs is not None and msg.graph is not None, "a graph step before CAPTURE"
            _graph_step(model, graphs, msg.graph)
            steps += 1
            continue
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


def _graph_step(model: ShardedCausalLM, graphs: DecodeGraphs, rows: step_message.GraphRows) -> None:
    """Replay rank 0's graph step here; then, if rank 0 samples from full logits, this rank's slice of them."""
    load_rows(graphs, rows)
    hidden, _ = graphs.replay(rows.batch_size)
    if rows.logits:
        model.compute_logits(hidden[: rows.num_real][rows.sample_rows])
