"""The Triton backend: the kernels of ``kernels.attention``, ``kernels.prefill``, ``kernels.cache_ops``,
``kernels.rope_store`` and ``kernels.norm_act`` under the names ``kernels.get_backend()`` promises (same
signatures as ``kernels.reference``).

``prefill_attention`` is ``kernels.prefill.paged_prefill_attention`` (FlashAttention-2 tiling, autotuned on
GPUs).

Importing this module imports triton; on CPU set ``TRITON_INTERPRET=1`` before that import.
"""

from __future__ import annotations

from kvserve.kernels.attention import decode_attention
from kvserve.kernels.cache_ops import copy_blocks, store_kv, swap_blocks
from kvserve.kernels.norm_act import fused_add_rms_norm, rms_norm, silu_and_mul
from kvserve.kernels.prefill import paged_prefill_attention as prefill_attention
from kvserve.kernels.rope_store import rope_store_kv

__all__ = [
    "store_kv", "rope_store_kv", "decode_attention", "prefill_attention", "copy_blocks", "swap_blocks",
    "rms_norm", "fused_add_rms_norm", "silu_and_mul",
]  # fmt: skip
