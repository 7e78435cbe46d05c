"""What the attention layers need to find each token's K/V: built once per step by the runner."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Token order in a batch: decode tokens first (one per sequence), then prefill/extend chunks.

    Decode sequences use the split-K decode kernel; chunks use the varlen prefill kernel.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64, negative = do not store
    num_decode_tokens: int
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks] int32
    decode_context_lens: torch.Tensor  # [num_decodes] int32
    prefill_block_tables: torch.Tensor  # [num_prefills, max_blocks] int32
    prefill_cu_seqlens_q: torch.Tensor  # [num_prefills + 1] int32, offsets within the prefill tokens
    prefill_context_lens: torch.Tensor  # [num_prefills] int32
