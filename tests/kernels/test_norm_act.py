"""The Triton RMSNorm, residual-add + RMSNorm and SiLU-and-mul kernels against their torch reference
(``kernels.norm_act_reference``), and the reference against HF's op-by-op arithmetic.

Under ``TRITON_INTERPRET=1`` on CPU (set by conftest) or on a GPU. fp32 agrees to a few ulp (the kernel
sums squares in another order); fp16 to one rounding step of the dtype.
"""

from __future__ import annotations

import pytest
import torch

from kvserve.kernels import norm_act, norm_act_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16]
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3)}
SHAPES = [(1, 256), (5, 576), (3, 1000)]  # 1000: not a power of two (masked tail)


def _hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm.forward, verbatim arithmetic."""
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(x.dtype)


def _rounds_where_the_reference_does(got: torch.Tensor, want: torch.Tensor) -> None:
    """fp16: nearly every element bit-identical. Only fp32 intermediates may differ by an ulp (the sum of
    squares' order, exp), which moves a value across an fp16 rounding boundary rarely; a skipped
    intermediate fp16 rounding moves about one in four. (fp32 outputs carry those ulps themselves.)"""
    if got.dtype == torch.float32:
        return
    assert (got != want).float().mean().item() <= 0.01


def _inputs(shape: tuple[int, int], dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x, r = (torch.randn(shape, generator=g) * 3).to(DEVICE, dtype), torch.randn(shape, generator=g).to(DEVICE, dtype)
    w = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(DEVICE, dtype)
    return x, r, w


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm_matches_reference(shape: tuple[int, int], dtype: torch.dtype) -> None:
    x, _, w = _inputs(shape, dtype, 0)
    before = x.clone()
    out = norm_act.rms_norm(x, w, 1e-6)
    want = norm_act_reference.rms_norm(x, w, 1e-6)
    torch.testing.assert_close(out, want, **TOL[dtype])
    _rounds_where_the_reference_does(out, want)
    assert torch.equal(x, before)  # not in place: layer 0's input is also the residual


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_fused_add_rms_norm_matches_reference(shape: tuple[int, int], dtype: torch.dtype) -> None:
    x, r, w = _inputs(shape, dtype, 1)
    want_out, want_res = norm_act_reference.fused_add_rms_norm(x.clone(), r.clone(), w, 1e-5)
    out, res = norm_act.fused_add_rms_norm(x, r, w, 1e-5)
    # The residual sum is one rounding of the same two numbers: bit-identical in every dtype.
    assert torch.equal(res, want_res)
    torch.testing.assert_close(out, want_out, **TOL[dtype])
    _rounds_where_the_reference_does(out, want_out)
    assert out.data_ptr() == x.data_ptr() and res.data_ptr() == r.data_ptr()  # in place, as vLLM's


def test_rms_norm_of_per_head_slices() -> None:
    """Qwen3's q/k norms: ``[tokens, heads, head_dim]`` slices of the qkv GEMM output (no single row stride)."""
    qkv = torch.randn(3, 12, 64, device=DEVICE)
    q, w = qkv[:, :8], (1 + 0.1 * torch.randn(64)).to(DEVICE)
    torch.testing.assert_close(norm_act.rms_norm(q, w, 1e-6), norm_act_reference.rms_norm(q, w, 1e-6))


def test_fused_add_rms_norm_on_row_slices() -> None:
    """Rows of a wider buffer (a row stride that is not hidden) are read and written where they are."""
    x, r, w = _inputs((4, 512), torch.float32, 2)
    xs, rs = x[:, :256], r[:, :256]
    w = w[:256].contiguous()
    want_out, want_res = norm_act_reference.fused_add_rms_norm(xs.clone(), rs.clone(), w, 1e-6)
    untouched = x[:, 256:].clone()
    norm_act.fused_add_rms_norm(xs, rs, w, 1e-6)
    assert torch.equal(rs, want_res)
    torch.testing.assert_close(xs, want_out, atol=1e-5, rtol=1e-5)
    assert torch.equal(x[:, 256:], untouched)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, inter", [(1, 688), (7, 1536), (3, 1100)])  # 1100: two column tiles, masked
def test_silu_and_mul_matches_reference(rows: int, inter: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(3)
    gate_up = (torch.randn(rows, 2 * inter, generator=g) * 4).to(DEVICE, dtype)
    before = gate_up.clone()
    out = norm_act.silu_and_mul(gate_up)
    assert torch.equal(gate_up, before)
    want = norm_act_reference.silu_and_mul(before.clone())
    assert out.shape == (rows, inter)
    torch.testing.assert_close(out, want, **TOL[dtype])
    _rounds_where_the_reference_does(out, want)


def test_empty_batches() -> None:
    x = torch.empty(0, 256, device=DEVICE)
    w = torch.ones(256, device=DEVICE)
    assert norm_act.rms_norm(x, w, 1e-6).shape == (0, 256)
    assert norm_act.silu_and_mul(torch.empty(0, 64, device=DEVICE)).shape == (0, 32)


def test_launchers_refuse_bad_inputs() -> None:
    x = torch.randn(4, 256, device=DEVICE)
    with pytest.raises(ValueError, match="weight"):
        norm_act.rms_norm(x, torch.ones(128, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="contiguous last dim"):
        norm_act.rms_norm(x.t(), torch.ones(4, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="must match"):
        norm_act.fused_add_rms_norm(x, x.half(), torch.ones(256, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="2 \\* inter"):
        norm_act.silu_and_mul(torch.randn(2, 5, device=DEVICE))
    with pytest.raises(ValueError, match="one of"):
        norm_act.silu_and_mul(torch.zeros(2, 4, dtype=torch.int32, device=DEVICE))


# ----------------------------------------------------------------------------- the reference is HF's


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_reference_is_hf_arithmetic(dtype: torch.dtype) -> None:
    """Bit for bit: HF's RMSNorm, HF's residual add, torch's silu(gate) * up (what HF's MLP runs)."""
    g = torch.Generator().manual_seed(4)
    x, r = torch.randn(6, 576, generator=g).to(dtype), torch.randn(6, 576, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(576, generator=g)).to(dtype)
    assert torch.equal(norm_act_reference.rms_norm(x, w, 1e-6), _hf_rms_norm(x, w, 1e-6))
    out, res = norm_act_reference.fused_add_rms_norm(x.clone(), r.clone(), w, 1e-6)
    assert torch.equal(res, r + x)
    assert torch.equal(out, _hf_rms_norm(r + x, w, 1e-6))
    gate_up = torch.randn(6, 2 * 688, generator=g).to(dtype)
    want = torch.nn.functional.silu(gate_up[:, :688]) * gate_up[:, 688:]
    assert torch.equal(norm_act_reference.silu_and_mul(gate_up.clone()), want)
