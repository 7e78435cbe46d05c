"""The C++ CPU kernels (``kvserve/kernels/csrc/cpu_ops.cpp``) against the plain-torch reference, and the fallback.

Where a C++ compiler exists on an AVX2 machine the build must be there (``make setup`` builds it): a
missing build fails here instead of silently running the slow path everywhere.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest
import torch

from kvserve.kernels import cpu_backend, cpu_ext, reference

X86_AVX2 = platform.machine().lower() in ("x86_64", "amd64") and torch.backends.cpu.get_cpu_capability() in (
    "AVX2",
    "AVX512",
)
needs_ext = pytest.mark.skipif(
    not cpu_ext.available(), reason=f"C++ CPU kernels not usable here: {cpu_ext.unusable_reason()}"
)


def test_the_build_is_there_where_it_can_be() -> None:
    if not (X86_AVX2 and cpu_ext._compiler()):
        pytest.skip("no C++ compiler or no AVX2: the engine runs the plain-torch kernels")
    if os.environ.get("KVSERVE_CPU_EXT", "1") == "0":
        pytest.skip("KVSERVE_CPU_EXT=0")
    if torch.cuda.is_available() and not cpu_ext.library_path().exists():
        # NOTE: a CUDA machine's engine runs the Triton kernels; a checkout run there without `make setup`
        # (gpu_check.sh) has no CPU build, and that is not a defect. A build that exists must still load.
        pytest.skip(f"CUDA machine without a C++ CPU build ({cpu_ext.library_path()}): the engine runs Triton")
    assert cpu_ext.available(), cpu_ext.unusable_reason()


def _paged_case(seed: int, num_seqs: int, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                max_len: int) -> tuple[torch.Tensor, ...]:  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, max_len + 1, (num_seqs,), generator=g, dtype=torch.int32)
    width = int((lens.max() + block_size - 1) // block_size)
    num_blocks = num_seqs * width + 3
    # Each sequence gets its own shuffled blocks: reads must follow the table, not the layout.
    tables = torch.randperm(num_blocks, generator=g)[: num_seqs * width].view(num_seqs, width).int()
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    # A strided query, as the model passes it (a view of the fused q|k|v projection).
    qkv = torch.randn(num_seqs, (num_heads + 2 * num_kv_heads) * head_dim, generator=g)
    query = qkv[:, : num_heads * head_dim].view(num_seqs, num_heads, head_dim)
    return query, kv_cache, tables, lens


@needs_ext
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim,block_size,max_len",
    [
        (8, 2, 32, 4, 300),  # the tiny bench model's shape
        (9, 3, 64, 4, 200),  # SmolLM2-135M
        (12, 4, 64, 16, 70),
        (4, 4, 128, 1, 40),  # MHA, block size 1
        (6, 2, 96, 8, 33),
        (4, 2, 48, 4, 50),  # a head_dim without a vector path
        (2, 1, 16, 2, 9),  # contexts shorter than a group of eight tokens
    ],
)
@pytest.mark.parametrize("sliding_window", [None, 5])
def test_paged_decode_attention_matches_reference(
    num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, max_len: int, sliding_window: int | None
) -> None:
    query, kv_cache, tables, lens = _paged_case(0, 11, num_heads, num_kv_heads, head_dim, block_size, max_len)
    want = reference.decode_attention(query, kv_cache, tables, lens, 0.125, sliding_window)
    got = torch.ops.kvserve_cpu.paged_decode_attention(query, kv_cache, tables, lens, 0.125, sliding_window or 0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # The backend entry point routes here, and threads do not change the result.
    torch.testing.assert_close(cpu_backend.decode_attention(query, kv_cache, tables, lens, 0.125, sliding_window), got)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = torch.ops.kvserve_cpu.paged_decode_attention(query, kv_cache, tables, lens, 0.125, sliding_window or 0)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(single, got)


@needs_ext
def test_paged_decode_attention_rejects_bad_tables() -> None:
    query, kv_cache, tables, lens = _paged_case(1, 3, 4, 2, 32, 4, 20)
    op = torch.ops.kvserve_cpu.paged_decode_attention
    bad = tables.clone()
    bad[0, 0] = kv_cache.shape[1]  # one past the last block
    with pytest.raises(RuntimeError, match="out of range"):
        op(query, kv_cache, bad, lens, 1.0, 0)
    with pytest.raises(RuntimeError, match="context length"):
        op(query, kv_cache, tables, torch.zeros_like(lens), 1.0, 0)
    with pytest.raises(RuntimeError, match="context length"):
        op(query, kv_cache, tables, lens + tables.shape[1] * 4, 1.0, 0)
    with pytest.raises(RuntimeError, match="int32"):
        op(query, kv_cache, tables.long(), lens, 1.0, 0)


def _rope_case(num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(num_tokens)
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=g)
    angles = torch.rand(num_tokens, 1, head_dim // 2, generator=g) * 100
    emb = torch.cat((angles, angles), dim=-1)
    sin = emb.sin()
    signed_sin = torch.cat((-sin[..., : head_dim // 2], sin[..., head_dim // 2 :]), dim=-1)
    return qkv, emb.cos(), signed_sin


@needs_ext
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(8, 2, 32), (9, 3, 64), (4, 4, 128), (2, 1, 6)])
def test_rope_store_kv_is_bit_exact(num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    """Rope rounds exactly as the reference (HF's formula): same bits in q, k and the cache."""
    num_tokens, num_blocks, block_size = 37, 16, 4
    qkv, cos, signed_sin = _rope_case(num_tokens, num_heads, num_kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=torch.Generator().manual_seed(3))[:num_tokens]
    slots[::5] = -1  # skipped (already cached) tokens
    want_cache = torch.zeros(2, num_blocks, block_size, num_kv_heads, head_dim)
    got_cache = want_cache.clone()
    want = reference.rope_store_kv(qkv.clone(), cos, signed_sin, want_cache, slots, num_heads, num_kv_heads)
    got = cpu_backend.rope_store_kv(qkv.clone(), cos, signed_sin, got_cache, slots, num_heads, num_kv_heads)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(got_cache, want_cache)
    written = got_cache.view(2, num_blocks * block_size, -1).abs().sum(-1) != 0
    assert int(written[0].sum()) == int(written[1].sum()) == int((slots >= 0).sum())  # skipped slots untouched


@needs_ext
def test_rope_store_kv_rejects_a_slot_past_the_cache() -> None:
    qkv, cos, signed_sin = _rope_case(3, 2, 1, 8)
    cache = torch.zeros(2, 2, 2, 1, 8)
    with pytest.raises(RuntimeError, match="out of range"):
        torch.ops.kvserve_cpu.rope_store_kv(qkv, cos, signed_sin, cache, torch.tensor([0, 1, 4]), 2, 1)
    assert not cache.any()  # checked before anything was written


def test_backend_falls_back_to_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the build (or for dtypes it does not cover) the CPU backend is the reference, exactly."""
    monkeypatch.setattr(cpu_ext, "available", lambda: False)
    query, kv_cache, tables, lens = _paged_case(2, 5, 4, 2, 32, 4, 30)
    want = reference.decode_attention(query, kv_cache, tables, lens, 0.5)
    assert torch.equal(cpu_backend.decode_attention(query, kv_cache, tables, lens, 0.5), want)
    qkv, cos, signed_sin = _rope_case(5, 4, 2, 32)
    slots = torch.arange(5)
    a, b = torch.zeros(2, 4, 4, 2, 32), torch.zeros(2, 4, 4, 2, 32)
    got = cpu_backend.rope_store_kv(qkv.clone(), cos, signed_sin, a, slots, 4, 2)
    want = reference.rope_store_kv(qkv.clone(), cos, signed_sin, b, slots, 4, 2)
    assert all(torch.equal(x, y) for x, y in zip(got, want, strict=True)) and torch.equal(a, b)


def test_disabled_by_environment() -> None:
    code = "from kvserve.kernels import cpu_ext; print(cpu_ext.available(), cpu_ext.unusable_reason())"
    env = {**os.environ, "KVSERVE_CPU_EXT": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False disabled by KVSERVE_CPU_EXT=0"


@needs_ext
@pytest.mark.parametrize("rows,hidden,vocab", [(64, 256, 32000), (7, 64, 1001), (1, 48, 16), (13, 96, 50)])
def test_lm_head_matches_torch(rows: int, hidden: int, vocab: int) -> None:
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(vocab, hidden, generator=g) * 0.05
    h = torch.randn(rows, hidden, generator=g)
    packed = cpu_backend.pack_weight(weight)
    want = torch.nn.functional.linear(h, weight)
    logits = cpu_backend.packed_linear(h, packed, vocab)
    torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)
    # The argmax is that of the kernel's own logits, lowest id on ties.
    assert torch.equal(cpu_backend.lm_head_argmax(h, packed, vocab), logits.argmax(dim=-1))


@needs_ext
def test_lm_head_argmax_ties_take_the_lowest_id() -> None:
    weight = torch.zeros(40, 8)
    weight[[3, 17, 33]] = 1.0  # three identical rows: equal logits, across panels
    h = torch.ones(2, 8)
    packed = cpu_backend.pack_weight(weight)
    assert cpu_backend.lm_head_argmax(h, packed, 40).tolist() == [3, 3]
    assert cpu_backend.lm_head_argmax(-h, packed, 40).tolist() == [0, 0]  # the zero rows win, first one


@needs_ext
def test_lm_head_rejects_mismatched_shapes() -> None:
    packed = cpu_backend.pack_weight(torch.randn(20, 8))
    with pytest.raises(RuntimeError, match="hidden size"):
        cpu_backend.lm_head_argmax(torch.randn(2, 9), packed, 20)
    with pytest.raises(RuntimeError, match="does not fit"):
        cpu_backend.packed_linear(torch.randn(2, 8), packed, 33)
