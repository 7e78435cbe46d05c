"""Quantized KV caches (fp8 e4m3, int8 + per-row scales) on the Triton kernels (the interpreter on CPU).

The contract (``kernels.cache_ops`` docstring, same as ``kernels.reference``) is written out once more here in
plain torch: stores are checked against it; attention against "dequantize the whole cache to fp32, then the
torch reference on that fp32 cache" (decode here; prefill's quantized cases are test_prefill_flash's
QUANT_CASES, built by ``build`` below). Shapes are tiny on purpose: the interpreter is slow.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest
import torch

from kvserve.kernels import attention, cache_ops, prefill, reference

HAS_CUDA = torch.cuda.is_available()
DEV = "cuda" if HAS_CUDA else "cpu"
FP8, INT8, F32, F16 = torch.float8_e4m3fn, torch.int8, torch.float32, torch.float16
TOL = {F32: 1e-5, F16: 2e-3}


# --------------------------------------------------------------------------------------------- the contract


def int8_grid(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [..., d] -> fp32 [..., d], fp32 [...]
    """Each row on the int8 grid before rounding: ``y = x * (127 / amax)`` (0 for a zero row), and
    ``scale = amax / 127``."""
    x = x.float()
    amax = x.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return x * inv, (amax / 127.0).squeeze(-1)


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [..., d] -> int8 [..., d], fp32 [...]
    """``q = clamp(floor(y + 0.5), -127, 127)`` (round half up), with the row's scale."""
    y, scale = int8_grid(x)
    return torch.floor(y + 0.5).clamp(-127, 127).to(INT8), scale


def to_fp8(x: torch.Tensor) -> torch.Tensor:
    """The saturating cast (a plain one turns overflow into NaN)."""
    return x.float().clamp(-448.0, 448.0).to(FP8)


def dequantize(kv_cache: torch.Tensor, kv_scales: torch.Tensor | None) -> torch.Tensor:
    """The fp32 cache an attention kernel must behave as if it read."""
    x = kv_cache.float()
    return x if kv_scales is None else x * kv_scales.unsqueeze(-1)


def raw(t: torch.Tensor) -> torch.Tensor:
    """Bits as same-width integers, on the CPU (NaN payloads and -0.0 compare exactly)."""
    return t.view({1: torch.uint8, 4: torch.int32}[t.element_size()]).cpu()


def fill_random_bytes(t: torch.Tensor, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    b = t.view(torch.uint8)
    b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, generator=gen).to(t.device))
    return t


# --------------------------------------------------------------------------------------------- store_kv

NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM = 5, 4, 3, 24  # 3 heads and 24 dims: both padded in the kernel


def store_inputs(kdt: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """key/value [9, KV_HEADS, HEAD_DIM] as strided slices of one fused projection output, and slots."""
    gen = torch.Generator().manual_seed(5)
    fused = torch.randn(9, 4 * KV_HEADS, HEAD_DIM, generator=gen) * 3
    fused[0, 2 * KV_HEADS] = 0.0  # key row of token 0, head 0: all zero -> q = 0, scale = 0
    key, value = fused[:, 2 * KV_HEADS : 3 * KV_HEADS], fused[:, 3 * KV_HEADS :]
    key[1, 1, :8] = torch.tensor([1e4, -600.0, 447.0, 17.0, 0.0, -0.0, 1e-3, 2**-10])  # saturate, round, tiny
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, generator=gen)[:9]
    slots[[3, 7]] = -1
    return key.to(kdt).to(DEV), value.to(kdt).to(DEV), slots.to(DEV)


@pytest.mark.parametrize("kdt", [F32, F16])
def test_store_fp8_is_the_saturating_cast(kdt: torch.dtype) -> None:
    key, value, slots = store_inputs(kdt)
    cache = fill_random_bytes(torch.empty(2, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype=FP8, device=DEV), 1)
    expected = raw(cache).view(2, -1, KV_HEADS, HEAD_DIM).clone()
    keep = (slots >= 0).cpu()
    for i, x in enumerate((key, value)):
        expected[i, slots.cpu()[keep]] = raw(to_fp8(x))[keep]
    cache_ops.store_kv(key, value, cache, slots)
    assert torch.equal(raw(cache).view(expected.shape), expected)  # skipped slots untouched, others exact
    stored = cache.float().view(2, -1, KV_HEADS, HEAD_DIM)[0, int(slots[1])][1, :3].tolist()
    assert stored == [448.0, -448.0, 448.0]  # saturated, not NaN; 447 rounds to the grid point 448


