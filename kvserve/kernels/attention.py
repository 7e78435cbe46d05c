"""Triton paged decode attention over the fixed KV layout (flash-decoding, split-K), and what the prefill
kernel (``kernels.prefill``) shares with it: the input checks, the K/V tile load, int8 dequantization.

KV cache, one tensor per layer (docs/architecture.md): ``[2, num_blocks, block_size, num_kv_heads, head_dim]``.
Token ``t`` of sequence ``s`` lives at ``block_tables[s, t // block_size]``, row ``t % block_size``.

Kernels
    ``_paged_decode_kernel``   grid (seq, kv head, split): one query token per sequence; each program walks
                               its split's share of the context through the block table with an online
                               softmax. GQA-grouped: one K/V tile load serves every query head of the group
                               (the group is padded to 16 rows so ``tl.dot`` applies).
    ``_merge_splits_kernel``   grid (seq, head): merges the split partials by log-sum-exp.

The launcher ``decode_attention`` has the signature of its torch twin in ``kernels.reference`` (plus
keyword-only extras: ``out=``, ``num_splits=``). Prefill is ``kernels.prefill.paged_prefill_attention``.

Quantized caches (contract in ``kernels.cache_ops``): an fp8 cache element reads as ``x.float()``, an int8
one as ``x.float() * scale`` with ``scale`` from ``kv_scales[K|V, block, offset, kv_head]``; attention then
runs as on an fp32 cache holding those values (the query's dtype sets compute and output dtypes).

NOTE: all cache offsets are computed in int64: ``block_id * stride_block`` overflows int32 once a pool
holds more than 2**31 elements (e.g. 131072 blocks of 16 x 8 x 128).
NOTE: the kernels work in the exp2 domain (``qk_scale = scale * log2(e)``); the split partials carry their
log-sum-exp in base 2 as well, and the merge kernel reads them back the same way.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from kvserve.kernels import triton_interpreting
from kvserve.kernels.cache_ops import check_kv_quantization

_LOG2E = 1.4426950408889634
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INDEX_DTYPES = (torch.int32, torch.int64)

# Tile size (tokens of K/V per decode inner-loop step).
DECODE_TILE_N = 64
# Split-K policy (see ``choose_num_splits``).
DEFAULT_NUM_SMS = 132
MAX_SPLITS = 32
MIN_TOKENS_PER_SPLIT = 256


# --------------------------------------------------------------------------------------------- kernels


@triton.jit
def _load_kv_tile(
    k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
    bt_row, tok, tok_mask, offs_d, d_mask, head_off, kv_head,
    stride_kv_block, stride_kv_slot, stride_s_block, stride_s_slot, BLOCK_SIZE: tl.constexpr,
):  # fmt: skip
    """K and V ``[TILE_N, HEAD_DIM_PAD]`` of key positions ``tok`` (through the sequence's block-table
    row ``bt_row``) as stored (one wide load each, whatever the element size), plus an int8 cache's K and V
    scales ``[TILE_N]`` (the mask as fp32 otherwise), each loaded once per tile. The caller dequantizes
    without touching the ``TILE_N x HEAD_DIM`` elements: K's scales multiply the scores
    (``q . (s * k) == s * (q . k)``) and V's the probabilities (``sum_n p_n (s_n v_n) == sum_n (p_n s_n) v_n``),
    TILE_N products per query row instead of TILE_N x HEAD_DIM."""
    block_ids = tl.load(bt_row + tok // BLOCK_SIZE, mask=tok_mask, other=0).to(tl.int64)
    slot_off = block_ids * stride_kv_block + (tok % BLOCK_SIZE).to(tl.int64) * stride_kv_slot + head_off
    kv_mask = tok_mask[:, None] & d_mask[None, :]
    k = tl.load(k_cache_ptr + slot_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_cache_ptr + slot_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    if k_cache_ptr.dtype.element_ty == tl.int8:
        s_off = block_ids * stride_s_block + (tok % BLOCK_SIZE).to(tl.int64) * stride_s_slot + kv_head
        k_scale = tl.load(k_scale_ptr + s_off, mask=tok_mask, other=0.0)
        v_scale = tl.load(v_scale_ptr + s_off, mask=tok_mask, other=0.0)
    else:
        k_scale = tok_mask.to(tl.float32)
        v_scale = k_scale
    return k, v, k_scale, v_scale


@triton.jit
def _pv_int8(p, v_scale, v, DOT_PRECISION: tl.constexpr):
    """``p @ (v_scale[:, None] * v)`` for an int8 V ``[TILE_N, D]`` (already cast to the compute dtype) and
    probabilities ``p [M, TILE_N]`` (fp32), without dequantizing V: the scales go onto ``p``.

    NOTE: ``p * v_scale`` is normalised by the tile's largest scale before the cast to a 16-bit dtype (and
    the product scaled back after the dot): raw products (p ~1e-3 x scale ~1e-3) would fall into fp16's
    subnormals and lose their precision there.
    """
    s_max = tl.max(v_scale, 0)
    s_max = tl.where(s_max > 0.0, s_max, 1.0)
    pv = (p * (v_scale / s_max)[None, :]).to(v.dtype)
    return tl.dot(pv, v, input_precision=DOT_PRECISION) * s_max


@triton.jit
def _paged_decode_kernel(
    out_ptr,  # WRITE_FINAL: [num_seqs, num_heads, head_dim]
    #           else partial [num_seqs, num_heads, NUM_SPLITS, head_dim] fp32
    lse_ptr,  # [num_seqs, num_heads, NUM_SPLITS] fp32 base-2 log-sum-exp (unused when WRITE_FINAL)
    q_ptr,  # [num_seqs, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]  (kv_cache[0])
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]  (kv_cache[1])
    k_scale_ptr,  # [num_blocks, block_size, num_kv_heads] fp32 (kv_scales[0]); read only for an int8 cache
    v_scale_ptr,  # [num_blocks, block_size, num_kv_heads] fp32 (kv_scales[1]); read only for an int8 cache
    block_tables_ptr,  # [num_seqs, max_blocks_per_seq] int32/int64
    context_lens_ptr,  # [num_seqs] int32/int64
    qk_scale,  # softmax scale * log2(e)
    sliding_window,  # tokens a query sees (itself included); read only when USE_WINDOW
    stride_q_seq,
    stride_q_head,
    stride_kv_block,
    stride_kv_slot,
    stride_kv_head,
    stride_s_block,  # kv_scales' block stride (slot stride next; head stride 1)
    stride_s_slot,
    stride_bt_seq,
    stride_o_seq,
    stride_o_head,
    stride_o_split,
    stride_lse_seq,
    stride_lse_head,
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,  # >= max(16, GROUP), power of two (tl.dot needs M >= 16)
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,  # next power of two >= HEAD_DIM
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    TILE_N: tl.constexpr,  # K/V tokens per inner step (power of two >= 16)
    NUM_SPLITS: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    WRITE_FINAL: tl.constexpr,  # single split: normalise and write the output directly
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (no tf32), else None (backend default)
):
    """One program = one (sequence, KV head, split).

    Contract: ``context_lens[s] >= 1`` counts the cached tokens including the query's own; the query sits
    at position ``context_lens[s] - 1``; key ``k`` is visible iff ``k <= pos`` and (with a window)
    ``k > pos - sliding_window``. The visible range is cut into ``NUM_SPLITS`` contiguous runs of whole
    ``TILE_N`` tiles; an empty run writes ``lse = -inf`` and a zero partial. A sequence with no visible key
    (``context_lens == 0``) gets a zero output. The cache's element type picks how it is read (module
    docstring): an int8 cache is scaled by ``kv_scales``, any other is cast to the query's dtype.
    """
    KV_INT8: tl.constexpr = k_cache_ptr.dtype.element_ty == tl.int8
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    ctx = tl.load(context_lens_ptr + seq).to(tl.int32)
    kv_lo = ctx * 0
    if USE_WINDOW:
        kv_lo = tl.maximum(ctx - sliding_window, 0)
    first_tile = kv_lo // TILE_N
    end_tile = tl.cdiv(ctx, TILE_N)
    tiles_per_split = tl.cdiv(end_tile - first_tile, NUM_SPLITS)
    tile_lo = first_tile + split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, end_tile)

    offs_g = tl.arange(0, GROUP_PAD)  # [GROUP_PAD]
    offs_d = tl.arange(0, HEAD_DIM_PAD)  # [HEAD_DIM_PAD]
    offs_n = tl.arange(0, TILE_N)  # [TILE_N]
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_g  # [GROUP_PAD]

    seq64 = seq.to(tl.int64)
    q_ptrs = q_ptr + seq64 * stride_q_seq + heads[:, None].to(tl.int64) * stride_q_head + offs_d[None, :]
    q = tl.load(q_ptrs, mask=g_mask[:, None] & d_mask[None, :], other=0.0)  # [GROUP_PAD, HEAD_DIM_PAD]

    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], dtype=tl.float32)

    bt_row = block_tables_ptr + seq64 * stride_bt_seq
    head_off = kv_head.to(tl.int64) * stride_kv_head
    for tile in range(tile_lo, tile_hi):
        tok = tile * TILE_N + offs_n  # [TILE_N]
        tok_mask = (tok < ctx) & (tok >= kv_lo)
        k, v, k_scale, v_scale = _load_kv_tile(
            k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, bt_row, tok, tok_mask, offs_d, d_mask, head_off,
            kv_head, stride_kv_block, stride_kv_slot, stride_s_block, stride_s_slot, BLOCK_SIZE,
        )  # fmt: skip
        # NOTE: fp8 and int8 values are exact in fp16/bf16/fp32, so this cast loses nothing for them.
        k = k.to(q.dtype)
        v = v.to(q.dtype)

        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [GROUP_PAD, TILE_N]
        if KV_INT8:
            s = s * k_scale[None, :]
        s = tl.where(tok_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])  # [GROUP_PAD, TILE_N]
        l_i = l_i * alpha + tl.sum(p, 1)
        if KV_INT8:
            acc = acc * alpha[:, None] + _pv_int8(p, v_scale, v, DOT_PRECISION)
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    result = acc / l_safe[:, None]  # [GROUP_PAD, HEAD_DIM_PAD]
    o_mask = g_mask[:, None] & d_mask[None, :]
    o_ptrs = out_ptr + seq64 * stride_o_seq + heads[:, None].to(tl.int64) * stride_o_head + offs_d[None, :]
    if WRITE_FINAL:
        tl.store(o_ptrs, result.to(out_ptr.dtype.element_ty), mask=o_mask)
    else:
        tl.store(o_ptrs + split * stride_o_split, result, mask=o_mask)
        lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))  # [GROUP_PAD]
        lse_ptrs = lse_ptr + seq64 * stride_lse_seq + heads.to(tl.int64) * stride_lse_head + split
        tl.store(lse_ptrs, lse, mask=g_mask)


@triton.jit
def _merge_splits_kernel(
    out_ptr,  # [num_seqs, num_heads, head_dim]
    partial_ptr,  # [num_seqs, num_heads, NUM_SPLITS, head_dim] fp32, each split already normalised
    lse_ptr,  # [num_seqs, num_heads, NUM_SPLITS] fp32, base-2 log-sum-exp, -inf for an empty split
    stride_o_seq,
    stride_o_head,
    stride_p_seq,
    stride_p_head,
    stride_p_split,
    stride_lse_seq,
    stride_lse_head,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,  # next power of two >= NUM_SPLITS
):
    """One program = one (sequence, query head): ``out = sum_i w_i o_i / sum_i w_i``.

    ``w_i = 2^(lse_i - max_j lse_j)``.

    All splits empty (no visible key) gives a zero output.
    """
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    s_mask = offs_s < NUM_SPLITS
    d_mask = offs_d < HEAD_DIM

    lse = tl.load(
        lse_ptr + seq * stride_lse_seq + head * stride_lse_head + offs_s, mask=s_mask, other=float("-inf")
    )  # [SPLITS_PAD]
    m = tl.max(lse, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m_safe)  # [SPLITS_PAD]
    denom = tl.sum(w, 0)
    p_ptrs = (
        partial_ptr + seq * stride_p_seq + head * stride_p_head + offs_s[:, None] * stride_p_split + offs_d[None, :]
    )
    parts = tl.load(p_ptrs, mask=s_mask[:, None] & d_mask[None, :], other=0.0)  # [SPLITS_PAD, HEAD_DIM_PAD]
    acc = tl.sum(parts * w[:, None], 0)  # [HEAD_DIM_PAD]
    result = acc / tl.where(denom > 0.0, denom, 1.0)
    tl.store(
        out_ptr + seq * stride_o_seq + head * stride_o_head + offs_d,
        result.to(out_ptr.dtype.element_ty),
        mask=d_mask,
    )


# --------------------------------------------------------------------------------------------- policy


def decode_tile_n(kv_element_size: int) -> int:
    """K/V tokens per decode loop step for a cache of ``kv_element_size`` bytes per element.

    A 1-byte cache (fp8, int8) takes twice ``DECODE_TILE_N`` tokens, so each step moves as many bytes
    (and keeps as many in flight) as a 16-bit cache's step: at the same tokens per step a quantized
    cache reads half the bytes per step in the same number of steps, and stays latency-bound.
    """
    return DECODE_TILE_N * 2 if kv_element_size == 1 else DECODE_TILE_N


def min_tokens_per_split(kv_element_size: int) -> int:
    """The split-K floor for a cache of ``kv_element_size`` bytes: the same bytes per split (twice the
    tokens for a 1-byte cache), so a split still amortises its merge and its partial's write."""
    return MIN_TOKENS_PER_SPLIT * 2 if kv_element_size == 1 else MIN_TOKENS_PER_SPLIT


