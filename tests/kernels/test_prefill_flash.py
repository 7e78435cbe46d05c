"""The FlashAttention-structured prefill (kernels.prefill) against the torch reference.

Paged cases reuse ``test_attention``'s NaN-poisoned pools (a wrong block or an unwritten output element
fails) and ``test_quantized_kv_triton``'s fp8/int8 pools; the contiguous launcher is checked against SDPA.
Under the interpreter the kernel runs its one small configuration (16 x 16 tiles), so a few dozen tokens
already cover both phases (unmasked tiles below the diagonal, masked diagonal tiles), ragged tails, causal
edges off the tile grid, GQA groups and windows.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvserve.kernels import attention, prefill, reference
from tests.kernels import test_quantized_kv_triton as quant
from tests.kernels.test_attention import TOL, Case, build, rel_err

HAS_CUDA = torch.cuda.is_available()
DEV = "cuda" if HAS_CUDA else "cpu"
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")

PAGED_CASES = {
    # prompts only (no prefix), ragged lengths, one under a tile
    "f32-bs16-g4-noprefix": Case(F32, 16, 2, 4, 64, (5, 17, 1, 40), q_lens=(5, 17, 1, 40)),
    # long prefix (several unmasked tiles) + a chunk whose start is off the 16-token grid
    "f16-bs16-g2-prefix": Case(F16, 16, 2, 2, 64, (70, 100), q_lens=(23, 9)),
    "f32-bs1-g3-prefix": Case(F32, 1, 2, 3, 64, (30, 100), q_lens=(9, 70)),
    "f16-bs32-g1-hd128-prefix": Case(F16, 32, 1, 1, 128, (40, 20, 7, 33), q_lens=(3, 20, 0, 1)),
    "f16-bs16-g8-hd80-prefix": Case(F16, 16, 1, 8, 80, (47, 33), q_lens=(15, 33)),
    "f16-bs16-g2-window-prefix": Case(F16, 16, 2, 2, 64, (30, 100), q_lens=(9, 70), window=5),
    "f16-bs16-g2-window21-prefix": Case(F16, 16, 2, 2, 64, (30, 100), q_lens=(9, 70), window=21),
    "f32-bs32-g4-hd128-window-prompt": Case(F32, 32, 1, 4, 128, (40,), q_lens=(40,), window=16),
    "f32-bs32-g4-window-prompt": Case(F32, 32, 1, 4, 64, (40,), q_lens=(40,), window=21),
    "f16-bs16-g4-toppool-prefix": Case(F16, 16, 1, 4, 64, (17, 40), q_lens=(2, 17), pool_blocks=1 << 13),
}


def _paged(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    p = build(case)
    out = torch.full(p.query.shape, float("nan"), dtype=p.query.dtype, device=p.query.device)
    got = prefill.paged_prefill_attention(
        p.query, p.kv_cache, p.block_tables, p.cu_seqlens_q, p.context_lens, p.scale, case.window, out=out
    )
    assert got is out
    ref = reference.prefill_attention(
        p.query, p.kv_cache, p.block_tables, p.cu_seqlens_q, p.context_lens, p.scale, case.window
    )
    return out, ref


@pytest.mark.parametrize("name", list(PAGED_CASES))
def test_paged_prefill_matches_reference(name: str) -> None:
    case = PAGED_CASES[name]
    out, ref = _paged(case)
    assert not out.isnan().any(), "unwritten or poisoned output"
    assert rel_err(out, ref) <= TOL[case.dtype]


QUANT_CASES = {
    "int8-f32-prompt-and-extend": quant.Case(quant.INT8, F32, (9, 40), q_lens=(9, 22)),
    "fp8-f16-prompt-and-extend": quant.Case(quant.FP8, F16, (9, 40), q_lens=(9, 22)),
    "int8-f16-window-extend": quant.Case(quant.INT8, F16, (9, 40), q_lens=(3, 40), window=6),
    "fp8-f32-window-extend": quant.Case(quant.FP8, F32, (9, 40), q_lens=(3, 40), window=6),
    "int8-f16-tiny-scales": quant.Case(quant.INT8, F16, (9, 40), q_lens=(9, 22), scale_size=1e-5),
}


@pytest.mark.parametrize("name", list(QUANT_CASES))
def test_paged_prefill_quantized_equals_dequantize_then_reference(name: str) -> None:
    case = QUANT_CASES[name]
    p = quant.build(case)
    scale = quant.HD**-0.5
    out = prefill.paged_prefill_attention(
        p.query, p.kv_cache, p.block_tables, p.cu_seqlens_q, p.context_lens, scale, case.window,
        kv_scales=p.kv_scales,
    )  # fmt: skip
    fp32_cache = quant.dequantize(p.kv_cache, p.kv_scales)
    ref = reference.prefill_attention(p.query, fp32_cache, p.block_tables, p.cu_seqlens_q, p.context_lens, scale,
                                      case.window)  # fmt: skip
    assert out.dtype == case.q_dtype and not out.isnan().any()
    assert rel_err(out, ref) <= quant.TOL[case.q_dtype]


@dataclasses.dataclass(frozen=True)
class Packed:
    dtype: torch.dtype
    num_kv_heads: int
    group: int
    head_dim: int
    seq_lens: tuple[int, ...]
    window: int | None = None


PACKED_CASES = {
    "f32-g4-ragged": Packed(F32, 2, 4, 64, (5, 40, 1, 33)),
    "f16-g1-hd128": Packed(F16, 2, 1, 128, (48, 17)),
    "f16-g3-hd80-window": Packed(F16, 1, 3, 80, (50, 9), window=13),
}


def _sdpa_packed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: tuple[int, ...], scale: float,
                 window: int | None) -> torch.Tensor:  # fmt: skip
    out, start = [], 0
    group = q.shape[1] // k.shape[1]
    for n in lens:
        qs = q[start : start + n].float().transpose(0, 1)
        ks = k[start : start + n].float().transpose(0, 1).repeat_interleave(group, 0)
        vs = v[start : start + n].float().transpose(0, 1).repeat_interleave(group, 0)
        i = torch.arange(n)
        mask = i[None, :] <= i[:, None]
        if window is not None:
            mask &= i[None, :] > i[:, None] - window
        o = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask.to(q.device), scale=scale)
        out.append(o.transpose(0, 1))
        start += n
    return torch.cat(out)


@pytest.mark.parametrize("name", list(PACKED_CASES))
def test_contiguous_prefill_matches_sdpa(name: str) -> None:
    c = PACKED_CASES[name]
    gen = torch.Generator().manual_seed(3)
    total = sum(c.seq_lens)
    heads = c.num_kv_heads * c.group
    # q, k, v as strided views of one fused projection output, as the model has them
    qkv = torch.randn(total, heads + 2 * c.num_kv_heads, c.head_dim, generator=gen).to(c.dtype).to(DEV)
    q, k, v = qkv.split([heads, c.num_kv_heads, c.num_kv_heads], dim=1)
    cu = torch.tensor([0, *torch.tensor(c.seq_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    scale = c.head_dim**-0.5
    out = torch.full(q.shape, float("nan"), dtype=c.dtype, device=DEV)
    prefill.flash_attention_varlen(q, k, v, cu, scale, c.window, out=out)
    ref = _sdpa_packed(q, k, v, c.seq_lens, scale, c.window)
    assert not out.isnan().any()
    assert rel_err(out, ref) <= TOL[c.dtype]


def test_paged_prefill_equals_the_packed_kernel_on_a_prompt() -> None:
    """A whole prompt stored in the cache and the same K/V held contiguously give the same output."""
    case = Case(F32, 16, 2, 2, 64, (37,), q_lens=(37,))
    p = build(case)
    ids = p.block_tables[0].long()
    k = p.kv_cache[0, ids].reshape(-1, 2, 64)[:37]
    v = p.kv_cache[1, ids].reshape(-1, 2, 64)[:37]
    paged = prefill.paged_prefill_attention(
        p.query, p.kv_cache, p.block_tables, p.cu_seqlens_q, p.context_lens, p.scale
    )
    packed = prefill.flash_attention_varlen(p.query, k, v, p.cu_seqlens_q, p.scale)
    assert rel_err(paged, packed) <= 1e-6


def test_prefill_launchers_reject_bad_inputs() -> None:
    p = build(Case(F32, 16, 2, 2, 64, (5,), q_lens=(5,)))
    with pytest.raises(ValueError, match="cu_seqlens"):
        prefill.paged_prefill_attention(p.query, p.kv_cache, p.block_tables, p.cu_seqlens_q[:1], p.context_lens, 1.0)
    k = torch.randn(5, 3, 64, device=DEV)
    with pytest.raises(ValueError, match="multiple"):
        prefill.flash_attention_varlen(p.query, k, k, p.cu_seqlens_q, 1.0)
    with pytest.raises(ValueError, match="does not match"):
        prefill.flash_attention_varlen(p.query, k[:4, :2], k[:4, :2], p.cu_seqlens_q, 1.0)


def test_prefill_of_single_tokens_equals_decode() -> None:
    """One-token chunks are decode steps: the prefill and decode kernels agree (window and GQA included)."""
    case = Case(F32, 16, 2, 4, 64, (1, 15, 17, 40), q_lens=(1, 1, 1, 1), window=9)
    p = build(case)
    dec = attention.decode_attention(
        p.query, p.kv_cache, p.block_tables, p.context_lens, p.scale, case.window, num_splits=2
    )
    pre = prefill.paged_prefill_attention(
        p.query, p.kv_cache, p.block_tables, p.cu_seqlens_q, p.context_lens, p.scale, case.window, max_query_len=1
    )
    assert rel_err(pre, dec) <= 1e-6


_AOT_SCRIPT = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kvserve.kernels import prefill as P

fn = P._flash_prefill_kernel
names = fn.arg_names
for kv, dt, prec, paged, window, hd, (bm, bn, warps, stages) in (
    ("bf16", "bf16", None, True, False, 128, (128, 64, 8, 3)),
    ("fp16", "fp16", None, False, False, 64, (128, 128, 8, 2)),
    ("i8", "bf16", None, True, True, 128, (128, 64, 8, 3)),
    ("fp8e4nv", "fp16", None, True, False, 128, (64, 64, 4, 3)),
    ("fp32", "fp32", "ieee", True, True, 80, (64, 32, 4, 4)),
):
    types = dict(out_ptr=f"*{dt}", q_ptr=f"*{dt}", k_ptr=f"*{kv}", v_ptr=f"*{kv}", k_scale_ptr="*fp32",
                 v_scale_ptr="*fp32", block_tables_ptr="*i32", cu_seqlens_q_ptr="*i32", context_lens_ptr="*i32",
                 qk_scale="fp32", stride_kv_block="i64")
    consts = dict(GROUP=4, HEAD_DIM=hd, HEAD_DIM_PAD=triton.next_power_of_2(hd), BLOCK_SIZE=16, PAGED=paged,
                  USE_WINDOW=window, DOT_PRECISION=prec, BLOCK_M=bm, BLOCK_N=bn)
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in names}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
    ttgir = k.asm["ttgir"]
    assert "warp_group_dot" in ttgir or "tt.dot" in ttgir, ttgir[:2000]
print("compiled")
"""


