"""Triton cache ops over the fixed KV layout: store K/V by slot, copy blocks, swap blocks.

KV cache, one tensor per layer (docs/architecture.md): ``[2, num_blocks, block_size, num_kv_heads, head_dim]``;
``slot = block_id * block_size + offset``; a negative slot is skipped.

Quantized caches (same contract as ``kernels.reference``):
    fp8 (``torch.float8_e4m3fn``)  stored value = ``x.float().clamp(-448, 448)`` cast to fp8; no scales.
    int8                           per (token, KV head) row ``x`` (fp32): ``amax = max|x|``,
                                   ``scale = amax / 127``, ``q = clamp(floor(x * (127 / amax) + 0.5), ±127)``
                                   (``q = 0, scale = 0`` when ``amax == 0``); the scales live in
                                   ``kv_scales: [2, num_blocks, block_size, num_kv_heads]`` fp32, and a
                                   reader dequantizes ``q.float() * scale``.

Kernels
    ``_store_kv_kernel``     grid (token, kv-head tile): scatter one token's K and V into its slot
                             (quantizing for fp8/int8 caches).
    ``_copy_blocks_kernel``  grid (pair, K|V, chunk): copy whole blocks between two caches on one device
                             (``copy_blocks`` passes the same cache twice).

Launchers have the signatures of their torch twins in ``kernels.reference``.

NOTE: block copies move raw bits (the caches are reinterpreted as same-width integers), so they are
bit-exact for every dtype (NaN payloads, -0.0) and also run under the CPU interpreter for bf16.
NOTE: offsets are int64: ``block_id * stride_block`` overflows int32 in big pools.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from kvserve.kernels import reference, triton_interpreting

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INDEX_DTYPES = (torch.int32, torch.int64)
_BITS_DTYPE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
FP8 = torch.float8_e4m3fn
# NOTE: constexpr so the jitted helpers may read them (Triton rejects plain Python globals).
_FP8_MAX = tl.constexpr(448.0)  # largest finite float8_e4m3fn
_INT8_MAX = tl.constexpr(127.0)  # symmetric int8 range [-127, 127] (-128 unused)
_INT8_MIN_AMAX = tl.constexpr(1e-30)  # rows quieter than this quantize to zero (127 / amax would overflow)
KV_CACHE_DTYPES = (*_FLOAT_DTYPES, FP8, torch.int8)

COPY_CHUNK = 2048  # elements per program of a block copy


# --------------------------------------------------------------------------------------------- kernels


@triton.jit
def _saturate_fp8(x):
    """``x`` in fp32, clamped to the finite fp8 range (a plain cast would turn overflow into NaN) and rounded
    to the nearest float8_e4m3fn value (ties to even), so the cast to fp8 that follows is exact.

    NOTE: GPUs round that cast correctly (``cvt.rn.satfinite``), so the store uses this only under the
    interpreter, which does not (a rounding carry is lost when the exponent is odd, halving the value, and
    ties round away from zero): rounding here keeps the interpreter bit-identical to torch.
    """
    x = tl.clamp(x.to(tl.float32), -_FP8_MAX, _FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
    a = tl.abs(x)
    bits = a.to(tl.int32, bitcast=True)
    # Normal e4m3 (|x| >= 2^-6): keep 3 of fp32's 23 mantissa bits, ties to even; a carry bumps the exponent.
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -(1 << 20)).to(tl.float32, bitcast=True)
    # Subnormal e4m3 (|x| < 2^-6): multiples of 2^-9. Adding 2^14 (fp32 ulp 2^-9 there) rounds ties to even.
    subnormal = (a + 16384.0) - 16384.0
    r = tl.where(a < 0.015625, subnormal, normal)
    return tl.where(x.to(tl.int32, bitcast=True) < 0, -r, r)  # the sign bit, so -0.0 stays -0.0


@triton.jit
def _quantize_int8_rows(x):
    """Symmetric per-row int8: ``x [rows, cols]`` -> (``q [rows, cols]`` int8, ``scale [rows]`` fp32).

    ``q = clamp(floor(x * (127 / amax) + 0.5), -127, 127)``, ``scale = amax / 127``; an all-zero row gives
    ``q = 0, scale = 0``. NOTE: both divisions are IEEE-rounded (``div_rn``; a plain ``/`` is approximate
    on NVIDIA GPUs) and the launch disables FMA contraction, so every value rounds exactly as in the torch
    reference (which computes the same formula op by op).
    """
    x = x.to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)  # [rows]
    nonzero = amax > _INT8_MIN_AMAX  # below it 127 / amax overflows: treat the row as zero
    inv = tl.where(nonzero, tl.math.div_rn(_INT8_MAX, tl.where(nonzero, amax, 1.0)), 0.0)  # [rows]
    q = tl.clamp(tl.floor(x * inv[:, None] + 0.5), -_INT8_MAX, _INT8_MAX)
    return q.to(tl.int8), tl.math.div_rn(amax, _INT8_MAX)


@triton.jit
def _store_kv_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]  (kv_cache[0])
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]  (kv_cache[1])
    k_scale_ptr,  # [num_blocks, block_size, num_kv_heads] fp32 (kv_scales[0]); written only for an int8 cache
    v_scale_ptr,  # [num_blocks, block_size, num_kv_heads] fp32 (kv_scales[1]); written only for an int8 cache
    slot_mapping_ptr,  # [num_tokens] int32/int64, negative = skip
    num_kv_heads,
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_c_block,
    stride_c_slot,
    stride_c_head,
    stride_s_block,  # scales' block stride (head stride 1)
    stride_s_slot,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,  # KV heads per program (power of two)
    EXACT_FP8_ROUND: tl.constexpr,  # round to the fp8 grid in integer ops first (interpreter: _saturate_fp8)
):
    """One program = one token x BLOCK_H KV heads.

    Contract: ``0 <= slot < num_blocks * block_size`` for every non-negative slot (not checked on device);
    a negative slot writes nothing. The cache's element type picks the store: K/V cast to it (float),
    saturated to +-448 and rounded first (fp8), or quantized per (token, KV head) row with the row's scale
    stored alongside (int8). NOTE: an int8 element type always means a quantized cache here: the launcher's
    same-width integer views (bit moves) are only taken for 2- and 4-byte float caches.
    """
    cache_ty = k_cache_ptr.dtype.element_ty
    tok = tl.program_id(0).to(tl.int64)
    head_tile = tl.program_id(1)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE

    offs_h = head_tile * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    offs_d = tl.arange(0, HEAD_DIM_PAD)  # [HEAD_DIM_PAD]
    h_mask = offs_h < num_kv_heads
    mask = h_mask[:, None] & (offs_d < HEAD_DIM)[None, :]
    heads = offs_h.to(tl.int64)[:, None]

    # NOTE: other=0 keeps padded head_dim lanes out of the int8 row maximum.
    k = tl.load(key_ptr + tok * stride_k_tok + heads * stride_k_head + offs_d[None, :], mask=mask, other=0)
    v = tl.load(value_ptr + tok * stride_v_tok + heads * stride_v_head + offs_d[None, :], mask=mask, other=0)
    if cache_ty == tl.float8e4nv:
        if EXACT_FP8_ROUND:
            k = _saturate_fp8(k)
            v = _saturate_fp8(v)
        else:
            # GPUs: clamp, then the hardware cast (cvt.rn.satfinite: nearest-even, finite) does the rounding.
            k = tl.clamp(k.to(tl.float32), -_FP8_MAX, _FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
            v = tl.clamp(v.to(tl.float32), -_FP8_MAX, _FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
    if cache_ty == tl.int8:
        k, k_scale = _quantize_int8_rows(k)
        v, v_scale = _quantize_int8_rows(v)
        s_dst = block * stride_s_block + offset * stride_s_slot + offs_h  # [BLOCK_H]
        tl.store(k_scale_ptr + s_dst, k_scale, mask=h_mask)
        tl.store(v_scale_ptr + s_dst, v_scale, mask=h_mask)
    dst = block * stride_c_block + offset * stride_c_slot + heads * stride_c_head + offs_d[None, :]
    tl.store(k_cache_ptr + dst, k.to(cache_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(cache_ty), mask=mask)


@triton.jit
def _copy_blocks_kernel(
    src_ptr,  # [2, num_src_blocks, BLOCK_NUMEL] (inner block contiguous)
    dst_ptr,  # [2, num_dst_blocks, BLOCK_NUMEL]
    src_ids_ptr,  # [n] int32/int64
    dst_ids_ptr,  # [n] int32/int64
    stride_src_kv,
    stride_src_block,
    stride_dst_kv,
    stride_dst_block,
    BLOCK_NUMEL: tl.constexpr,  # block_size * num_kv_heads * head_dim
    CHUNK: tl.constexpr,  # elements per program (power of two)
):
    """One program = one chunk of K or V of one (src block -> dst block) pair; a raw element copy.

    Contract: ids are in range; destination ids are distinct (else the winner is unspecified), and a
    destination block is not also a source block of the same launch.
    """
    pair = tl.program_id(0)
    kv = tl.program_id(1).to(tl.int64)
    chunk = tl.program_id(2)
    src_block = tl.load(src_ids_ptr + pair).to(tl.int64)
    dst_block = tl.load(dst_ids_ptr + pair).to(tl.int64)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)  # [CHUNK]
    mask = offs < BLOCK_NUMEL
    x = tl.load(src_ptr + kv * stride_src_kv + src_block * stride_src_block + offs, mask=mask)
    tl.store(dst_ptr + kv * stride_dst_kv + dst_block * stride_dst_block + offs, x, mask=mask)


# --------------------------------------------------------------------------------------------- checks


def _triton_runs_on(device: torch.device) -> bool:
    return device.type == "cuda" or (device.type == "cpu" and triton_interpreting())


def _check_cache(name: str, cache: torch.Tensor, what: str = "kv_cache") -> None:
    if cache.dim() != 5 or cache.shape[0] != 2:
        raise ValueError(
            f"{name}: {what} must be [2, num_blocks, block_size, num_kv_heads, head_dim], "
            f"got {tuple(cache.shape)}"
        )
    _, _, block_size, num_kv_heads, head_dim = cache.shape
    if cache.stride(4) != 1 or cache.stride(3) != head_dim or cache.stride(2) != num_kv_heads * head_dim:
        raise ValueError(
            f"{name}: {what} needs contiguous blocks (strides of the last three dims "
            f"{(num_kv_heads * head_dim, head_dim, 1)}), got {cache.stride()[2:]}"
        )


def _check_blocks(name: str, t: torch.Tensor, what: str) -> None:
    """``[2, num_blocks, *block]`` with contiguous blocks: a KV cache (5-D) or its int8 ``kv_scales`` (4-D)."""
    if t.dim() < 3 or t.shape[0] != 2:
        raise ValueError(
            f"{name}: {what} must be [2, num_blocks, *block] (a KV cache or its kv_scales), got {tuple(t.shape)}"
        )
    block = t.shape[2:]
    contiguous = [math.prod(block[i + 1 :]) for i in range(len(block))]
    if any(t.stride(2 + i) != s for i, s in enumerate(contiguous) if block[i] > 1):
        raise ValueError(
            f"{name}: {what} needs contiguous blocks (strides of the dims after num_blocks {tuple(contiguous)}), "
            f"got {t.stride()[2:]}"
        )


@functools.lru_cache(maxsize=16)
def _fp8_supported(device: torch.device) -> bool:
    # NOTE: Triton converts float8e4nv only on compute capability >= 8.9 (Ada, Hopper); older GPUs would fail
    # at kernel compile time with a less helpful message.
    return device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 9)


def check_kv_quantization(name: str, kv_cache: torch.Tensor, kv_scales: torch.Tensor | None) -> None:
    """Check the cache dtype and the ``kv_scales`` contract (shared by the store and attention launchers).

    Args:
        name: the launcher, for messages.
        kv_cache: ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (shape checked by the caller).
        kv_scales: ``[2, num_blocks, block_size, num_kv_heads]`` contiguous fp32 on the cache's device for an
            int8 cache (the dequantization scale of each K|V, slot, KV head); None for any other cache.
    Raises:
        ValueError: on an unsupported cache dtype, fp8 on a GPU without fp8 conversions, ``kv_scales``
            missing for an int8 cache or given for another dtype, or a malformed ``kv_scales``.
    """
    if kv_cache.dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"{name}: kv_cache dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache.dtype}")
    if kv_cache.dtype == FP8 and not _fp8_supported(kv_cache.device):
        raise ValueError(f"{name}: an fp8 kv_cache needs compute capability >= 8.9 (Triton float8e4nv)")
    try:
        reference.check_kv_scales(kv_cache, kv_scales)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None
    if kv_scales is None:
        return
    if kv_scales.device != kv_cache.device:
        raise ValueError(f"{name}: kv_scales is on {kv_scales.device}, kv_cache on {kv_cache.device}")
    if not kv_scales.is_contiguous():
        raise ValueError(f"{name}: kv_scales must be contiguous")


def _check_ids(name: str, src: torch.Tensor, dst: torch.Tensor) -> None:
    if src.dim() != 1 or dst.dim() != 1 or src.shape != dst.shape:
        raise ValueError(
            f"{name}: block id lists must be 1-D and equally long, "
            f"got {tuple(src.shape)} and {tuple(dst.shape)}"
        )
    if src.dtype not in _INDEX_DTYPES or dst.dtype not in _INDEX_DTYPES:
        raise ValueError(f"{name}: block ids must be int32 or int64, got {src.dtype}/{dst.dtype}")


def _as_bits(t: torch.Tensor) -> torch.Tensor:
    """The same memory reinterpreted as an integer dtype of the same width (for bit-exact copies)."""
    return t.view(_BITS_DTYPE[t.element_size()])


def _launch_block_copy(
    src_cache: torch.Tensor, dst_cache: torch.Tensor, src_ids: torch.Tensor, dst_ids: torch.Tensor
) -> None:
    """Both caches on one Triton-capable device, same dtype and block shape; ids on that device."""
    n = src_ids.shape[0]
    if n == 0:
        return
    block_numel = math.prod(src_cache.shape[2:])
    chunk = min(COPY_CHUNK, triton.next_power_of_2(block_numel))
    src_bits, dst_bits = _as_bits(src_cache), _as_bits(dst_cache)
    _copy_blocks_kernel[(n, 2, triton.cdiv(block_numel, chunk))](
        src_bits,
        dst_bits,
        src_ids.contiguous(),
        dst_ids.contiguous(),
        src_bits.stride(0),
        src_bits.stride(1),
        dst_bits.stride(0),
        dst_bits.stride(1),
        BLOCK_NUMEL=block_numel,
        CHUNK=chunk,
        num_warps=4,
    )


# --------------------------------------------------------------------------------------------- launchers


def store_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, negative = skip
    kv_scales: torch.Tensor | None = None,  # [2, num_blocks, block_size, num_kv_heads] fp32, int8 cache only
) -> None:
    """Write each token's K and V into its slot of the paged cache (in place).

    Args:
        key, value: fp32/fp16/bf16; any token/head strides (e.g. slices of a fused QKV output), contiguous
            last dim.
        kv_cache: one layer's cache (fp32/fp16/bf16, fp8 e4m3 or int8); blocks must be contiguous (a view of
            a bigger tensor is fine). fp8 stores the saturating cast, int8 the per-row quantization (see the
            module docstring).
        slot_mapping: ``block_id * block_size + offset`` per token; negative = skip. Non-negative slots must
            be distinct: tokens are stored in parallel, so two tokens on one slot leave either one there.
        kv_scales: required for (only for) an int8 cache: receives each stored row's scale.
    Raises:
        ValueError: on shape/dtype/stride/device mismatches, a ``kv_scales`` that breaks the contract of
            ``check_kv_quantization``, or an unsupported device.
    """
    name = "store_kv"
    _check_cache(name, kv_cache)
    num_kv_heads, head_dim = kv_cache.shape[3], kv_cache.shape[4]
    for t, what in ((key, "key"), (value, "value")):
        if t.dim() != 3 or t.shape[1:] != (num_kv_heads, head_dim):
            raise ValueError(
                f"{name}: {what} must be [num_tokens, {num_kv_heads}, {head_dim}], got {tuple(t.shape)}"
            )
        if t.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"{name}: {what} dtype must be one of {_FLOAT_DTYPES}, got {t.dtype}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: {what} needs a contiguous last (head_dim) dimension")
        if t.device != kv_cache.device:
            raise ValueError(f"{name}: {what} is on {t.device}, kv_cache on {kv_cache.device}")
    num_tokens = key.shape[0]
    if value.shape[0] != num_tokens or slot_mapping.shape != (num_tokens,):
        raise ValueError(
            f"{name}: key {tuple(key.shape)}, value {tuple(value.shape)} and slot_mapping "
            f"{tuple(slot_mapping.shape)} disagree on num_tokens"
        )
    if slot_mapping.dtype not in _INDEX_DTYPES:
        raise ValueError(f"{name}: slot_mapping must be int32 or int64, got {slot_mapping.dtype}")
    if slot_mapping.device != kv_cache.device:
        raise ValueError(f"{name}: slot_mapping is on {slot_mapping.device}, kv_cache on {kv_cache.device}")
    if not _triton_runs_on(kv_cache.device):
        raise ValueError(
            f"{name}: kv_cache is on {kv_cache.device}: Triton needs CUDA "
            "(or TRITON_INTERPRET=1 on CPU, set before triton is imported)"
        )
    check_kv_quantization(name, kv_cache, kv_scales)
    if num_tokens == 0:
        return
    if key.dtype == value.dtype == kv_cache.dtype:
        # NOTE: same dtype -> move bits (exact, and lets bf16 run under the CPU interpreter).
        key, value, kv_cache = _as_bits(key), _as_bits(value), _as_bits(kv_cache)
    elif kv_cache.device.type == "cpu" and torch.bfloat16 in (key.dtype, value.dtype, kv_cache.dtype):
        raise ValueError(f"{name}: bfloat16 conversion is not supported by the Triton interpreter on CPU")
    k_cache, v_cache = kv_cache[0], kv_cache[1]  # [num_blocks, block_size, num_kv_heads, head_dim]
    # NOTE: without scales the cache stands in for the scale pointers; the kernel never touches them then.
    scales = kv_scales if kv_scales is not None else kv_cache  # [2, num_blocks, block_size, num_kv_heads]
    block_h = min(triton.next_power_of_2(num_kv_heads), max(1, 4096 // triton.next_power_of_2(head_dim)))
    grid = (num_tokens, triton.cdiv(num_kv_heads, block_h))
    _store_kv_kernel[grid](
        key,
        value,
        k_cache,
        v_cache,
        scales[0],
        scales[1],
        slot_mapping.contiguous(),
        num_kv_heads,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        scales.stride(1),
        scales.stride(2),
        BLOCK_SIZE=kv_cache.shape[2],
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_H=block_h,
        EXACT_FP8_ROUND=kv_cache.device.type != "cuda",
        num_warps=4,
        enable_fp_fusion=False,  # NOTE: x * inv + 0.5 must round twice, as in torch (not one FMA rounding)
    )


def copy_blocks(
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    src: torch.Tensor,  # [n] int64 block ids
    dst: torch.Tensor,  # [n] int64 block ids
) -> None:
    """Copy whole blocks inside one cache (copy-on-write), bit-exact for every dtype (fp8, int8 included).

    Also takes an int8 cache's ``kv_scales`` ``[2, num_blocks, block_size, num_kv_heads]``: any
    ``[2, num_blocks, *block]`` tensor with contiguous blocks.

    Raises:
        ValueError: on bad shapes, non-contiguous blocks, ids on another device, or an unsupported device.
    """
    name = "copy_blocks"
    _check_blocks(name, kv_cache, "kv_cache")
    _check_ids(name, src, dst)
    if src.device != kv_cache.device or dst.device != kv_cache.device:
        raise ValueError(f"{name}: block ids must be on the cache's device {kv_cache.device}")
    if not _triton_runs_on(kv_cache.device):
        raise ValueError(
            f"{name}: kv_cache is on {kv_cache.device}: Triton needs CUDA (or TRITON_INTERPRET=1 on CPU)"
        )
    _launch_block_copy(kv_cache, kv_cache, src, dst)


def swap_blocks(
    src_cache: torch.Tensor,  # [2, num_src_blocks, block_size, num_kv_heads, head_dim]
    dst_cache: torch.Tensor,  # [2, num_dst_blocks, block_size, num_kv_heads, head_dim]
    src_ids: torch.Tensor,  # [n] int64 block ids in src_cache
    dst_ids: torch.Tensor,  # [n] int64 block ids in dst_cache
) -> None:
    """Move blocks between two caches (device pool <-> host swap space); bit-exact for every dtype.

    Same device: one Triton block-copy launch (plain torch indexing for two CPU caches when the Triton
    interpreter is off). Across devices: one gather on the source device, one bulk transfer through
    pinned host memory, one scatter on the destination device; no per-block Python loop. Like
    ``copy_blocks``, takes any ``[2, num_blocks, *block]`` pair with contiguous blocks, so an int8 cache's
    ``kv_scales`` move the same way.

    NOTE: device -> host waits for the transfer (the host-side scatter reads the pinned staging
    buffer on the CPU), so the host blocks are complete on return. Host -> device is asynchronous on
    the current stream; later kernels on that stream see the blocks.

    Raises:
        ValueError: on mismatched block shapes/dtypes or bad id lists.
    """
    name = "swap_blocks"
    _check_blocks(name, src_cache, "src_cache")
    _check_blocks(name, dst_cache, "dst_cache")
    _check_ids(name, src_ids, dst_ids)
    if src_cache.shape[0] != dst_cache.shape[0] or src_cache.shape[2:] != dst_cache.shape[2:]:
        raise ValueError(f"{name}: block shapes differ: {tuple(src_cache.shape)} vs {tuple(dst_cache.shape)}")
    if src_cache.dtype != dst_cache.dtype:
        raise ValueError(f"{name}: dtypes differ: {src_cache.dtype} vs {dst_cache.dtype}")
    if src_ids.shape[0] == 0:
        return
    # NOTE: move same-width integers: bit-exact, and torch has no CPU index kernels for fp8.
    src_cache, dst_cache = _as_bits(src_cache), _as_bits(dst_cache)
    src_dev, dst_dev = src_cache.device, dst_cache.device
    src_ids = src_ids.to(src_dev, non_blocking=True)
    dst_ids = dst_ids.to(dst_dev, non_blocking=True)

    if src_dev == dst_dev:
        if _triton_runs_on(src_dev):
            _launch_block_copy(src_cache, dst_cache, src_ids, dst_ids)
        else:
            dst_cache.index_copy_(1, dst_ids.long(), src_cache.index_select(1, src_ids.long()))
        return

    staged_shape = (2, src_ids.shape[0], *src_cache.shape[2:])  # [2, n, *block]
    if src_dev.type == "cpu":
        # host -> device: gather straight into pinned memory, then one async H2D copy and a scatter.
        pinned = torch.empty(staged_shape, dtype=src_cache.dtype, pin_memory=dst_dev.type == "cuda")
        torch.index_select(src_cache, 1, src_ids.long(), out=pinned)
        staged = pinned.to(dst_dev, non_blocking=True)
        dst_cache.index_copy_(1, dst_ids.long(), staged)
        return
    # device -> host (or device -> other device): gather on the source, one bulk copy, scatter.
    gathered = src_cache.index_select(1, src_ids.long())  # [2, n, *block]
    if dst_dev.type == "cpu":
        host = torch.empty(staged_shape, dtype=src_cache.dtype, pin_memory=src_dev.type == "cuda")
        host.copy_(gathered, non_blocking=True)
        if src_dev.type == "cuda":
            torch.cuda.current_stream(src_dev).synchronize()
        dst_cache.index_copy_(1, dst_ids.long(), host)
        return
    dst_cache.index_copy_(1, dst_ids.long(), gathered.to(dst_dev))