def choose_num_splits(
    num_seqs: int,
    num_kv_heads: int,
    max_context: int,
    block_size: int,
    *,
    num_sms: int = DEFAULT_NUM_SMS,
    max_splits: int = MAX_SPLITS,
    min_tokens_per_split: int = MIN_TOKENS_PER_SPLIT,
) -> int:
    """How many KV splits a decode launch should use (1 = no split, no merge pass).

    Aim for about two programs per SM: ``num_seqs * num_kv_heads`` programs already fill the GPU at large
    batch (256 x 8 KV heads = 2048 programs -> 1 split), while batch 1 needs the context split to occupy
    the SMs (1 x 8 KV heads at 32k -> 32 splits). Each split keeps at least ``min_tokens_per_split``
    tokens (and one block) so the merge overhead stays small next to the work it parallelises.

    Args:
        num_seqs: decode sequences in the batch.
        num_kv_heads: KV heads (the decode grid's second axis).
        max_context: longest context in the batch (an upper bound is fine).
        block_size: tokens per cache block.
    Returns:
        An int in ``[1, max_splits]``.
    """
    programs = max(num_seqs, 0) * max(num_kv_heads, 0)
    if programs == 0 or max_context <= 0 or programs >= num_sms:
        return 1
    wanted = -(-2 * num_sms // programs)
    by_length = max(1, max_context // max(min_tokens_per_split, block_size))
    return int(max(1, min(wanted, by_length, max_splits)))


@functools.lru_cache(maxsize=16)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return DEFAULT_NUM_SMS


# --------------------------------------------------------------------------------------------- checks


def _check_device(t: torch.Tensor, what: str) -> None:
    if t.device.type == "cuda":
        return
    if t.device.type == "cpu" and triton_interpreting():
        if t.dtype == torch.bfloat16:
            raise ValueError(
                f"{what}: bfloat16 is not supported by the Triton interpreter on CPU; "
                "use float16/float32 or a CUDA device"
            )
        return
    raise ValueError(
        f"{what} is on {t.device}: Triton kernels need a CUDA tensor "
        "(or TRITON_INTERPRET=1 on CPU, set before triton is imported)"
    )


def _check_attention_inputs(
    name: str,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    num_seqs: int,
    kv_scales: torch.Tensor | None,
) -> tuple[int, int, int]:
    """Validate what the decode and prefill launchers share; returns (num_heads, num_kv_heads, head_dim)."""
    if query.dim() != 3:
        raise ValueError(f"{name}: query must be 3-D [tokens, num_heads, head_dim], got {tuple(query.shape)}")
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(
            f"{name}: kv_cache must be [2, num_blocks, block_size, num_kv_heads, head_dim], got {tuple(kv_cache.shape)}"
        )
    _, num_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[3]
    if kv_cache.shape[4] != head_dim:
        raise ValueError(f"{name}: head_dim mismatch: query {head_dim}, kv_cache {kv_cache.shape[4]}")
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(f"{name}: num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    if query.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{name}: query dtype must be one of {_FLOAT_DTYPES}, got {query.dtype}")
    if block_tables.dtype not in _INDEX_DTYPES or context_lens.dtype not in _INDEX_DTYPES:
        raise ValueError(
            f"{name}: block_tables/context_lens must be int32 or int64, got {block_tables.dtype}/{context_lens.dtype}"
        )
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(
            f"{name}: block_tables must be [num_seqs={num_seqs}, max_blocks], got {tuple(block_tables.shape)}"
        )
    if context_lens.shape != (num_seqs,):
        raise ValueError(f"{name}: context_lens must be [num_seqs={num_seqs}], got {tuple(context_lens.shape)}")
    for t, what in ((kv_cache, "kv_cache"), (block_tables, "block_tables"), (context_lens, "context_lens")):
        if t.device != query.device:
            raise ValueError(f"{name}: {what} is on {t.device}, query on {query.device}")
    if query.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError(f"{name}: query and kv_cache need a contiguous last (head_dim) dimension")
    if block_tables.stride(1) != 1 and block_tables.shape[1] > 1:
        raise ValueError(f"{name}: block_tables rows must be contiguous (stride(1) == 1)")
    if context_lens.stride(0) != 1 and num_seqs > 1:
        raise ValueError(f"{name}: context_lens must be contiguous")
    if not math.isfinite(float(scale)):
        raise ValueError(f"{name}: scale must be finite, got {scale}")
    if sliding_window is not None and (int(sliding_window) != sliding_window or sliding_window < 1):
        raise ValueError(f"{name}: sliding_window must be None or an int >= 1, got {sliding_window}")
    _check_device(query, f"{name}: query")
    _check_device(kv_cache, f"{name}: kv_cache")
    check_kv_quantization(name, kv_cache, kv_scales)
    return num_heads, num_kv_heads, head_dim


def _check_out(name: str, out: torch.Tensor | None, query: torch.Tensor) -> torch.Tensor:
    if out is None:
        return torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if out.shape != query.shape or out.dtype != query.dtype or out.device != query.device:
        raise ValueError(
            f"{name}: out must be {tuple(query.shape)} {query.dtype} on {query.device}, "
            f"got {tuple(out.shape)} {out.dtype} on {out.device}"
        )
    if out.stride(-1) != 1:
        raise ValueError(f"{name}: out needs a contiguous last dimension")
    return out


def _scales_or_dummy(kv_cache: torch.Tensor, kv_scales: torch.Tensor | None) -> torch.Tensor:
    # NOTE: without scales the cache stands in for the scale pointers; only an int8 cache's kernel reads them.
    return kv_scales if kv_scales is not None else kv_cache


def _dot_precision(dtype: torch.dtype) -> str | None:
    # NOTE: fp32 inputs must not silently drop to tf32 (10-bit mantissa) on Ampere+; 16-bit inputs take the
    # backend's default (the option only concerns fp32 operands).
    return "ieee" if dtype == torch.float32 else None


# --------------------------------------------------------------------------------------------- launchers


def decode_attention(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32, padded with any valid id
    context_lens: torch.Tensor,  # [num_seqs] int32, tokens in cache incl. the query's own
    scale: float,
    sliding_window: int | None = None,
    *,
    out: torch.Tensor | None = None,  # [num_seqs, num_heads, head_dim], query's dtype
    num_splits: int | None = None,
    kv_scales: torch.Tensor | None = None,  # [2, num_blocks, block_size, num_kv_heads] fp32, int8 cache only
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    """One query token per sequence attending to its whole cached context (flash-decoding).

    Args:
        query: the new token's query per sequence; any strides with a contiguous last dim.
        kv_cache: one layer's paged cache (may be a view of a bigger tensor; last dim contiguous);
            fp32/fp16/bf16, fp8 e4m3 or int8 (read as described in the module docstring).
        block_tables: physical block ids per sequence; entries past the context are never read.
        context_lens: cached tokens per sequence including the query's own (>= 1; 0 gives zeros).
        scale: softmax scale (usually ``head_dim ** -0.5``).
        sliding_window: if set, a query at position ``p`` sees keys ``p - sliding_window < k <= p``.
        out: optional preallocated output (written in full).
        num_splits: force the split-K factor; default ``choose_num_splits`` on the table's width.
        kv_scales: the int8 cache's dequantization scales; required for an int8 cache, None otherwise.
    Returns:
        ``out`` (or a new tensor) of shape ``[num_seqs, num_heads, head_dim]`` in query's dtype.
    Raises:
        ValueError: on shape/dtype/stride/device mismatches or an unsupported device.
    """
    num_seqs = query.shape[0] if query.dim() == 3 else -1
    num_heads, num_kv_heads, head_dim = _check_attention_inputs(
        "decode_attention", query, kv_cache, block_tables, context_lens, scale, sliding_window, num_seqs, kv_scales
    )
    out = _check_out("decode_attention", out, query)
    if num_seqs == 0:
        return out
    block_size = kv_cache.shape[2]
    group = num_heads // num_kv_heads
    if num_splits is None:
        max_context = block_tables.shape[1] * block_size  # NOTE: a bound, so no device->host sync
        if sliding_window is not None:
            max_context = min(max_context, int(sliding_window))
        num_splits = choose_num_splits(
            num_seqs,
            num_kv_heads,
            max_context,
            block_size,
            num_sms=_num_sms(query.device),
            min_tokens_per_split=min_tokens_per_split(kv_cache.element_size()),
        )
    if int(num_splits) < 1:
        raise ValueError(f"decode_attention: num_splits must be >= 1, got {num_splits}")
    num_splits = int(num_splits)

    k_cache, v_cache = kv_cache[0], kv_cache[1]  # [num_blocks, block_size, num_kv_heads, head_dim]
    head_dim_pad = triton.next_power_of_2(head_dim)
    tile_n = decode_tile_n(kv_cache.element_size())
    common = dict(
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size,
        TILE_N=tile_n,
        NUM_SPLITS=num_splits,
        USE_WINDOW=sliding_window is not None,
        DOT_PRECISION=_dot_precision(query.dtype),
        # NOTE: a 1-byte cache's 128-token tile is 16-bit in registers after the cast: 8 warps hold it.
        num_warps=4 if tile_n * head_dim_pad <= 64 * 128 else 8,
        num_stages=2,
    )
    scales = _scales_or_dummy(kv_cache, kv_scales)  # [2, num_blocks, block_size, num_kv_heads]
    grid = (num_seqs, num_kv_heads, num_splits)
    args = (
        query,
        k_cache,
        v_cache,
        scales[0],
        scales[1],
        block_tables,
        context_lens,
        float(scale) * _LOG2E,
        int(sliding_window or 0),
        query.stride(0),
        query.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        scales.stride(1),
        scales.stride(2),
        block_tables.stride(0),
    )
    if num_splits == 1:
        _paged_decode_kernel[grid](
            out,
            out,
            *args,
            out.stride(0),
            out.stride(1),
            0,
            0,
            0,
            WRITE_FINAL=True,
            **common,
        )
        return out
    partial = torch.empty((num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32, device=query.device)
    lse = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=query.device)
    _paged_decode_kernel[grid](
        partial,
        lse,
        *args,
        partial.stride(0),
        partial.stride(1),
        partial.stride(2),
        lse.stride(0),
        lse.stride(1),
        WRITE_FINAL=False,
        **common,
    )
    _merge_splits_kernel[(num_seqs, num_heads)](
        out,
        partial,
        lse,
        out.stride(0),
        out.stride(1),
        partial.stride(0),
        partial.stride(1),
        partial.stride(2),
        lse.stride(0),
        lse.stride(1),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        NUM_SPLITS=num_splits,
        SPLITS_PAD=triton.next_power_of_2(num_splits),
        num_warps=1 if head_dim_pad <= 64 else 2,
    )
    return out
