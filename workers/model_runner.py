"""Batch -> input tensors -> model -> sampled tokens. Never touches free lists or queues."""

from __future__ import annotations

import torch

from workers.attention_metadata import AttentionMetadata
from workers.kv_cache import KVCache
from workers.model import CausalLM
from workers.request import Request
from workers.sampler import Sampler
from workers.scheduler import SchedulerOutput


def _pad_tables(tables: list[list[int]]) -> torch.Tensor:
    width = max((len(t) for t in tables), default=0)
    # NOTE: padding with block 0 is safe: kernels never read past a sequence's context length.
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32).reshape(len(tables), width)


class ModelRunner:
    """Turns a ``SchedulerOutput`` into one forward pass and returns one sampled token per request
    whose computed tokens reach its end (None for a request still mid-prefill)."""

    def __init__(self, model: CausalLM, kv_cache: KVCache, sampler: Sampler) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.sampler = sampler
        self.device = kv_cache.device
        self.block_size = kv_cache.block_size

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> list[int | None]:
        # Swaps first: a block swapped out this step may be rewritten by this very forward.
        self.kv_cache.swap_out(out.swap_out)
        self.kv_cache.swap_in(out.swap_in)
        # Decodes first: the attention dispatch expects [decode tokens | prefill chunks].
        order = sorted(range(len(out.scheduled)), key=lambda i: out.scheduled[i][1] != 1)
        batch = [out.scheduled[i] for i in order]
        input_ids, positions, attn, sample_rows, sample_reqs = self.prepare_inputs(batch)
        hidden = self.model(input_ids, positions, self.kv_cache.layers, attn)
        sampled: list[int | None] = [None] * len(out.scheduled)
        if sample_rows:
            logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, device=self.device)])
            reqs = [batch[j][0] for j in sample_reqs]
            tokens = self.sampler(logits, [r.sampling_params for r in reqs], [r.generator for r in reqs])
            for j, tok in zip(sample_reqs, tokens, strict=True):
                sampled[order[j]] = tok
        return sampled

    def prepare_inputs(
        self, batch: list[tuple[Request, int]]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int], list[int]]:
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        dec_tables: list[list[int]] = []
        dec_lens: list[int] = []
        pre_tables: list[list[int]] = []
        pre_lens: list[int] = []
        cu_q = [0]
        sample_rows: list[int] = []
        sample_reqs: list[int] = []
        for j, (req, n) in enumerate(batch):
            start = req.num_computed_tokens
            end = start + n
            ids.extend(req.all_token_ids[start:end])
            pos.extend(range(start, end))
            table = req.block_table
            slots.extend(
                -1 if p < req.skip_store_below else table[p // bs] * bs + p % bs for p in range(start, end)
            )
            if n == 1:
                dec_tables.append(table)
                dec_lens.append(end)
            else:
                pre_tables.append(table)
                pre_lens.append(end)
                cu_q.append(cu_q[-1] + n)
            if end == req.num_tokens:
                sample_rows.append(len(ids) - 1)
                sample_reqs.append(j)
        dev = self.device
        attn = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            num_decode_tokens=len(dec_lens),
            decode_block_tables=_pad_tables(dec_tables).to(dev),
            decode_context_lens=torch.tensor(dec_lens, dtype=torch.int32, device=dev),
            prefill_block_tables=_pad_tables(pre_tables).to(dev),
            prefill_cu_seqlens_q=torch.tensor(cu_q, dtype=torch.int32, device=dev),
            prefill_context_lens=torch.tensor(pre_lens, dtype=torch.int32, device=dev),
        )
        input_ids = torch.tensor(ids, dtype=torch.int64, device=dev)
        positions = torch.tensor(pos, dtype=torch.int64, device=dev)
        return input_ids, positions, attn, sample_rows, sample_reqs
