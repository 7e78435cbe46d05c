"""Triton paged decode attention (kernels.attention) against the torch reference (kernels.reference), and
the case builder the prefill tests (test_prefill_flash) share.

Every case builds a NaN-poisoned block pool, fills only the blocks the block tables name (shuffled,
non-consecutive ids, optionally near the top of the pool), and NaN-poisons the output before the launch,
so reading a wrong block or leaving an output element unwritten fails the comparison.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pathlib
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest
import torch

from kvserve import kernels
from kvserve.kernels import attention, prefill, reference

HAS_CUDA = torch.cuda.is_available()
DEV = "cuda" if HAS_CUDA else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")


@dataclasses.dataclass(frozen=True)
class Case:
    """One attention test case; ``q_lens`` None means decode (one query per sequence)."""

    dtype: torch.dtype
    block_size: int
    num_kv_heads: int
    group: int
    head_dim: int
    context_lens: tuple[int, ...]
    q_lens: tuple[int, ...] | None = None
    num_splits: int | None = None
    window: int | None = None
    pool_blocks: int = 0  # 0: just enough (+ spare); else a pool this big, blocks taken near its top
    small_tiles: bool = False  # 16-token decode K/V tiles: more loop steps per program


@dataclasses.dataclass
class Paged:
    """Tensors of one built case."""

    query: torch.Tensor  # [num_tokens, num_heads, head_dim] (non-contiguous head stride)
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32 (a column slice of a wider table)
    context_lens: torch.Tensor  # [num_seqs] int32
    cu_seqlens_q: torch.Tensor | None  # [num_seqs + 1] int32 (prefill only)
    scale: float


def build(case: Case, device: str = DEV, dtype: torch.dtype | None = None, seed: int = 0) -> Paged:
    """Build a paged cache whose unused blocks are NaN, with shuffled block tables."""
    dtype = dtype or case.dtype
    gen = torch.Generator().manual_seed(seed)
    bs = case.block_size
    need = [(c + bs - 1) // bs for c in case.context_lens]
    used = sum(need)
    num_blocks = case.pool_blocks or used + 7
    # Distinct, shuffled ids; near the top of the pool when the pool is big.
    lo = num_blocks - 2 * used - 3 if case.pool_blocks else 0
    ids = (lo + torch.randperm(num_blocks - lo, generator=gen)[:used]).to(torch.int32)
    kv_cache = torch.full((2, num_blocks, bs, case.num_kv_heads, case.head_dim), float("nan"), dtype=dtype)
    kv_cache[:, ids.long()] = torch.randn(2, used, bs, case.num_kv_heads, case.head_dim, generator=gen).to(dtype)

    max_blocks = max(max(need), 1)
    table = torch.full((len(need), max_blocks + 3), int(ids[0]), dtype=torch.int32)  # pad: a valid id
    start = 0
    for s, n in enumerate(need):
        table[s, :n] = ids[start : start + n]
        start += n
    block_tables = table.to(device)[:, :max_blocks]  # non-contiguous rows (stride 0 > width)

    num_heads = case.num_kv_heads * case.group
    q_lens = case.q_lens if case.q_lens is not None else (1,) * len(need)
    wide = torch.randn(sum(q_lens), num_heads, case.head_dim + 8, generator=gen).to(dtype)
    query = wide.to(device)[..., : case.head_dim]  # [num_tokens, num_heads, head_dim], strided
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return Paged(
        query=query,
        kv_cache=kv_cache.to(device),
        block_tables=block_tables,
        context_lens=torch.tensor(case.context_lens, dtype=torch.int32, device=device),
        cu_seqlens_q=cu if case.q_lens is not None else None,
        scale=case.head_dim**-0.5,
    )


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.float(), ref.float()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


@contextlib.contextmanager
def tiles(case: Case) -> Iterator[None]:
    """Shrink the decode launcher's tile for one call (more tiles and splits per case)."""
    saved = attention.DECODE_TILE_N
    try:
        if case.small_tiles:
            attention.DECODE_TILE_N = 16
        yield
    finally:
        attention.DECODE_TILE_N = saved


