"""A rank's model: ``CausalLM`` built from its ``ShardPlan.rank_config`` with the row-parallel
projections all-reducing their partial sums and a vocab-parallel embedding and LM head.

Per layer exactly two all-reduces of ``[num_tokens, hidden]``: after o_proj and after down_proj;
per step one more for the embedding lookup and, when rows are sampled, one gather of their logits to
rank 0. Every rank ends each layer with the same hidden state, so every rank writes its KV heads of
the same tokens into the same block ids.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from kvserve.workers.models import cpu_gemm
from kvserve.workers.models.model import CausalLM, Linear, argmax_rows, onednn_linear_supported
from kvserve.workers.models.model_config import ModelConfig
from kvserve.workers.parallel.sharding import ShardPlan


class RowParallelLinear(Linear):
    """``y = x_r @ W_r^T`` summed over the ranks (``x`` is this rank's slice of the input features).
    A ``Linear``, so ``pack_for_cpu`` repacks it like any projection."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        dist.all_reduce(out)
        return out


class VocabParallelEmbedding(nn.Embedding):
    """Rows ``[start, start + num_embeddings)`` of the embedding; other ids look up zeros here and
    their row on the rank that holds it, and the all-reduce adds them up (x + 0 = x: bit-exact)."""

    def __init__(self, rows: int, hidden: int, start: int) -> None:
        super().__init__(rows, hidden)
        self.start = start

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.num_embeddings)
        x = nn.functional.embedding(local.masked_fill(outside, 0), self.weight)
        x.masked_fill_(outside.unsqueeze(-1), 0.0)
        dist.all_reduce(x)
        return x


class ShardedCausalLM(CausalLM):
    """One rank's shard. ``forward`` must run on every rank of the group with the same inputs (it holds
    collectives); so must ``compute_logits``/``greedy_tokens``, which return the full logits / ids on rank 0
    (other ranks get their own slice, unused)."""

    def __init__(self, plan: ShardPlan, max_positions: int) -> None:
        super().__init__(plan.rank_config(), max_positions)
        self.plan = plan
        self.full_config: ModelConfig = plan.full
        c = self.config
        self.embed_tokens = VocabParallelEmbedding(c.vocab_size, c.hidden_size, plan.vocab_start)
        for layer in self.layers:
            layer.self_attn.o_proj = RowParallelLinear(c.q_size, c.hidden_size, bias=False)
            layer.mlp.down_proj = RowParallelLinear(c.intermediate_size, c.hidden_size, bias=False)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # rank 0: [n, vocab] float32
        local = nn.functional.linear(self.norm(hidden), self._lm_head_weight()).float().contiguous()
        if self.plan.rank != 0:
            dist.gather(local, None, dst=0)
            return local
        parts = [torch.empty_like(local) for _ in range(self.plan.size)]
        dist.gather(local, parts, dst=0)
        return torch.cat(parts, dim=1)[:, : self.full_config.vocab_size]

    def greedy_token_ids(self, hidden: torch.Tensor) -> torch.Tensor:
        # NOTE: the exact greedy heads of CausalLM (bf16 screen, packed argmax) see one vocab slice only:
        # rank 0 takes the argmax of the gathered fp32 logits instead (ties -> lowest id, as they do).
        return argmax_rows(self.compute_logits(hidden))

    def greedy_token_ids_every_rank(self, hidden: torch.Tensor) -> torch.Tensor:
        """Greedy ids ``[n]`` on every rank, without gathering logits: each rank's argmax over its vocab slice,
        then one all-gather of the (max logit, token id) pairs; the largest logit wins, ties to the lowest id,
        as ``argmax_rows`` over the full logits does (the same fp32 values, the same rule). A decode graph's
        greedy head: an all-gather is a collective NCCL can capture, a gather (send/recv) is not reliably.
        """
        local = nn.functional.linear(self.norm(hidden), self._lm_head_weight()).float()
        local[:, self.plan.vocab_real_rows :] = float("-inf")  # the last rank's padding rows never win
        ids = argmax_rows(local)
        values = local.gather(1, ids.view(-1, 1)).squeeze(1)
        # NOTE: float64 holds every fp32 logit and every token id exactly.
        pair = torch.stack((values.double(), (ids + self.plan.vocab_start).double()))
        parts = [torch.empty_like(pair) for _ in range(self.plan.size)]
        dist.all_gather(parts, pair)
        every = torch.stack(parts)  # [ranks, 2, n]; vocab slices ascend with the rank
        best = every[:, 0].argmax(dim=0)  # the first maximal rank: the lowest id on ties across ranks
        return every[:, 1].gather(0, best.view(1, -1)).squeeze(0).long()

    def pack_for_cpu(self) -> bool:
        """Repack the projections (row-parallel ones included) as ``CausalLM.pack_for_cpu`` does. The LM
        head stays plain: ``CausalLM``'s LM head copies (screen, packed argmax) see one vocab slice, never read here.
        """
        if self._onednn:
            return True
        weight = self.embed_tokens.weight
        if not onednn_linear_supported(weight.device, weight.dtype):
            return False
        first_layer = [m.weight for m in self.layers[0].modules() if isinstance(m, Linear)]
        self.gemm_choice = cpu_gemm.choose(first_layer, cpu_weights=self.cpu_weights)
        for module in self.layers.modules():
            if isinstance(module, Linear):
                module.pack_for_cpu(self.gemm_choice)
        self._onednn = True
        return True
