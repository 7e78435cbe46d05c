"""Quantized KV cache formats: what each stores, and the torch quantize/dequantize reference.

``fp8`` (float8_e4m3fn) uses one scale per tensor (the checkpoint's ``k_scale``/``v_scale`` when
present, else 1.0). NOTE: e4m3 has an exponent, so every value keeps ~6% relative precision
wherever it sits in range; a scale only has to keep |x| under 448, and a per-tensor one keeps the
pool exactly 2x (fp16) or 4x (fp32) the blocks.

``int8`` is fixed-point, so it needs local scales: one per (token, KV head), computed when the
token is stored (absmax / 127). NOTE: per token rather than per block, because blocks fill one
token at a time during decode: a block scale fixed by its first token would clip later ones, and
rescaling on every append would rewrite the block. The price is 4 bytes of scale per head vector
(3% at head dim 128), counted in pool sizing.
"""

from __future__ import annotations

import torch

KV_CACHE_DTYPES = ("auto", "fp8", "int8")
_STORAGE = {"fp8": torch.float8_e4m3fn, "int8": torch.int8}
_QMAX = {torch.float8_e4m3fn: 448.0, torch.int8: 127.0}


def storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The element type of the cache tensors for a ``--kv-cache-dtype`` choice."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    return model_dtype if kv_cache_dtype == "auto" else _STORAGE[kv_cache_dtype]


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype in _QMAX


def has_token_scales(dtype: torch.dtype) -> bool:
    """int8 keeps a scale per (token, head); fp8 one per tensor."""
    return dtype == torch.int8


def scale_bytes_per_token(dtype: torch.dtype, num_layers: int, num_kv_heads: int) -> int:
    """Extra bytes per token for per-(token, head) scales (K and V, every layer)."""
    return 2 * num_layers * num_kv_heads * 4 if has_token_scales(dtype) else 0


def quantize(
    x: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    dtype: torch.dtype,
    tensor_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x -> (values in ``dtype``, per-(token, head) fp32 scales [num_tokens, num_kv_heads] or None)."""
    qmax = _QMAX[dtype]
    xf = x.float()
    if has_token_scales(dtype):
        scale = xf.abs().amax(dim=-1) / qmax
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round(xf / scale[..., None]).clamp_(-qmax, qmax).to(dtype)
        return q, scale
    return (xf / tensor_scale).clamp_(-qmax, qmax).to(dtype), None


def dequantize(
    q: torch.Tensor,  # [..., head_dim]
    scale: torch.Tensor | None,  # [...] per-(token, head), or None for a tensor scale
    out_dtype: torch.dtype,
    tensor_scale: float = 1.0,
) -> torch.Tensor:
    if scale is not None:
        return (q.float() * scale[..., None]).to(out_dtype)
    return (q.float() * tensor_scale).to(out_dtype)