def test_flash_prefill_compiles_for_cuda_sm90(tmp_path) -> None:  # noqa: ANN001
    """Ahead-of-time compile (sm_90) of the tuned tile shapes: paged bf16/int8/fp8/fp32 and contiguous fp16."""
    import os
    import pathlib
    import subprocess
    import sys

    pytest.importorskip("triton.backends.nvidia.compiler")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    root = pathlib.Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", _AOT_SCRIPT], cwd=root, env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stderr[-4000:]


# ------------------------------------------------------------------------------------------------- GPU


def _bf16_vs_fp32_reference(case: Case) -> float:
    p = build(case, "cuda", BF16)
    out = prefill.paged_prefill_attention(
        p.query, p.kv_cache, p.block_tables, p.cu_seqlens_q, p.context_lens, p.scale, case.window
    )
    ref = reference.prefill_attention(p.query.float(), p.kv_cache.float(), p.block_tables, p.cu_seqlens_q,
                                      p.context_lens, p.scale, case.window)  # fmt: skip
    assert not out.isnan().any()
    return rel_err(out, ref)


@gpu
@needs_cuda
@pytest.mark.parametrize("name", list(PAGED_CASES))
def test_paged_prefill_bf16_cuda(name: str) -> None:
    assert _bf16_vs_fp32_reference(PAGED_CASES[name]) <= TOL[BF16]


@gpu
@needs_cuda
def test_paged_prefill_autotuned_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """The autotuned launch (every fitting config timed, the best kept) on a long prefix: 300 cached tokens,
    a 200-token chunk, GQA 4, head_dim 128."""
    monkeypatch.setenv("KVSERVE_PREFILL_AUTOTUNE", "1")
    assert _bf16_vs_fp32_reference(Case(BF16, 16, 2, 4, 128, (500, 130), q_lens=(200, 130))) <= TOL[BF16]
