"""Triton cache ops (kernels.cache_ops) against the torch reference, compared bit for bit."""

from __future__ import annotations

import pytest
import torch

from kvserve.kernels import cache_ops, reference

HAS_CUDA = torch.cuda.is_available()
DEV = "cuda" if HAS_CUDA else "cpu"
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_BITS[t.element_size()])


def assert_bits_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype
    assert torch.equal(bits(a).cpu(), bits(b).cpu())


def random_cache(
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: str = DEV,
    seed: int = 0,
) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    cache[0, 0, 0, 0, :2] = float("nan")  # a NaN payload must survive a copy bit-exactly
    cache[1, 0, 0, 0, 0] = -0.0
    return cache.to(device)


# (key dtype, cache dtype, block_size, num_kv_heads, head_dim)
STORE_CASES = [
    (F16, F16, 16, 4, 64),
    (F32, F32, 1, 2, 128),
    (F32, F16, 32, 8, 64),  # converts on store
    (BF16, BF16, 16, 2, 64),  # same dtype: moved as bits, so bf16 runs under the interpreter too
]


@pytest.mark.parametrize(("kdt", "cdt", "block_size", "kvh", "hd"), STORE_CASES)
def test_store_kv_matches_reference(
    kdt: torch.dtype, cdt: torch.dtype, block_size: int, kvh: int, hd: int
) -> None:
    gen = torch.Generator().manual_seed(1)
    num_blocks, num_tokens = 40, 37
    cache = random_cache(num_blocks, block_size, kvh, hd, cdt)
    # key/value as strided slices of one fused [tokens, q + k + v heads, hd] projection output.
    fused = torch.randn(num_tokens, 2 * kvh + 3 * kvh, hd, generator=gen).to(kdt).to(DEV)
    key, value = fused[:, 3 * kvh : 4 * kvh], fused[:, 4 * kvh :]
    perm = torch.randperm(num_blocks * block_size, generator=gen)
    last = num_blocks * block_size - 1
    # NOTE: slots must be distinct (two tokens on one slot race on a GPU: the winner is unspecified), so the
    # very last slot is swapped into token 1 rather than written over it (block_size 1: 37 of 40 slots drawn).
    perm = torch.cat([perm[perm != last][:1], torch.tensor([last]), perm[perm != last][1:]])
    slots = perm[:num_tokens].clone()
    slots[::5] = -1  # skipped tokens (token 1, the last slot, is kept)
    kept = slots[slots >= 0]
    assert kept.unique().numel() == kept.numel() and int(slots[1]) == last
    slot_mapping = slots.to(DEV)
    expected = cache.clone()
    reference.store_kv(key, value, expected, slot_mapping)
    cache_ops.store_kv(key, value, cache, slot_mapping)
    assert_bits_equal(cache, expected)


def test_store_kv_all_skipped_and_empty() -> None:
    cache = random_cache(4, 16, 2, 64, F16)
    before = cache.clone()
    key = torch.randn(3, 2, 64, device=DEV).half()
    cache_ops.store_kv(key, key, cache, torch.full((3,), -1, dtype=torch.int64, device=DEV))
    cache_ops.store_kv(key[:0], key[:0], cache, torch.empty(0, dtype=torch.int64, device=DEV))
    assert_bits_equal(cache, before)


@pytest.mark.parametrize(("dtype", "block_size"), [(F16, 16), (F32, 1), (BF16, 32)])
def test_copy_blocks_matches_reference(dtype: torch.dtype, block_size: int) -> None:
    cache = random_cache(24, block_size, 2, 64, dtype)
    gen = torch.Generator().manual_seed(2)
    perm = torch.randperm(24, generator=gen)
    src, dst = perm[:7].to(DEV), perm[7:14].to(DEV)
    src[0] = 0  # carries the NaN payload and the -0.0
    expected = cache.clone()
    reference.copy_blocks(expected, src, dst)
    cache_ops.copy_blocks(cache, src, dst)
    assert_bits_equal(cache, expected)


def _round_trip(device_cache: torch.Tensor, host: torch.Tensor) -> None:
    gen = torch.Generator().manual_seed(3)
    n = 9
    dev_ids = torch.randperm(device_cache.shape[1], generator=gen)[:n]
    host_ids = torch.randperm(host.shape[1], generator=gen)[:n]
    original = device_cache[:, dev_ids.to(device_cache.device)].clone()
    expected_host = host.clone()
    reference.swap_blocks(device_cache, expected_host, dev_ids, host_ids)
    cache_ops.swap_blocks(device_cache, host, dev_ids, host_ids)  # swap out
    assert_bits_equal(host, expected_host)
    device_cache[:, dev_ids.to(device_cache.device)] = float("nan")  # the blocks were freed and reused
    back_ids = dev_ids.flip(0)
    cache_ops.swap_blocks(host, device_cache, host_ids, back_ids)  # swap in, to other ids
    assert_bits_equal(device_cache[:, back_ids.to(device_cache.device)], original)


@pytest.mark.parametrize("dtype", [F16, F32, BF16])
def test_swap_round_trip_is_bit_exact(dtype: torch.dtype) -> None:
    device_cache = random_cache(20, 16, 2, 64, dtype)
    host = torch.full((2, 12, 16, 2, 64), float("nan"), dtype=dtype, pin_memory=HAS_CUDA)
    _round_trip(device_cache, host)


def test_swap_between_cpu_caches_without_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # host <-> host falls back to torch indexing
    _round_trip(random_cache(20, 16, 2, 64, F16, device="cpu"), torch.zeros(2, 12, 16, 2, 64, dtype=F16))


