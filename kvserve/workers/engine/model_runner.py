"""Batch -> input tensors -> model -> sampled tokens. Never touches free lists or queues."""

from __future__ import annotations

import logging

import numpy as np
import torch

from kvserve.workers.engine.attention_metadata import AttentionMetadata
from kvserve.workers.engine.kv_cache import KVCache
from kvserve.workers.engine.request import Request
from kvserve.workers.engine.sampler import Sampler
from kvserve.workers.engine.scheduler import SchedulerOutput
from kvserve.workers.host.host_tuning import ThreadGovernor, keep_freed_heap_memory
from kvserve.workers.models.model import CausalLM

logger = logging.getLogger(__name__)


class ModelRunner:
    """Turns a ``SchedulerOutput`` into one forward pass and returns one sampled token per request
    whose computed tokens reach its end (None for a request still mid-prefill)."""

    def __init__(self, model: CausalLM, kv_cache: KVCache, sampler: Sampler) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.sampler = sampler
        self.device = kv_cache.device
        self.block_size = kv_cache.block_size
        if self.device.type == "cpu":
            if not keep_freed_heap_memory():
                logger.info("mallopt unavailable: big CPU buffers are re-faulted every step")
            if model.pack_for_cpu():
                logger.info("CPU GEMMs: %s", model.cpu_gemm_summary())
        self.governor = ThreadGovernor.create() if self.device.type == "cpu" else None

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> list[int | None]:
        # Decodes first: the attention dispatch expects [decode tokens | prefill chunks].
        order = sorted(range(len(out.scheduled)), key=lambda i: out.scheduled[i][1] != 1)
        batch = [out.scheduled[i] for i in order]
        input_ids, positions, attn, sample_rows, sample_reqs = self.prepare_inputs(batch)
        hidden = self.model(input_ids, positions, self.kv_cache.layers, attn, self.kv_cache.layer_scales)
        sampled: list[int | None] = [None] * len(out.scheduled)
        if sample_reqs:
            reqs = [batch[j][0] for j in sample_reqs]
            hidden = hidden if len(sample_rows) == hidden.shape[0] else hidden[sample_rows]
            params = [r.sampling_params for r in reqs]
            if all(p.greedy and p.logprobs is None for p in params):
                tokens = self.model.greedy_tokens(hidden)
            else:
                logits = self.model.compute_logits(hidden)
                tokens = self.sampler(logits, params, [r.generator for r in reqs])
                _attach_logprobs(logits, tokens, reqs)
            for j, tok in zip(sample_reqs, tokens, strict=True):
                sampled[order[j]] = tok
        if self.governor is not None:
            self.governor.step_done()
        return sampled

    def prepare_inputs(
        self, batch: list[tuple[Request, int]]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor, list[int]]:
        """Flat inputs of a batch ordered [decodes | prefill chunks].

        Returns token ids and positions ``[num_tokens]``, the attention metadata, the rows whose
        hidden state gets sampled (``[num_sampled]`` int64) and their indices into ``batch``.
        """
        bs = self.block_size
        num_reqs = len(batch)
        ids: list[int] = []
        starts = np.empty(num_reqs, dtype=np.int64)
        counts = np.empty(num_reqs, dtype=np.int64)
        skip = np.empty(num_reqs, dtype=np.int64)
        sample_reqs: list[int] = []
        tables = [req.block_table for req, _ in batch]
        width = max(map(len, tables), default=0)
        table = np.zeros((num_reqs, width), dtype=np.int64)
        # NOTE: the only per-request Python: list slices and one row copy each; the per-token work
        # (positions, slots) is vectorised below. Padding with block 0 is safe: kernels never read
        # past a sequence's context length.
        for j, (req, n) in enumerate(batch):
            start = req.num_computed_tokens
            ids += req.all_token_ids[start : start + n]
            starts[j], counts[j], skip[j] = start, n, req.skip_store_below
            table[j, : len(tables[j])] = tables[j]
            if start + n == req.num_tokens:
                sample_reqs.append(j)
        num_tokens = len(ids)
        ends = starts + counts
        # positions: start_j, start_j + 1, ... for each request j, concatenated.
        row = np.repeat(np.arange(num_reqs), counts)  # [num_tokens] request of each token
        cu = np.cumsum(counts)
        pos = np.arange(num_tokens, dtype=np.int64) + np.repeat(starts - (cu - counts), counts)
        slots = table[row, pos // bs] * bs + pos % bs
        slots[pos < skip[row]] = -1
        num_dec = int((counts == 1).sum())  # decodes (one new token) come first
        dev = self.device
        attn = AttentionMetadata(
            slot_mapping=_to(slots, dev),
            num_decode_tokens=num_dec,
            decode_block_tables=_to(_trim(table[:num_dec], ends[:num_dec], bs), dev, torch.int32),
            decode_context_lens=_to(ends[:num_dec], dev, torch.int32),
            prefill_block_tables=_to(_trim(table[num_dec:], ends[num_dec:], bs), dev, torch.int32),
            prefill_cu_seqlens_q=_to(np.concatenate(([0], cu[num_dec:] - num_dec)), dev, torch.int32),
            prefill_context_lens=_to(ends[num_dec:], dev, torch.int32),
        )
        sample_rows = _to(cu[sample_reqs] - 1, dev)
        return _to(np.asarray(ids, dtype=np.int64), dev), _to(pos, dev), attn, sample_rows, sample_reqs


def _attach_logprobs(logits: torch.Tensor, tokens: list[int], reqs: list[Request]) -> None:
    """``req.new_logprobs`` = {sampled token: logprob} plus the top ``logprobs`` tokens, for the
    requests that asked (log-softmax of the raw logits, as vLLM reports them)."""
    rows = [i for i, r in enumerate(reqs) if r.sampling_params.logprobs is not None]
    if not rows:
        return
    logprobs = torch.log_softmax(logits[rows].float(), dim=-1)
    chosen = logprobs.gather(1, torch.tensor([tokens[i] for i in rows], device=logits.device).view(-1, 1))
    k = max(reqs[i].sampling_params.logprobs or 0 for i in rows)
    top_values, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0].long())
    for j, i in enumerate(rows):
        n = reqs[i].sampling_params.logprobs or 0
        entry = dict(zip(top_ids[j, :n].tolist(), top_values[j, :n].tolist(), strict=True))
        entry[tokens[i]] = float(chosen[j, 0])
        reqs[i].new_logprobs = entry


def _trim(table: np.ndarray, context_lens: np.ndarray, block_size: int) -> np.ndarray:
    """The columns of a block table its sequences' contexts reach."""
    width = int(-(-context_lens.max() // block_size)) if len(context_lens) else 0
    return table[:, :width]


def _to(a: np.ndarray, device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a)).to(device=device, dtype=dtype)
