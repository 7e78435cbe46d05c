"""Llama-family forward (Llama 2/3, Mistral, Qwen2) over a paged KV cache.

Batched tensors throughout: a step is one flat token batch ``[num_tokens, hidden]`` with no
per-token Python. Projections are fused (q|k|v, gate|up) so each layer runs two big GEMMs
instead of five small ones; the loader splices the HF weights in.
"""

from __future__ import annotations

import math
import os

import torch
from torch import nn

import kernels
from workers.attention_metadata import AttentionMetadata
from workers.model_config import ModelConfig


class Linear(nn.Linear):
    """``nn.Linear`` whose weight can be repacked once for oneDNN's CPU GEMM (``pack_for_cpu``).

    NOTE: on CPU, torch's default fp32 GEMM (MKL) takes its AVX2 path on AMD processors: measured
    ~110 GFLOP/s per core on this Zen 5, where oneDNN with a pre-packed (blocked) weight reaches
    ~250. The packed weight replaces the plain one (``weight.to_dense()`` gives it back exactly), so
    memory does not grow. oneDNN rows are also batch-invariant: a row's result does not depend on
    which other rows share the GEMM.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight.is_mkldnn:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return nn.functional.linear(x, self.weight, self.bias)

    def pack_for_cpu(self, batch_hint: int = 64) -> None:
        """Reorder the weight into oneDNN's blocked layout (idempotent)."""
        if not self.weight.is_mkldnn:
            packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), batch_hint)
            self.weight = nn.Parameter(packed, requires_grad=False)


def onednn_linear_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``Linear.pack_for_cpu`` applies: CPU, fp32 (or bf16 with AVX512-BF16), oneDNN built in."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if not hasattr(torch.ops.mkldnn, "_linear_pointwise") or os.environ.get("KVSERVE_ONEDNN", "1") == "0":
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and torch.cpu._is_avx512_bf16_supported())


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # NOTE: statistics in fp32 then cast back, exactly as HF does, so fp16/bf16 match it too.
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2], with the checkpoint's rope scaling applied (as HF does)."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    rope = config.rope
    if config.rope_type == "linear":
        inv_freq = inv_freq / rope["factor"]
    elif config.rope_type == "llama3":
        factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
        old_len = rope["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding from a precomputed cos/sin table indexed by position."""

    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), rope_inv_freq(config))
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_positions, head_dim]
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos = self.cos[positions].to(q.dtype).unsqueeze(1)  # [num_tokens, 1, head_dim]
        sin = self.sin[positions].to(q.dtype).unsqueeze(1)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.qkv_proj = Linear(config.hidden_size, config.q_size + 2 * config.kv_size, bias=config.qkv_bias)
        self.o_proj = Linear(config.q_size, config.hidden_size, bias=False)
        self.scale = config.head_dim**-0.5

    def forward(
        self,
        x: torch.Tensor,  # [num_tokens, hidden]
        positions: torch.Tensor,  # [num_tokens]
        rotary: RotaryEmbedding,
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        attn: AttentionMetadata,
    ) -> torch.Tensor:
        c = self.config
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([c.q_size, c.kv_size, c.kv_size], dim=-1)
        q = q.view(num_tokens, c.num_heads, c.head_dim)
        k = k.view(num_tokens, c.num_kv_heads, c.head_dim)
        v = v.view(num_tokens, c.num_kv_heads, c.head_dim)
        q, k = rotary(positions, q, k)
        backend = kernels.get_backend(x.device)
        backend.store_kv(k, v, kv_cache, attn.slot_mapping)
        num_decode = attn.num_decode_tokens
        window = c.sliding_window
        if num_decode == num_tokens:
            out = backend.decode_attention(
                q, kv_cache, attn.decode_block_tables, attn.decode_context_lens, self.scale, window
            )
        elif num_decode == 0:
            out = backend.prefill_attention(
                q,
                kv_cache,
                attn.prefill_block_tables,
                attn.prefill_cu_seqlens_q,
                attn.prefill_context_lens,
                self.scale,
                window,
            )
        else:
            out = torch.cat(
                (
                    backend.decode_attention(
                        q[:num_decode], kv_cache, attn.decode_block_tables, attn.decode_context_lens, self.scale, window
                    ),
                    backend.prefill_attention(
                        q[num_decode:],
                        kv_cache,
                        attn.prefill_block_tables,
                        attn.prefill_cu_seqlens_q,
                        attn.prefill_context_lens,
                        self.scale,
                        window,
                    ),
                )
            )
        return self.o_proj(out.reshape(num_tokens, c.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(nn.functional.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        kv_cache: torch.Tensor,
        attn: AttentionMetadata,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, rotary, kv_cache, attn)
        return x + self.mlp(self.post_attention_layernorm(x))


class CausalLM(nn.Module):
    """The whole model. ``forward`` returns pre-norm hidden states for every token;
    ``compute_logits`` runs the final norm and LM head only on the rows that get sampled."""

    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config, max_positions)
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[torch.Tensor],  # per layer [2, num_blocks, block_size, num_kv_heads, head_dim]
        attn: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        x = self.embed_tokens(input_ids)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, positions, self.rotary, kv_cache, attn)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, vocab] float32
        return self._lm_head(self.norm(hidden)).float()

    def greedy_tokens(self, hidden: torch.Tensor) -> list[int]:
        """``compute_logits(hidden).argmax(-1)`` (ties -> lowest id)."""
        return self._lm_head(self.norm(hidden)).argmax(dim=-1).tolist()

    def _lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:
            return nn.functional.linear(hidden, self.embed_tokens.weight)
        return self.lm_head(hidden)

    def pack_for_cpu(self) -> bool:
        """Repack every projection and an untied LM head for oneDNN (see ``Linear``). False: not applicable."""
        weight = self.embed_tokens.weight
        if not onednn_linear_supported(weight.device, weight.dtype):
            return False
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack_for_cpu()
        return True