@pytest.mark.skipif(HAS_CUDA, reason="CPU interpreter variant; CUDA runs test_int64_offsets_cache_ops_cuda")
def test_int64_offsets_cache_ops_cpu() -> None:
    _check_huge_pool("cpu", F16, 16, 1, 64)


def _check_huge_pool(device: str, dtype: torch.dtype, block_size: int, kvh: int, hd: int) -> None:
    """Store, copy and swap on blocks whose element offsets exceed 2**31 (int32 arithmetic would fail)."""
    num_blocks = (1 << 31) // (block_size * kvh * hd) + 16
    try:
        cache = torch.empty((2, num_blocks, block_size, kvh, hd), dtype=dtype, device=device)
    except (RuntimeError, MemoryError) as exc:  # pragma: no cover - depends on the host's overcommit policy
        pytest.skip(f"cannot map a >2**31-element pool: {exc}")
    top = torch.arange(num_blocks - 8, num_blocks, device=device)
    cache[:, top] = 0
    key = torch.randn(5, kvh, hd, device=device).to(dtype)
    value = torch.randn(5, kvh, hd, device=device).to(dtype)
    slots = (num_blocks - 1) * block_size + torch.tensor([0, 3, -1, 15, 7], device=device)
    slots[2] = -1
    cache_ops.store_kv(key, value, cache, slots)
    keep = slots >= 0
    offsets = slots[keep] % block_size
    assert_bits_equal(cache[0, num_blocks - 1, offsets], key[keep])
    assert_bits_equal(cache[1, num_blocks - 1, offsets], value[keep])
    src = torch.tensor([num_blocks - 1, num_blocks - 2], device=device)
    dst = torch.tensor([num_blocks - 3, num_blocks - 4], device=device)
    cache_ops.copy_blocks(cache, src, dst)
    assert_bits_equal(cache[:, dst], cache[:, src])
    host = torch.zeros((2, 4, block_size, kvh, hd), dtype=dtype, pin_memory=device == "cuda")
    cache_ops.swap_blocks(cache, host, src, torch.tensor([2, 0]))
    assert_bits_equal(host[:, torch.tensor([2, 0])], cache[:, src].cpu())
    cache_ops.swap_blocks(host, cache, torch.tensor([2, 0]), torch.tensor([num_blocks - 5, num_blocks - 6]))
    assert_bits_equal(cache[:, torch.tensor([num_blocks - 5, num_blocks - 6], device=device)], cache[:, src])


def test_cache_ops_reject_bad_inputs() -> None:
    cache = random_cache(4, 16, 2, 64, F16)
    key = torch.randn(3, 2, 64, device=DEV).half()
    slots = torch.arange(3, device=DEV)
    with pytest.raises(ValueError, match="key must be"):
        cache_ops.store_kv(key[:, :1], key, cache, slots)
    with pytest.raises(ValueError, match="disagree"):
        cache_ops.store_kv(key, key, cache, slots[:2])
    with pytest.raises(ValueError, match="int32 or int64"):
        cache_ops.store_kv(key, key, cache, slots.float())
    with pytest.raises(ValueError, match="contiguous blocks"):
        cache_ops.store_kv(key, key, cache.transpose(3, 4).contiguous().transpose(3, 4), slots)
    with pytest.raises(ValueError, match="equally long"):
        cache_ops.copy_blocks(cache, slots, slots[:2])
    other = random_cache(4, 16, 2, 64, F32)
    with pytest.raises(ValueError, match="dtypes differ"):
        cache_ops.swap_blocks(cache, other, slots[:1], slots[:1])
    with pytest.raises(ValueError, match="block shapes differ"):
        cache_ops.swap_blocks(cache, random_cache(4, 8, 2, 64, F16), slots[:1], slots[:1])


# ------------------------------------------------------------------------------------------------- GPU


@gpu
@needs_cuda
@pytest.mark.parametrize(("kdt", "cdt"), [(BF16, BF16), (F32, BF16), (BF16, F16)])
def test_store_kv_bf16_cuda(kdt: torch.dtype, cdt: torch.dtype) -> None:
    cache = random_cache(40, 16, 8, 128, cdt, device="cuda")
    key = torch.randn(33, 8, 128, device="cuda").to(kdt)
    value = torch.randn(33, 8, 128, device="cuda").to(kdt)
    slots = torch.randperm(640, device="cuda")[:33]
    slots[::4] = -1
    expected = cache.clone()
    reference.store_kv(key, value, expected, slots)
    cache_ops.store_kv(key, value, cache, slots)
    assert_bits_equal(cache, expected)


@gpu
@needs_cuda
def test_swap_cuda_pinned_round_trip_bf16() -> None:
    device_cache = random_cache(64, 16, 8, 128, BF16, device="cuda")
    host = torch.zeros((2, 32, 16, 8, 128), dtype=BF16, pin_memory=True)
    _round_trip(device_cache, host)
    # same-device swap (GPU pool -> GPU pool) takes the Triton path
    other = torch.zeros_like(device_cache)
    ids = torch.randperm(64, device="cuda")[:10]
    cache_ops.swap_blocks(device_cache, other, ids, ids.flip(0))
    assert_bits_equal(other[:, ids.flip(0)], device_cache[:, ids])


@gpu
@needs_cuda
def test_int64_offsets_cache_ops_cuda() -> None:
    _check_huge_pool("cuda", BF16, 16, 8, 128)