def run_decode(p: Paged, case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.full(p.query.shape, float("nan"), dtype=p.query.dtype, device=p.query.device)
    with tiles(case):
        got = attention.decode_attention(
            p.query,
            p.kv_cache,
            p.block_tables,
            p.context_lens,
            p.scale,
            case.window,
            out=out,
            num_splits=case.num_splits,
        )
    assert got is out
    ref_dtype = torch.float32 if p.query.dtype == torch.bfloat16 else p.query.dtype
    ref = reference.decode_attention(
        p.query.to(ref_dtype), p.kv_cache.to(ref_dtype), p.block_tables, p.context_lens, p.scale, case.window
    )
    return out, ref


F32, F16 = torch.float32, torch.float16
# Compact on purpose (the CPU interpreter is slow): each axis is covered, not the cartesian product.
DECODE_CASES = {
    "f32-bs16-g4-single": Case(F32, 16, 2, 4, 64, (1, 15, 17, 40), num_splits=1),
    "f32-bs16-g4-split3-small-tiles": Case(F32, 16, 2, 4, 64, (1, 15, 17, 40), num_splits=3, small_tiles=True),
    "f16-bs1-g1-hd128-split2": Case(F16, 1, 2, 1, 128, (1, 15, 17), num_splits=2),
    "f32-bs32-g1-hd128-single": Case(F32, 32, 2, 1, 128, (17, 33, 1), num_splits=1),
    "f16-bs32-g8-ctx1025-auto": Case(F16, 32, 1, 8, 64, (1025,)),
    "f16-bs16-g4-window-split3": Case(F16, 16, 2, 4, 64, (1, 15, 17, 50), num_splits=3, window=8),
    "f32-bs32-g2-window-split4-small-tiles": Case(
        F32, 32, 2, 2, 64, (20, 100), num_splits=4, window=37, small_tiles=True
    ),
    "f32-bs1-g8-window-single": Case(F32, 1, 1, 8, 64, (5, 30), num_splits=1, window=16),
    "f16-bs16-g4-toppool-split2": Case(F16, 16, 1, 4, 64, (17, 40), num_splits=2, pool_blocks=1 << 13),
    "f32-bs16-g3-split8-short": Case(F32, 16, 2, 3, 64, (3, 70), num_splits=8),
}


@pytest.mark.parametrize("name", list(DECODE_CASES))
def test_decode_matches_reference(name: str) -> None:
    case = DECODE_CASES[name]
    out, ref = run_decode(build(case), case)
    assert not out.isnan().any(), "unwritten or poisoned output"
    assert rel_err(out, ref) <= TOL[case.dtype]


def test_auto_split_case_really_splits() -> None:
    case = DECODE_CASES["f16-bs32-g8-ctx1025-auto"]
    assert attention.choose_num_splits(1, case.num_kv_heads, 1025, case.block_size) > 1


def test_choose_num_splits_policy() -> None:
    # batch 1 fills the GPU by splitting a long context, short contexts stay lightly split ...
    assert attention.choose_num_splits(1, 8, 32768, 16) >= 16
    assert attention.choose_num_splits(1, 8, 512, 16) <= 2
    assert attention.choose_num_splits(1, 8, 100, 16) == 1
    # ... and big batches are not over-split.
    assert attention.choose_num_splits(256, 8, 32768, 16) == 1
    assert attention.choose_num_splits(64, 8, 32768, 32) == 1
    assert attention.choose_num_splits(0, 8, 32768, 16) == 1
    for seqs in (1, 2, 4, 16, 64, 256):
        assert 1 <= attention.choose_num_splits(seqs, 4, 4096, 16) <= attention.MAX_SPLITS


def test_empty_batch() -> None:
    case = Case(F32, 16, 2, 2, 64, (5,))
    p = build(case)
    q = p.query[:0]
    out = attention.decode_attention(q, p.kv_cache, p.block_tables[:0], p.context_lens[:0], p.scale)
    assert out.shape == (0, 4, 64)
    cu = torch.zeros(1, dtype=torch.int32, device=DEV)
    out = prefill.paged_prefill_attention(q, p.kv_cache, p.block_tables[:0], cu, p.context_lens[:0], p.scale)
    assert out.shape == (0, 4, 64)


def test_launchers_reject_bad_inputs() -> None:
    case = Case(F32, 16, 2, 2, 64, (5, 9))
    p = build(case)
    args = (p.kv_cache, p.block_tables, p.context_lens, p.scale)
    with pytest.raises(ValueError, match="head_dim"):
        attention.decode_attention(p.query[..., :32], *args)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        attention.decode_attention(p.query[:, :3], *args)
    with pytest.raises(ValueError, match="int32 or int64"):
        attention.decode_attention(p.query, p.kv_cache, p.block_tables.float(), p.context_lens, p.scale)
    with pytest.raises(ValueError, match="contiguous last"):
        attention.decode_attention(p.query.transpose(1, 2).contiguous().transpose(1, 2), *args)
    with pytest.raises(ValueError, match="sliding_window"):
        attention.decode_attention(p.query, *args, 0)
    with pytest.raises(ValueError, match="out must be"):
        attention.decode_attention(p.query, *args, out=torch.empty(2, 4, 32, device=DEV))
    with pytest.raises(ValueError, match="dtype"):
        attention.decode_attention(p.query.to(torch.int32), *args)
    with pytest.raises(ValueError, match="context_lens"):
        attention.decode_attention(p.query, p.kv_cache, p.block_tables, p.context_lens[:1], p.scale)


def test_backend_selection_returns_triton_module(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSERVE_ATTENTION_BACKEND", "triton")
    backend = kernels.get_backend("cpu")
    from kvserve.kernels import triton_backend

    assert backend is triton_backend
    assert backend.decode_attention is attention.decode_attention
    for fn in ("store_kv", "decode_attention", "prefill_attention", "copy_blocks", "swap_blocks"):
        assert callable(getattr(backend, fn))


def _huge_pool(
    block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: str, used: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A pool of more than 2**31 elements per K/V half, only its top ``used`` blocks written.

    NOTE: on CPU ``torch.empty`` maps the pool lazily, so only the touched blocks cost memory.
    """
    num_blocks = (1 << 31) // (block_size * num_kv_heads * head_dim) + used + 1
    try:
        kv_cache = torch.empty((2, num_blocks, block_size, num_kv_heads, head_dim), dtype=dtype, device=device)
    except (RuntimeError, MemoryError) as exc:  # pragma: no cover - depends on the host's overcommit policy
        pytest.skip(f"cannot map a >2**31-element pool: {exc}")
    ids = torch.arange(num_blocks - 1, num_blocks - 1 - used, -1, device=device)
    ids = ids[torch.randperm(used, device=device)]
    kv_cache[:, ids] = torch.randn(2, used, block_size, num_kv_heads, head_dim, device=device).to(dtype)
    return kv_cache, ids


def _check_huge_pool(kv_cache: torch.Tensor, ids: torch.Tensor, dtype: torch.dtype) -> None:
    device, used = kv_cache.device, ids.shape[0]
    num_kv_heads, head_dim = kv_cache.shape[3], kv_cache.shape[4]
    ref_dtype = torch.float32 if dtype == torch.bfloat16 else dtype
    context_lens = torch.tensor([used * kv_cache.shape[2] - 9, 17], dtype=torch.int32, device=device)
    tables = torch.stack([ids, ids.flip(0)]).to(torch.int32)
    small = kv_cache[:, ids].to(ref_dtype)  # the same blocks, renumbered 0..used-1 in a small pool
    small_tables = torch.stack([torch.arange(used, device=device), torch.arange(used - 1, -1, -1, device=device)])
    small_tables = small_tables.to(torch.int32)
    scale = head_dim**-0.5
    q = torch.randn(2, num_kv_heads * 4, head_dim, device=device).to(dtype)
    for splits in (1, 3):
        out = attention.decode_attention(q, kv_cache, tables, context_lens, scale, num_splits=splits)
        ref = reference.decode_attention(q.to(ref_dtype), small, small_tables, context_lens, scale)
        assert rel_err(out, ref) <= TOL[dtype]
    cu = torch.tensor([0, 5, 22], dtype=torch.int32, device=device)
    qp = torch.randn(22, num_kv_heads * 4, head_dim, device=device).to(dtype)
    out = prefill.paged_prefill_attention(qp, kv_cache, tables, cu, context_lens, scale)
    ref = reference.prefill_attention(qp.to(ref_dtype), small, small_tables, cu, context_lens, scale)
    assert rel_err(out, ref) <= TOL[dtype]


@pytest.mark.skipif(HAS_CUDA, reason="CPU interpreter variant; CUDA runs test_int64_offsets_cuda")
def test_int64_offsets_in_a_pool_over_2g_elements_cpu() -> None:
    """Block ids whose element offset exceeds 2**31: int32 offset arithmetic reads the wrong memory."""
    kv_cache, ids = _huge_pool(16, 1, 64, F16, "cpu", used=8)
    _check_huge_pool(kv_cache, ids, F16)


# Compiles every kernel ahead of time for CUDA targets (no GPU needed: triton ships ptxas), so the compiled
# path (early returns, constexpr branches, dot shapes, shared memory) is checked on CPU-only machines too.
_AOT_SCRIPT = textwrap.dedent(
    """
    import sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from kvserve.kernels import attention as A, cache_ops as C

    def build(fn, types, constexprs, arch, num_warps=4):
        names = fn.arg_names
        sig = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in names}
        consts = {(names.index(k),): v for k, v in constexprs.items()}
        src = ASTSource(fn=fn, signature=sig, constexprs=consts)
        opts = {"num_warps": num_warps, "num_stages": 2}
        return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=opts)

    arch = int(sys.argv[1])
    for dt, prec in (("bf16", None), ("fp32", "ieee")):
        for final, splits in ((True, 1), (False, 8)):
            t = dict(out_ptr=f"*{dt}" if final else "*fp32", lse_ptr="*fp32", q_ptr=f"*{dt}",
                     k_cache_ptr=f"*{dt}", v_cache_ptr=f"*{dt}", block_tables_ptr="*i32",
                     context_lens_ptr="*i32", qk_scale="fp32", stride_kv_block="i64")
            build(A._paged_decode_kernel, t, dict(GROUP=4, GROUP_PAD=16, HEAD_DIM=128, HEAD_DIM_PAD=128,
                  BLOCK_SIZE=16, TILE_N=64, NUM_SPLITS=splits, USE_WINDOW=not final, WRITE_FINAL=final,
                  DOT_PRECISION=prec), arch)
    build(A._merge_splits_kernel, dict(out_ptr="*bf16", partial_ptr="*fp32", lse_ptr="*fp32"),
          dict(HEAD_DIM=128, HEAD_DIM_PAD=128, NUM_SPLITS=5, SPLITS_PAD=8), arch, num_warps=2)
    build(C._store_kv_kernel, dict(key_ptr="*fp32", value_ptr="*fp32", k_cache_ptr="*bf16",
          v_cache_ptr="*bf16", slot_mapping_ptr="*i64"),
          dict(BLOCK_SIZE=16, HEAD_DIM=128, HEAD_DIM_PAD=128, BLOCK_H=8, EXACT_FP8_ROUND=False), arch)
    build(C._copy_blocks_kernel, dict(src_ptr="*i16", dst_ptr="*i16", src_ids_ptr="*i64", dst_ids_ptr="*i64",
          stride_src_block="i64"), dict(BLOCK_NUMEL=16384, CHUNK=2048), arch)
    print("compiled")
    """
)


def test_kernels_compile_for_cuda_sm90(tmp_path: pathlib.Path) -> None:
    """Ahead-of-time compile (to cubin, for sm_90 = H100/H200) of every kernel and its main variants."""
    arch = 90
    pytest.importorskip("triton.backends.nvidia.compiler")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    root = pathlib.Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, "-c", _AOT_SCRIPT, str(arch)],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stderr[-4000:]


# ------------------------------------------------------------------------------------------------- GPU


@gpu
@needs_cuda
@pytest.mark.parametrize("name", list(DECODE_CASES))
def test_decode_bf16_cuda(name: str) -> None:
    case = DECODE_CASES[name]
    out, ref = run_decode(build(case, "cuda", torch.bfloat16), case)
    assert not out.isnan().any()
    assert rel_err(out, ref) <= TOL[torch.bfloat16]


@gpu
@needs_cuda
def test_int64_offsets_cuda() -> None:
    """Same as the CPU variant, compiled, bf16, 8 KV heads x 128 (a ~8.6 GB pool)."""
    kv_cache, ids = _huge_pool(16, 8, 128, torch.bfloat16, "cuda", used=63)
    _check_huge_pool(kv_cache, ids, torch.bfloat16)