def test_store_int8_rounds_half_up() -> None:
    """amax = 127 makes 127 / amax exactly 1, so x * inv lands on exact .5 ties: floor(y + 0.5) rounds up."""
    row = torch.tensor([127.0, 2.5, -2.5, 0.5, -0.5, 1.5, -1.5, -127.0])
    key = row.view(1, 1, 8).to(DEV)
    cache = torch.zeros(2, 1, 1, 1, 8, dtype=INT8, device=DEV)
    scales = torch.zeros(2, 1, 1, 1, device=DEV)
    cache_ops.store_kv(key, key, cache, torch.zeros(1, dtype=torch.int64, device=DEV), kv_scales=scales)
    assert cache[0].flatten().tolist() == [127, 3, -2, 1, 0, 2, -1, -127]
    assert scales.flatten().tolist() == [1.0, 1.0]


def test_store_int8_vanishing_row_is_zero_not_nan() -> None:
    """Below amax 1e-30, 127 / amax would overflow to inf and 0 * inf make NaN: such a row stores zeros."""
    key = torch.full((1, 1, 8), 1e-38, device=DEV)
    cache = torch.ones(2, 1, 1, 1, 8, dtype=INT8, device=DEV)
    scales = torch.zeros(2, 1, 1, 1, device=DEV)
    cache_ops.store_kv(key, key, cache, torch.zeros(1, dtype=torch.int64, device=DEV), kv_scales=scales)
    assert not cache.any() and not (cache.float() * scales.unsqueeze(-1)).isnan().any()


@pytest.mark.parametrize("kdt", [F32, F16])
def test_store_int8_is_the_per_row_quantization(kdt: torch.dtype) -> None:
    key, value, slots = store_inputs(kdt)
    cache = fill_random_bytes(torch.empty(2, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype=INT8, device=DEV), 2)
    scales = torch.full((2, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS), -1.0, device=DEV)  # sentinel: "never written"
    before, before_scales = cache.clone(), scales.clone()
    cache_ops.store_kv(key, value, cache, slots, kv_scales=scales)

    flat = cache.view(2, -1, KV_HEADS, HEAD_DIM).cpu()
    flat_scales = scales.view(2, -1, KV_HEADS).cpu()
    keep = (slots >= 0).cpu()
    written = slots.cpu()[keep]
    untouched = torch.ones(flat.shape[1], dtype=torch.bool)
    untouched[written] = False
    assert torch.equal(flat[:, untouched], before.view(flat.shape).cpu()[:, untouched])
    assert torch.equal(flat_scales[:, untouched], before_scales.view(flat_scales.shape).cpu()[:, untouched])

    for i, x in enumerate((key, value)):
        x = x.float().cpu()[keep]  # [written, KV_HEADS, HEAD_DIM]
        q_want, s_want = quantize_int8(x)
        q_got, s_got = flat[i, written], flat_scales[i, written]
        assert torch.equal(s_got, s_want)  # amax / 127 is an IEEE division in both
        # q equals the formula; an fp32 rounding difference could only move an exact .5 tie by one.
        y, _ = int8_grid(x)
        near_tie = ((y - y.floor()) - 0.5).abs() < 1e-4
        diff = (q_got.int() - q_want.int()).abs()
        assert diff.max() <= 1 and not (diff.bool() & ~near_tie).any()
        err = (q_got.float() * s_got.unsqueeze(-1) - x).abs()
        assert (err <= s_got.unsqueeze(-1) / 2 + 1e-6 * x.abs().amax()).all()  # dequantized within scale / 2
    assert flat_scales[0, int(slots[0]), 0] == 0 and flat[0, int(slots[0]), 0].eq(0).all()  # the zero row


# --------------------------------------------------------------------------------------------- attention

BS, KVH, GROUP, HD = 4, 2, 2, 16  # GQA: 4 query heads on 2 KV heads


