"""Triton RMSNorm, residual-add + RMSNorm and SiLU-and-mul: one launch each (vLLM fuses the same).

Same contracts as ``kernels.norm_act_reference`` (the torch reference, which is HF's arithmetic op for op):

    ``_rms_norm_kernel``       grid (row,): one program loads a whole row, optionally adds the residual
                               row to it (``HAS_RESIDUAL``), stores the sum, and stores the normed row.
    ``_silu_and_mul_kernel``   grid (row, column tile): ``silu(gate) * up`` from one ``[rows, 2 * inter]`` row.

Rounding follows the reference: the sum is rounded to the tensor's dtype before its statistics are
taken (HF adds the residual in that dtype); the statistics are fp32; the normed row is rounded to the
dtype before the weight multiplies it; SiLU is rounded to the dtype before ``* up``. The fp32 sum of
squares runs in a different order than torch's (a tree, not a cascade), so fp32 results agree with the
reference to a few ulp, not bitwise (tested with tolerances; the engine's HF parity holds token for token).

NOTE: divisions are IEEE-rounded (``div_rn``; a plain ``/`` is approximate on NVIDIA GPUs), as torch's
``x / (1 + exp(-x))`` and ``sum / n`` are.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.kernels import triton_interpreting

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SILU_BLOCK = 1024  # columns per program of silu_and_mul


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [rows, hidden]
    residual_ptr,  # [rows, hidden] (read and written only with HAS_RESIDUAL)
    weight_ptr,  # [hidden]
    out_ptr,  # [rows, hidden]; may be x_ptr (each program reads its row before it writes it)
    stride_x,
    stride_r,
    stride_o,
    hidden,
    eps,
    BLOCK_N: tl.constexpr,  # next power of two >= hidden
    HAS_RESIDUAL: tl.constexpr,
):
    """One program = one row. With ``HAS_RESIDUAL``: ``s = x + r`` (rounded to the dtype) overwrites the
    residual row and is what gets normed; without, ``x`` is normed. Contract: rows are contiguous
    (column stride 1), ``hidden <= BLOCK_N``."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    dtype = x.dtype
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)
        tl.store(residual_ptr + row * stride_r + cols, x, mask=mask)
    xf = x.to(tl.float32)
    mean_sq = tl.math.div_rn(tl.sum(xf * xf, axis=0), hidden.to(tl.float32))
    inv = tl.math.div_rn(1.0, tl.sqrt_rn(mean_sq + eps))  # torch's CPU rsqrt is 1 / sqrt, both IEEE-rounded
    normed = (xf * inv).to(dtype)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_o + cols, (normed.to(tl.float32) * w.to(tl.float32)).to(dtype), mask=mask)


