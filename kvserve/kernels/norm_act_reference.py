"""Plain-torch RMSNorm, residual-add + RMSNorm and SiLU-and-mul: the CPU path and the Triton kernels' reference.

The arithmetic is Hugging Face transformers' (Llama, Qwen2, Qwen3), op for op, so fp32 results are
bit-identical to HF's and fp16/bf16 ones round where HF rounds:

    rms_norm(x)                  fp32: ``F.rms_norm(x, weight)`` (HF's pow/mean/rsqrt/mul sequence, fused);
                                 half: ``weight * F.rms_norm(x.float()).to(dtype)`` (statistics in fp32,
                                 cast back, then the weight in ``dtype``)
    fused_add_rms_norm(x, r)     ``s = x + r`` in ``dtype`` (HF's residual add), then ``(rms_norm(s), s)``:
                                 how vLLM's decoder layers carry the residual stream
    silu_and_mul(gate_up)        ``silu(gate) * up`` over the gate|up GEMM output (each op rounds to ``dtype``)

``kernels.get_backend()`` returns these (``torch`` and ``cpu`` backends) or their Triton twins
(``kernels.norm_act``); all share the signatures below.

NOTE (CPU path, measured on a 2-core AMD EPYC, torch 2.13, AVX512): these torch ops stay the CPU path.
A C++ one-pass kernel could only keep HF's bits by replaying torch's cascade summation order of
``mean`` (which depends on the vector width ATen picks at run time), so it was not taken; the in-place
residual add (``add_``) measured no faster than the out-of-place one (11.8 vs 12.4 us at 1 x 256), so the
pure form is kept.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # [..., hidden], new tensor
    """RMS-normalise the last dim of ``x`` and scale by ``weight`` ``[hidden]``; ``x`` is not modified."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    # NOTE: statistics in fp32 then cast back, exactly as HF does, so fp16/bf16 match it too.
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor,  # [..., hidden], e.g. the attention or MLP output
    residual: torch.Tensor,  # [..., hidden], the residual stream so far, same dtype
    weight: torch.Tensor,  # [hidden]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # (rms_norm(x + residual), x + residual)
    """The next sublayer's normed input and the new residual stream.

    Contract (every backend): the caller must not read ``x`` or ``residual`` afterwards: a backend may
    return them updated in place (the Triton one writes the normed rows into ``x`` and the sum into
    ``residual``, as vLLM's ``fused_add_rms_norm`` does); this one allocates.
    """
    residual = x + residual  # HF's ``residual + hidden``: IEEE addition commutes, same bits
    return rms_norm(residual, weight, eps), residual


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [..., 2 * inter] -> [..., inter]
    """``silu(gate) * up`` where ``gate_up = cat(gate, up, -1)`` (the fused gate|up GEMM's output).

    Contract: the caller must not read ``gate_up`` afterwards (here the SiLU runs in place on the gate
    half: one ``[tokens, inter]`` buffer fewer; same op, same bits).
    """
    gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
    return torch.mul(F.silu(gate, inplace=True), up)