@dataclasses.dataclass(frozen=True)
class Case:
    kv_dtype: torch.dtype  # FP8 or INT8
    q_dtype: torch.dtype
    context_lens: tuple[int, ...]
    q_lens: tuple[int, ...] | None = None  # None: decode (one query per sequence)
    window: int | None = None
    num_splits: int | None = None
    scale_size: float = 0.05  # int8 scales drawn from [0, scale_size)


@dataclasses.dataclass
class Paged:
    query: torch.Tensor  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor  # [2, num_blocks, BS, KVH, HD] fp8/int8
    kv_scales: torch.Tensor | None  # [2, num_blocks, BS, KVH] fp32 (int8 only)
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    context_lens: torch.Tensor  # [num_seqs] int32
    cu_seqlens_q: torch.Tensor | None  # [num_seqs + 1] int32 (prefill only)


def build(case: Case) -> Paged:
    """A quantized pool with shuffled block tables; unused blocks are NaN (fp8 bytes or int8 scales)."""
    gen = torch.Generator().manual_seed(7)
    need = [(c + BS - 1) // BS for c in case.context_lens]
    used = sum(need)
    num_blocks = used + 5
    ids = torch.randperm(num_blocks, generator=gen)[:used]
    shape = (2, num_blocks, BS, KVH, HD)
    scales = None
    if case.kv_dtype == FP8:
        cache = torch.full(shape, 0x7F, dtype=torch.uint8).view(FP8)  # 0x7F = NaN
        cache[:, ids] = to_fp8(torch.randn(2, used, BS, KVH, HD, generator=gen) * 2)
    else:
        cache = torch.randint(-127, 128, shape, dtype=INT8, generator=gen)
        scales = torch.full(shape[:4], float("nan"))
        scales[:, ids] = torch.rand(2, used, BS, KVH, generator=gen) * case.scale_size
    table = torch.full((len(need), max(need) + 2), int(ids[0]), dtype=torch.int32)  # pad: a valid id
    start = 0
    for s, n in enumerate(need):
        table[s, :n] = ids[start : start + n]
        start += n
    q_lens = case.q_lens if case.q_lens is not None else (1,) * len(need)
    query = torch.randn(sum(q_lens), KVH * GROUP, HD, generator=gen).to(case.q_dtype)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return Paged(
        query=query.to(DEV),
        kv_cache=cache.to(DEV),
        kv_scales=None if scales is None else scales.to(DEV),
        block_tables=table.to(DEV),
        context_lens=torch.tensor(case.context_lens, dtype=torch.int32, device=DEV),
        cu_seqlens_q=cu.to(DEV) if case.q_lens is not None else None,
    )


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.float(), ref.float()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """16-token decode K/V tiles: several loop steps per program even on tiny contexts (the prefill kernel
    runs 16 x 16 tiles under the interpreter anyway)."""
    monkeypatch.setattr(attention, "DECODE_TILE_N", 16)
    yield


DECODE_CASES = {
    "fp8-f32-single": Case(FP8, F32, (1, 13, 37), num_splits=1),
    "int8-f32-split3": Case(INT8, F32, (1, 13, 37), num_splits=3),
    "int8-f16-window-split2": Case(INT8, F16, (5, 37), window=7, num_splits=2),
    "fp8-f16-window-auto": Case(FP8, F16, (5, 37), window=7),
    # A quiet layer (|x| ~ 1e-3, scale ~ 1e-5): p * scale would be an fp16 subnormal without the kernel's
    # per-tile normalisation of V's scales.
    "int8-f16-tiny-scales-split2": Case(INT8, F16, (13, 37), num_splits=2, scale_size=1e-5),
}


@pytest.mark.parametrize("name", list(DECODE_CASES))
def test_decode_equals_dequantize_then_reference(name: str) -> None:
    case = DECODE_CASES[name]
    p = build(case)
    scale = HD**-0.5
    out = attention.decode_attention(
        p.query,
        p.kv_cache,
        p.block_tables,
        p.context_lens,
        scale,
        case.window,
        num_splits=case.num_splits,
        kv_scales=p.kv_scales,
    )
    fp32_cache = dequantize(p.kv_cache, p.kv_scales)
    ref = reference.decode_attention(p.query, fp32_cache, p.block_tables, p.context_lens, scale, case.window)
    assert out.dtype == case.q_dtype and not out.isnan().any()
    assert rel_err(out, ref) <= TOL[case.q_dtype]


def test_tile_and_split_follow_the_cache_element_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 1-byte cache steps over twice the tokens per tile (the same bytes as a 16-bit cache's tile) and
    keeps twice the tokens per split; the decode launcher passes that tile to the kernel."""
    assert attention.decode_tile_n(1) == 2 * attention.decode_tile_n(2) == 2 * attention.decode_tile_n(4)
    assert attention.min_tokens_per_split(1) == 2 * attention.min_tokens_per_split(2)
    splits = {b: attention.choose_num_splits(1, 8, 32768, 16, min_tokens_per_split=attention.min_tokens_per_split(b))
              for b in (1, 2)}  # fmt: skip
    assert splits[1] >= 1 and splits[2] >= splits[1]
    assert attention.choose_num_splits(1, 8, 2048, 16, min_tokens_per_split=attention.min_tokens_per_split(1)) == 4

    seen: list[int] = []
    real = attention._paged_decode_kernel

    class Spy:
        def __getitem__(self, grid: tuple[int, ...]):  # noqa: ANN204 - a launcher, as triton's
            def launch(*args: object, **kwargs: object) -> None:
                seen.append(int(kwargs["TILE_N"]))
                real[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(attention, "_paged_decode_kernel", Spy())
    for kv_dtype in (INT8, FP8):
        p = build(Case(kv_dtype, F32, (37,), num_splits=1))
        attention.decode_attention(p.query, p.kv_cache, p.block_tables, p.context_lens, 0.25, kv_scales=p.kv_scales)
    p = build(Case(FP8, F32, (37,), num_splits=1))
    attention.decode_attention(p.query, p.kv_cache.float(), p.block_tables, p.context_lens, 0.25)
    assert seen == [32, 32, 16]  # the fixture's 16-token tile: doubled for the 1-byte caches only


def test_kv_scales_mismatch_raises() -> None:
    p = build(Case(INT8, F32, (5,)))
    tables, ctx, scale = p.block_tables, p.context_lens, 0.25
    key = torch.randn(1, KVH, HD, device=DEV)
    slot = torch.zeros(1, dtype=torch.int64, device=DEV)
    for bad, match in (
        (None, "needs kv_scales"),
        (p.kv_scales[:, :1], "kv_scales must be"),
        (p.kv_scales.double(), "kv_scales must be"),
        (p.kv_scales.transpose(2, 3).contiguous().transpose(2, 3), "contiguous"),
    ):
        with pytest.raises(ValueError, match=match):
            cache_ops.store_kv(key, key, p.kv_cache, slot, kv_scales=bad)
        with pytest.raises(ValueError, match=match):
            attention.decode_attention(p.query, p.kv_cache, tables, ctx, scale, kv_scales=bad)
    cu = torch.tensor([0, 1], dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="needs kv_scales"):
        prefill.paged_prefill_attention(p.query, p.kv_cache, tables, cu, ctx, scale)
    for cache in (p.kv_cache.to(F16), p.kv_cache.to(F32).to(FP8)):  # scales only belong to int8 caches
        with pytest.raises(ValueError, match="only for an int8"):
            cache_ops.store_kv(key, key, cache, slot, kv_scales=p.kv_scales)
        with pytest.raises(ValueError, match="only for an int8"):
            attention.decode_attention(p.query, cache, tables, ctx, scale, kv_scales=p.kv_scales)
        with pytest.raises(ValueError, match="only for an int8"):
            prefill.paged_prefill_attention(p.query, cache, tables, cu, ctx, scale, kv_scales=p.kv_scales)


# --------------------------------------------------------------------------------------------- block moves


@pytest.mark.parametrize("dtype", [FP8, INT8])
def test_copy_and_swap_move_bits_exactly(dtype: torch.dtype) -> None:
    """Caches and (4-D) int8 scales alike: copy inside the pool, swap out to a host pool and back."""
    cache = fill_random_bytes(torch.empty(2, 8, BS, KVH, HD, dtype=dtype, device=DEV), 3)  # fp8: NaN bytes too
    scales = fill_random_bytes(torch.empty(2, 8, BS, KVH, device=DEV), 4)  # any fp32 bits, NaNs included
    src, dst = torch.tensor([1, 6, 0], device=DEV), torch.tensor([5, 2, 7], device=DEV)
    host_ids, back_ids = torch.tensor([2, 0, 3]), torch.tensor([4, 3, 1], device=DEV)
    for t in (cache, scales):
        before = raw(t).clone()
        cache_ops.copy_blocks(t, src, dst)
        assert torch.equal(raw(t)[:, dst.cpu()], before[:, src.cpu()])
        host = torch.zeros((2, 4, *t.shape[2:]), dtype=t.dtype, pin_memory=HAS_CUDA)
        cache_ops.swap_blocks(t, host, src, host_ids)  # swap out
        assert torch.equal(raw(host)[:, host_ids], before[:, src.cpu()])
        cache_ops.swap_blocks(host, t, host_ids, back_ids)  # swap in, to other ids
        assert torch.equal(raw(t)[:, back_ids.cpu()], before[:, src.cpu()])


def test_fp8_swap_between_cpu_caches_without_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # host <-> host: torch indexing, which has no fp8 CPU kernels
    cache = fill_random_bytes(torch.empty(2, 6, BS, KVH, HD, dtype=FP8), 5)
    host = torch.zeros(2, 3, BS, KVH, HD, dtype=FP8)
    cache_ops.swap_blocks(cache, host, torch.tensor([4, 1]), torch.tensor([0, 2]))
    assert torch.equal(raw(host)[:, [0, 2]], raw(cache)[:, [4, 1]])


# --------------------------------------------------------------------------------------------- GPU compile

_AOT_SCRIPT = textwrap.dedent(
    """
    import sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from kvserve.kernels import attention as A, cache_ops as C

    def build(fn, types, constexprs, **opts):
        names = fn.arg_names
        sig = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in names}
        consts = {(names.index(k),): v for k, v in constexprs.items()}
        src = ASTSource(fn=fn, signature=sig, constexprs=consts)
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_stages": 2, **opts})

    scales = dict(k_scale_ptr="*fp32", v_scale_ptr="*fp32")
    store = dict(BLOCK_SIZE=16, HEAD_DIM=128, HEAD_DIM_PAD=128, BLOCK_H=8, EXACT_FP8_ROUND=False)
    ptx = {}
    for kv, key in (("i8", "bf16"), ("fp8e4nv", "fp32")):
        t = dict(key_ptr=f"*{key}", value_ptr=f"*{key}", k_cache_ptr=f"*{kv}", v_cache_ptr=f"*{kv}",
                 slot_mapping_ptr="*i64", **scales)
        ptx[kv] = build(C._store_kv_kernel, t, store, num_warps=4, enable_fp_fusion=False).asm["ptx"]
    # int8 rounds exactly as torch: IEEE divisions, no FMA contraction of x * inv + 0.5.
    assert "div.rn.f32" in ptx["i8"] and "div.full.f32" not in ptx["i8"] and "fma.rn.f32" not in ptx["i8"]
    assert "cvt.rn.satfinite.e4m3x2" in ptx["fp8e4nv"]  # the saturating hardware cast rounds on GPUs
    for kv, dt, prec in (("i8", "bf16", None), ("fp8e4nv", "fp32", "ieee")):
        t = dict(out_ptr="*fp32", lse_ptr="*fp32", q_ptr=f"*{dt}", k_cache_ptr=f"*{kv}", v_cache_ptr=f"*{kv}",
                 block_tables_ptr="*i32", context_lens_ptr="*i32", qk_scale="fp32", stride_kv_block="i64", **scales)
        build(A._paged_decode_kernel, t, dict(GROUP=4, GROUP_PAD=16, HEAD_DIM=128, HEAD_DIM_PAD=128, BLOCK_SIZE=16,
              TILE_N=128, NUM_SPLITS=8, USE_WINDOW=True, WRITE_FINAL=False, DOT_PRECISION=prec), num_warps=8)
    print("compiled")
    """
)


def test_quantized_kernels_compile_for_cuda_sm90(tmp_path: pathlib.Path) -> None:
    """Ahead-of-time compile (sm_90 = H100/H200) of the int8 and fp8 variants; no GPU needed."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # as the launchers see it; the store opts out explicitly
    root = pathlib.Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, "-c", _AOT_SCRIPT], cwd=root, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stderr[-4000:]