@triton.jit
def _silu_and_mul_kernel(
    gate_up_ptr,  # [rows, 2 * inter]
    out_ptr,  # [rows, inter]
    stride_in,
    stride_out,
    inter,
    BLOCK: tl.constexpr,
):
    """One program = one row x BLOCK columns: ``out = silu(gate) * up`` with ``gate = row[:inter]``,
    ``up = row[inter:]``; SiLU is rounded to the dtype first (as torch's two ops round)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + row * stride_in + inter + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    silu = tl.math.div_rn(g, 1.0 + tl.exp(-g)).to(gate.dtype)
    tl.store(out_ptr + row * stride_out + cols, (silu.to(tl.float32) * up.to(tl.float32)).to(gate.dtype), mask=mask)


# --------------------------------------------------------------------------------------------- launchers


def _check(name: str, t: torch.Tensor, what: str, rows_view: bool = True) -> torch.Tensor:  # t as [rows, last]
    """``t`` as a 2-D view: a supported float dtype on a device Triton runs on, stride-1 columns and (with
    ``rows_view``) rows that one row stride addresses (a contiguous tensor, or a row slice of one)."""
    if t.dtype not in _DTYPES:
        raise ValueError(f"{name}: {what} must be one of {_DTYPES}, got {t.dtype}")
    if not (t.device.type == "cuda" or (t.device.type == "cpu" and triton_interpreting())):
        raise ValueError(f"{name}: {what} is on {t.device}; Triton needs CUDA (or TRITON_INTERPRET=1 on CPU)")
    if t.dim() < 1 or t.stride(-1) != 1:
        raise ValueError(f"{name}: {what} needs a contiguous last dim, got strides {t.stride()}")
    if not rows_view:
        return t
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError as e:
        raise ValueError(f"{name}: {what}'s rows must share one stride, got strides {t.stride()}") from e


def _norm_launch(
    x2: torch.Tensor, r2: torch.Tensor | None, weight: torch.Tensor, out2: torch.Tensor, eps: float
) -> None:
    hidden = x2.shape[1]
    block = triton.next_power_of_2(hidden)
    num_warps = 4 if block <= 1024 else 8 if block <= 4096 else 16
    if x2.shape[0] == 0:
        return
    _rms_norm_kernel[(x2.shape[0],)](
        x2, r2 if r2 is not None else x2, weight, out2, x2.stride(0), r2.stride(0) if r2 is not None else 0,
        out2.stride(0), hidden, eps, BLOCK_N=block, HAS_RESIDUAL=r2 is not None, num_warps=num_warps,
    )  # fmt: skip


def _check_weight(name: str, weight: torch.Tensor, x: torch.Tensor) -> None:
    if weight.shape != (x.shape[-1],) or weight.stride(0) != 1 or weight.device != x.device:
        raise ValueError(
            f"{name}: weight must be a contiguous [{x.shape[-1]}] on {x.device}, got "
            f"{tuple(weight.shape)} (strides {weight.stride()}) on {weight.device}"
        )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # [..., hidden], new tensor
    """``norm_act_reference.rms_norm`` in one launch; ``x`` is not modified.

    Raises:
        ValueError: an unsupported dtype or device, a strided last dim, or a weight not ``[hidden]``.
    """
    _check("rms_norm", x, "x", rows_view=False)
    _check_weight("rms_norm", weight, x)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    # NOTE: reshape copies only rows no single stride addresses (Qwen3's per-head q/k norms over a qkv slice).
    _norm_launch(x.reshape(-1, x.shape[-1]), None, weight, out.view(-1, x.shape[-1]), eps)
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:  # (rms_norm(x + residual), x + residual)
    """``norm_act_reference.fused_add_rms_norm`` in one launch, in place as vLLM's: returns ``(x, residual)``
    with the normed rows written into ``x`` and ``x + residual`` into ``residual``.

    Raises:
        ValueError: shapes or dtypes that differ, an unsupported dtype or device, a strided last dim.
    """
    if x.shape != residual.shape or x.dtype != residual.dtype or x.device != residual.device:
        raise ValueError(
            f"fused_add_rms_norm: x and residual must match, got {x.dtype} {tuple(x.shape)} on {x.device} and "
            f"{residual.dtype} {tuple(residual.shape)} on {residual.device}"
        )
    x2, r2 = _check("fused_add_rms_norm", x, "x"), _check("fused_add_rms_norm", residual, "residual")
    _check_weight("fused_add_rms_norm", weight, x)
    _norm_launch(x2, r2, weight, x2, eps)
    return x, residual


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [..., 2 * inter] -> [..., inter], new tensor
    """``norm_act_reference.silu_and_mul`` in one launch; ``gate_up`` is not modified.

    Raises:
        ValueError: an odd last dim, an unsupported dtype or device, a strided last dim.
    """
    if gate_up.dim() < 1 or gate_up.shape[-1] % 2:
        raise ValueError(f"silu_and_mul: the last dim must be 2 * inter, got {tuple(gate_up.shape)}")
    g2 = _check("silu_and_mul", gate_up, "gate_up")
    inter = gate_up.shape[-1] // 2
    out = torch.empty((*gate_up.shape[:-1], inter), dtype=gate_up.dtype, device=gate_up.device)
    if g2.shape[0] and inter:
        o2 = out.view(-1, inter)
        grid = (g2.shape[0], triton.cdiv(inter, SILU_BLOCK))
        _silu_and_mul_kernel[grid](g2, o2, g2.stride(0), o2.stride(0), inter, BLOCK=SILU_BLOCK, num_warps=4)
    return out
