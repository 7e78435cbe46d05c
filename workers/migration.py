"""A request's complete state in flight between two workers (live migration).

Produced by ``LLMEngine.export_request`` at a step boundary, carried as a Ray object, consumed by
``LLMEngine.import_request`` on another worker. The KV blocks travel bit-exact and the sampler's
RNG state with them, so the continuation is token-identical to an undisturbed run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.sampling_params import SamplingParams
from workers.tokenizer import DetokenizerState


@dataclass
class MigrationState:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    priority: int
    cache_salt: str | None
    arrival_time: float
    num_computed_tokens: int
    block_size: int
    model_id: str
    # Per layer [2, num_blocks, block_size, num_kv_heads, head_dim] on the host; None when the
    # request holds no KV (waiting, or preempted by recompute): the importer recomputes it.
    kv_blocks: list[torch.Tensor] | None
    # int8 caches only: per layer [2, num_blocks, block_size, num_kv_heads] fp32 scales of kv_blocks.
    kv_scales: list[torch.Tensor] | None
    generator_state: torch.Tensor | None
    output_text: str
    detokenizer: DetokenizerState | None  # window + offsets: text held back mid-character moves too
    num_cached_tokens: int
    num_preemptions: int
    num_swaps: int

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def kv_bytes(self) -> int:
        tensors = (self.kv_blocks or []) + (self.kv_scales or [])
        return sum(t.numel() * t.element_size() for t in tensors)
