"""The CPU backend: kvserve's C++ kernels (``kvserve/kernels/csrc/cpu_ops.cpp``) where they apply, the
plain-torch reference everywhere else; same signatures as ``kernels.reference``.

The C++ ops cover the fp32 decode step's hot path: paged decode attention over an fp32 cache,
rotary embedding fused with the KV store, and an fp32 GEMM over weights packed once (``pack_weight``)
for decode-sized projections and the LM head, whose greedy argmax never writes the logits. Quantized
or half caches, prefill attention, block copies, RMSNorm and SiLU-and-mul run the reference (the torch
ops of ``kernels.norm_act_reference``, measured the faster exact path; see there). Without a build
(``kernels.cpu_ext.available()``) everything does.
"""

from __future__ import annotations

import torch

from kvserve import kernels
from kvserve.kernels import cpu_ext, reference
from kvserve.kernels.norm_act_reference import fused_add_rms_norm, rms_norm, silu_and_mul
from kvserve.kernels.reference import copy_blocks, prefill_attention, store_kv, swap_blocks

__all__ = [
    "store_kv", "rope_store_kv", "decode_attention", "prefill_attention", "copy_blocks", "swap_blocks",
    "rms_norm", "fused_add_rms_norm", "silu_and_mul",
]  # fmt: skip


def _fp32_cache(kv_cache: torch.Tensor, kv_scales: torch.Tensor | None) -> bool:
    return kv_cache.dtype == torch.float32 and kv_scales is None and kv_cache.is_contiguous()


def decode_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """``reference.decode_attention``; one C++ call for fp32 queries over an fp32 cache."""
    if (
        query.dtype == torch.float32
        and query.shape[0] > 0
        and query.stride(-1) == 1
        and _fp32_cache(kv_cache, kv_scales)
        and cpu_ext.available()
    ):
        return torch.ops.kvserve_cpu.paged_decode_attention(
            query, kv_cache, block_tables.int().contiguous(), context_lens.int().contiguous(), scale,
            sliding_window or 0,
        )  # fmt: skip
    return reference.decode_attention(
        query, kv_cache, block_tables, context_lens, scale, sliding_window, kv_scales=kv_scales
    )


def rope_store_kv(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    signed_sin: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    kv_scales: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``reference.rope_store_kv``; for fp32, one C++ call that rotates ``qkv`` in place and stores."""
    if (
        qkv.dtype == torch.float32
        and qkv.stride(-1) == 1
        and cos.dtype == signed_sin.dtype == torch.float32
        and _fp32_cache(kv_cache, kv_scales)
        and cpu_ext.available()
    ):
        num_tokens, head_dim = qkv.shape[0], kv_cache.shape[-1]
        torch.ops.kvserve_cpu.rope_store_kv(
            qkv, cos.contiguous(), signed_sin.contiguous(), kv_cache, slot_mapping.long().contiguous(),
            num_heads, num_kv_heads,
        )  # fmt: skip
        q_and_k = (num_heads + num_kv_heads) * head_dim
        q = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
        k = qkv[:, num_heads * head_dim : q_and_k].view(num_tokens, num_kv_heads, head_dim)
        v = qkv[:, q_and_k:].view(num_tokens, num_kv_heads, head_dim)
        return q, k, v
    return reference.rope_store_kv(
        qkv, cos, signed_sin, kv_cache, slot_mapping, num_heads, num_kv_heads, kv_scales=kv_scales
    )


PANEL = 16  # output rows per packed panel (cpu_ops.cpp kPanel)


def packed_gemm_available(weight: torch.Tensor) -> bool:
    """Whether ``pack_weight`` and the packed GEMM ops apply to this ``[out, in]`` weight (and the ``cpu``
    backend is the one chosen: ``KVSERVE_ATTENTION_BACKEND=torch`` keeps the plain-torch path)."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and kernels.backend_name(weight.device) == "cpu"
        and cpu_ext.available()
    )


def pack_weight(weight: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:  # [panels, in, 16]
    """A weight ``[out, in]`` in the C++ GEMM's layout: 16 output rows interleaved per input unit,
    zero-padded to whole panels (same memory as the weight, plus the padding). ``dtype`` bfloat16
    rounds it to bf16 (half the bytes; the GEMM widens each weight back to fp32 exactly)."""
    out_features, in_features = weight.shape
    padded = torch.cat((weight, weight.new_zeros(-out_features % PANEL, in_features)))
    return padded.view(-1, PANEL, in_features).transpose(1, 2).contiguous().to(dtype)


def unpack_weight(packed: torch.Tensor, out_features: int) -> torch.Tensor:  # [out, in] float32
    """The plain fp32 weight back from ``pack_weight`` (bit-exact for fp32; the bf16-rounded values
    for bf16; one copy)."""
    return packed.transpose(1, 2).reshape(-1, packed.shape[1])[:out_features].float()


def lm_head_argmax(hidden: torch.Tensor, packed: torch.Tensor, vocab: int) -> torch.Tensor:  # [n] int64
    """``argmax(hidden @ weight.T)`` per row (lowest id on ties) without writing the logits."""
    return torch.ops.kvserve_cpu.lm_head_argmax(hidden.contiguous(), packed, vocab)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:  # [n, out]
    """``x @ weight.T`` (fp32) from a ``pack_weight`` weight (fp32 or bf16)."""
    return torch.ops.kvserve_cpu.packed_linear(x.contiguous(), packed, out_features)
