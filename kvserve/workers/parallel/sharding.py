"""What each rank of a tensor-parallel group holds (Megatron/vLLM layout).

Attention heads are split in contiguous ranges: rank r has query heads ``[r*H/N, (r+1)*H/N)`` and
the KV heads they read. With at least N KV heads, each rank has ``K/N`` of them; with fewer (GQA,
``N % K == 0``), every KV head is replicated on ``N/K`` ranks, as vLLM does. The MLP's intermediate
dimension is split in N ranges; q/k/v and gate/up are column-parallel (rows of the HF weight), o_proj
and down_proj row-parallel (columns). The vocabulary is split in N ranges of ``ceil(V/N)`` rows (the
last padded with zero rows) for the embedding and the LM head. Norms and rope are replicated.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvserve.workers.models.model_config import ModelConfig


@dataclass(frozen=True)
class ShardPlan:
    """Rank ``rank`` of ``size``'s slice of ``full`` (the checkpoint's config)."""

    full: ModelConfig
    rank: int
    size: int

    def __post_init__(self) -> None:
        c, n = self.full, self.size
        if not 0 <= self.rank < n:
            raise ValueError(f"rank {self.rank} outside a group of {n}")
        problems = []
        if c.num_heads % n:
            problems.append(f"{c.num_heads} attention heads")
        if c.num_kv_heads % n and n % c.num_kv_heads:
            problems.append(f"{c.num_kv_heads} KV heads (neither a multiple nor a divisor of it)")
        if c.intermediate_size % n:
            problems.append(f"intermediate size {c.intermediate_size}")
        if problems:
            raise ValueError(f"tensor_parallel_size={n} does not divide {c.architecture}'s " + ", ".join(problems))

    @property
    def num_heads(self) -> int:  # query heads per rank
        return self.full.num_heads // self.size

    @property
    def num_kv_heads(self) -> int:  # KV heads per rank (1 where replicated)
        return max(1, self.full.num_kv_heads // self.size)

    @property
    def first_kv_head(self) -> int:
        # NOTE: replicated heads: rank r's query heads read KV head r*K//N (GQA groups stay whole).
        return self.rank * self.full.num_kv_heads // self.size

    @property
    def intermediate(self) -> int:
        return self.full.intermediate_size // self.size

    @property
    def vocab_rows(self) -> int:  # rows of the embedding / LM head per rank, padding included
        return -(-self.full.vocab_size // self.size)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_rows

    @property
    def vocab_real_rows(self) -> int:  # rows of this rank that are real tokens (the last rank may pad)
        return max(0, min(self.full.vocab_size - self.vocab_start, self.vocab_rows))

    def rank_config(self) -> ModelConfig:
        """The config this rank's modules are built from: its heads, KV heads, MLP width and vocab rows."""
        return dataclasses.replace(
            self.full,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            intermediate_size=self.intermediate,
            vocab_size=self.vocab_rows,
        )

    def rows(self, hf_name: str) -> tuple[int, int] | None:
        """The ``[start, stop)`` range this rank takes of an HF tensor's first dim (column-parallel and
        vocab tensors), or None where it takes the whole tensor or splits the second dim."""
        hd = self.full.head_dim
        if hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            return self.rank * self.num_heads * hd, (self.rank + 1) * self.num_heads * hd
        if hf_name.endswith(("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias")):
            return self.first_kv_head * hd, (self.first_kv_head + self.num_kv_heads) * hd
        if hf_name.endswith(("gate_proj.weight", "up_proj.weight")):
            return self.rank * self.intermediate, (self.rank + 1) * self.intermediate
        if hf_name in ("model.embed_tokens.weight", "lm_head.weight"):
            return self.vocab_start, self.vocab_start + self.vocab_real_rows
        return None

    def cols(self, hf_name: str) -> tuple[int, int] | None:
        """The ``[start, stop)`` range of the second dim for the row-parallel projections, else None."""
        if hf_name.endswith("o_proj.weight"):
            q = self.num_heads * self.full.head_dim
            return self.rank * q, (self.rank + 1) * q
        if hf_name.endswith("down_proj.weight"):
            return self.rank * self.intermediate, (self.rank + 1) * self.intermediate
        return None
