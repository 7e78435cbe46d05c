"""Triton prefill attention with FlashAttention-2's structure: paged (a cached prefix read through the block
table) and contiguous (packed variable-length sequences, no cache).

Kernel
    ``_flash_prefill_kernel``  grid (query tile, sequence, query head). One program owns ``BLOCK_M`` query
                               tokens of one head and walks the keys in ``BLOCK_N`` tiles with an online
                               softmax (exp2 domain), ``tl.dot`` for both products, fp32 accumulators. The
                               walk has two phases: keys every row of the tile sees (everything before the
                               tile's first query position: no mask at all, no causal test), then the
                               tiles on the diagonal (causal and bounds masks); tiles above the diagonal
                               are never visited. GQA: query head ``h`` reads KV head ``h // GROUP`` in
                               place (no copy, no repeat).

K/V come either from the paged cache (``PAGED``: token ``t`` of sequence ``s`` at
``block_tables[s, t // block_size]``, row ``t % block_size``; prefix and chunk alike, as the engine stores
the chunk before attending) or from contiguous ``[tokens, kv_heads, head_dim]`` tensors laid out like the
queries. Quantized caches read as in ``kernels.attention`` (fp8 cast; int8 per-(token, KV head) scales
applied to the scores and to the probabilities).

On a GPU the tile shape, warps and pipeline depth (``num_stages``: K/V tiles prefetched while the current
one is multiplied) are autotuned per head dimension and chunk-length bucket from ``_CONFIGS``
(``KVSERVE_PREFILL_AUTOTUNE=0``: the first candidate that fits, no tuning runs, e.g. for tests); under the
interpreter one small configuration runs (``INTERPRET_BLOCK_M`` x ``INTERPRET_BLOCK_N``), so tests reach
every branch on tiny inputs.

NOTE: offsets are int64 (a big pool's ``block_id * stride_block`` overflows int32).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kvserve.kernels import triton_interpreting
from kvserve.kernels.attention import (
    _INDEX_DTYPES,
    _LOG2E,
    _check_attention_inputs,
    _check_device,
    _check_out,
    _dot_precision,
    _load_kv_tile,
    _pv_int8,
    _scales_or_dummy,
)

# Under the interpreter (tests): one configuration, small enough for several tiles per tiny case.
INTERPRET_BLOCK_M = 16
INTERPRET_BLOCK_N = 16


def _config(block_m: int, block_n: int, warps: int, stages: int) -> triton.Config:
    return triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n}, num_warps=warps, num_stages=stages)


# Hopper-sized candidates (FlashAttention-2 on H100/H200 runs 128 x 64..128 tiles, 4-8 warps, 2-4 stages);
# _prune keeps the ones that fit the head dimension and dtype.
_CONFIGS = [  # the first that fits is the untuned default (KVSERVE_PREFILL_AUTOTUNE=0)
    _config(128, 64, 8, 3),
    _config(128, 128, 8, 2),
    _config(128, 64, 4, 3),
    _config(128, 32, 4, 4),
    _config(64, 64, 4, 3),
    _config(64, 32, 4, 4),
]


def _prune(
    configs: list[triton.Config], named_args: dict, smem_limit: int = 200 * 1024, **kwargs: object
) -> list[triton.Config]:
    """The configs whose pipeline fits shared memory and whose fp32 accumulator fits registers: wide heads
    and fp32 inputs get smaller tiles. (Autotuning also drops a config that fails to launch; the untuned
    default, with a tighter ``smem_limit``, must not.)"""
    head_dim = int(kwargs.get("HEAD_DIM_PAD", named_args.get("HEAD_DIM_PAD", 128)))
    q = named_args["q_ptr"]
    elem = q.element_size() if hasattr(q, "element_size") else 2
    kept = []
    for c in configs:
        bm, bn = c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]
        smem = (bm + 2 * c.num_stages * bn) * head_dim * elem  # Q tile + num_stages x (K and V tiles)
        acc_regs = bm * head_dim // (32 * c.num_warps)  # fp32 accumulator per thread
        if smem <= smem_limit and acc_regs <= 128:
            kept.append(c)
    return kept or [_config(32, 32, 4, 1)]


@triton.jit
def _kv_tile(
    k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, bt_row, kv_row0, tok, tok_mask, offs_d, d_mask, kv_head,
    stride_k_tok, stride_k_head, stride_v_tok, stride_v_head, stride_kv_block, stride_s_block, stride_s_slot,
    PAGED: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):  # fmt: skip
    """K, V ``[BLOCK_N, HEAD_DIM_PAD]`` of key positions ``tok`` and their int8 scales (see ``_load_kv_tile``):
    through the block table (``PAGED``; the token strides are then the cache's slot strides) or rows
    ``kv_row0 + tok`` of contiguous K/V tensors (scales: the mask)."""
    if PAGED:
        k, v, k_scale, v_scale = _load_kv_tile(
            k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, bt_row, tok, tok_mask, offs_d, d_mask,
            kv_head.to(tl.int64) * stride_k_head, kv_head, stride_kv_block, stride_k_tok, stride_s_block,
            stride_s_slot, BLOCK_SIZE,
        )  # fmt: skip
    else:
        rows = (kv_row0 + tok).to(tl.int64)
        kv_mask = tok_mask[:, None] & d_mask[None, :]
        head = kv_head.to(tl.int64)
        k = tl.load(k_ptr + rows[:, None] * stride_k_tok + head * stride_k_head + offs_d[None, :], mask=kv_mask,
                    other=0.0)  # fmt: skip
        v = tl.load(v_ptr + rows[:, None] * stride_v_tok + head * stride_v_head + offs_d[None, :], mask=kv_mask,
                    other=0.0)  # fmt: skip
        k_scale = tok_mask.to(tl.float32)
        v_scale = k_scale
    return k, v, k_scale, v_scale


@triton.jit
def _attend_tile(
    q, acc, m_i, l_i, k, v, k_scale, v_scale, visible, qk_scale,
    KV_INT8: tl.constexpr, MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """One online-softmax step over a K/V tile; ``visible [BLOCK_M, BLOCK_N]`` is read only when ``MASKED``."""
    k = k.to(q.dtype)  # NOTE: fp8/int8 values are exact in every float dtype
    v = v.to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
    if KV_INT8:
        s = s * k_scale[None, :]
    if MASKED:
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that sees nothing yet
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = m_new
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if KV_INT8:
        acc = acc * alpha[:, None] + _pv_int8(p, v_scale, v, DOT_PRECISION)
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _flash_prefill_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    q_ptr,  # [num_tokens, num_heads, head_dim]
    k_ptr,  # PAGED: [num_blocks, block_size, num_kv_heads, head_dim] (kv_cache[0]); else [num_tokens, kv_heads, d]
    v_ptr,  # likewise (kv_cache[1] or the values)
    k_scale_ptr,  # [num_blocks, block_size, num_kv_heads] fp32 (kv_scales[0]); read only for an int8 cache
    v_scale_ptr,  # [num_blocks, block_size, num_kv_heads] fp32 (kv_scales[1]); read only for an int8 cache
    block_tables_ptr,  # [num_seqs, max_blocks_per_seq] int32/int64 (PAGED only)
    cu_seqlens_q_ptr,  # [num_seqs + 1] int32/int64
    context_lens_ptr,  # [num_seqs] int32/int64 (PAGED only; else the context is the chunk)
    qk_scale,  # softmax scale * log2(e)
    sliding_window,  # read only when USE_WINDOW
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_k_tok,  # PAGED: the cache's slot stride
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_kv_block,  # PAGED only
    stride_s_block,  # kv_scales' block stride (slot stride next; head stride 1)
    stride_s_slot,
    stride_bt_seq,
    q_len_bucket,  # unused in the kernel: the autotuner's key (``q_len_bucket`` of the longest chunk)
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # cache block size (PAGED only)
    PAGED: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,  # query tokens per program
    BLOCK_N: tl.constexpr,  # key tokens per inner step
):
    """One program = ``BLOCK_M`` query tokens of one sequence x one query head.

    Contract: sequence ``s`` owns query rows ``cu_seqlens_q[s]:cu_seqlens_q[s+1]`` (``q_len``), at positions
    ``prefix + i`` with ``prefix = context_lens[s] - q_len`` (PAGED; keys ``0 .. context_lens[s]-1`` all in
    the cache) or ``prefix = 0`` (contiguous; key ``j`` is row ``cu_seqlens_q[s] + j`` of K/V). A query at
    ``p`` sees key ``k`` iff ``k <= p`` and (with a window) ``k > p - sliding_window``.
    """
    KV_INT8: tl.constexpr = k_ptr.dtype.element_ty == tl.int8
    m_tile = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    kv_head = head // GROUP

    q_start = tl.load(cu_seqlens_q_ptr + seq).to(tl.int32)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1).to(tl.int32) - q_start
    m_start = m_tile * BLOCK_M
    if m_start >= q_len:
        return
    if PAGED:
        ctx = tl.load(context_lens_ptr + seq).to(tl.int32)
    else:
        ctx = q_len
    prefix = ctx - q_len

    offs_m = m_start + tl.arange(0, BLOCK_M)  # query index inside the chunk
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = offs_d < HEAD_DIM
    m_mask = offs_m < q_len
    q_pos = prefix + offs_m  # [BLOCK_M]
    rows = (q_start + offs_m).to(tl.int64)
    head64 = head.to(tl.int64)
    q = tl.load(
        q_ptr + rows[:, None] * stride_q_tok + head64 * stride_q_head + offs_d[None, :],
        mask=m_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # [BLOCK_M, HEAD_DIM_PAD]

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq

    # Keys [0, first_q) are visible to every row (causally); the diagonal tiles follow. With a window,
    # rows see different lower bounds too: every tile from the first one any row sees is masked.
    first_q = prefix + m_start
    kv_hi = tl.minimum(first_q + BLOCK_M, ctx)
    if USE_WINDOW:
        full_end = first_q * 0
        masked_lo = (tl.maximum(first_q - sliding_window + 1, 0) // BLOCK_N) * BLOCK_N
    else:
        full_end = (first_q // BLOCK_N) * BLOCK_N
        masked_lo = full_end

    # Phase 1: whole tiles below the tile's first query: no masks on loads or scores.
    all_n = offs_n < BLOCK_N
    for start in range(0, full_end, BLOCK_N):
        tok = start + offs_n
        k, v, k_scale, v_scale = _kv_tile(
            k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, bt_row, q_start, tok, all_n, offs_d, d_mask, kv_head,
            stride_k_tok, stride_k_head, stride_v_tok, stride_v_head, stride_kv_block, stride_s_block,
            stride_s_slot, PAGED, BLOCK_SIZE,
        )  # fmt: skip
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, k, v, k_scale, v_scale, None, qk_scale, KV_INT8, False, DOT_PRECISION
        )

    # Phase 2: the diagonal (and, with a window, everything): causal, window and bounds masks.
    for start in range(masked_lo, kv_hi, BLOCK_N):
        tok = start + offs_n
        tok_mask = tok < kv_hi
        k, v, k_scale, v_scale = _kv_tile(
            k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, bt_row, q_start, tok, tok_mask, offs_d, d_mask, kv_head,
            stride_k_tok, stride_k_head, stride_v_tok, stride_v_head, stride_kv_block, stride_s_block,
            stride_s_slot, PAGED, BLOCK_SIZE,
        )  # fmt: skip
        visible = tok_mask[None, :] & (tok[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            visible = visible & (tok[None, :] > q_pos[:, None] - sliding_window)
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, k, v, k_scale, v_scale, visible, qk_scale, KV_INT8, True, DOT_PRECISION
        )

    result = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    o_ptrs = out_ptr + rows[:, None] * stride_o_tok + head64 * stride_o_head + offs_d[None, :]
    tl.store(o_ptrs, result.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


# NOTE: tuned per head dim and per chunk-length bucket (a 64-token chunk and an 8k prompt want different tiles).
_HEURISTIC_KEYS = ["q_len_bucket", "HEAD_DIM_PAD", "PAGED", "USE_WINDOW", "DOT_PRECISION"]
_tuned_kernel = triton.autotune(configs=_CONFIGS, key=_HEURISTIC_KEYS, prune_configs_by={"early_config_prune": _prune})(
    _flash_prefill_kernel
)


def q_len_bucket(max_q: int) -> int:
    """The autotuner's chunk-length key: three buckets (chunks, mid prompts, long prompts), so a server tunes
    each (head dim, variant) at most three times: each tuning compiles and times every fitting config."""
    return 512 if max_q <= 512 else 2048 if max_q <= 2048 else 8192


def _launch(query: torch.Tensor, out: torch.Tensor, max_q: int, num_seqs: int, args: tuple, **meta: object) -> None:
    num_heads = query.shape[1]
    args = (*args, q_len_bucket(max_q))
    if triton_interpreting() and query.device.type == "cpu":
        grid = (triton.cdiv(max_q, INTERPRET_BLOCK_M), num_seqs, num_heads)
        _flash_prefill_kernel[grid](*args, BLOCK_M=INTERPRET_BLOCK_M, BLOCK_N=INTERPRET_BLOCK_N, **meta)
        return

    def grid(m: dict) -> tuple[int, int, int]:
        return (triton.cdiv(max_q, m["BLOCK_M"]), num_seqs, num_heads)

    if os.environ.get("KVSERVE_PREFILL_AUTOTUNE", "1").strip().lower() in ("0", "false", "off", "no"):
        cfg = _prune(_CONFIGS, {"q_ptr": query}, smem_limit=160 * 1024, **meta)[0]
        _flash_prefill_kernel[grid(cfg.kwargs)](
            *args, **cfg.kwargs, **meta, num_warps=cfg.num_warps, num_stages=cfg.num_stages
        )
        return
    _tuned_kernel[grid](*args, **meta)


def _max_len(cu_seqlens: torch.Tensor, given: int | None) -> int:
    return int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if given is None else int(given)


def _check_cu(name: str, cu: torch.Tensor, num_seqs: int, device: torch.device) -> None:
    if cu.dtype not in _INDEX_DTYPES or cu.shape != (num_seqs + 1,):
        raise ValueError(f"{name}: cu_seqlens must be int32/int64 [num_seqs + 1 = {num_seqs + 1}], "
                         f"got {cu.dtype} {tuple(cu.shape)}")  # fmt: skip
    if cu.device != device:
        raise ValueError(f"{name}: cu_seqlens is on {cu.device}, query on {device}")
    if cu.stride(0) != 1:
        raise ValueError(f"{name}: cu_seqlens must be contiguous")


def paged_prefill_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1] int32, query chunk boundaries
    context_lens: torch.Tensor,  # [num_seqs] int32, cached prefix + this chunk (all already stored)
    scale: float,
    sliding_window: int | None = None,
    *,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim], query's dtype
    max_query_len: int | None = None,
    kv_scales: torch.Tensor | None = None,  # [2, num_blocks, block_size, num_kv_heads] fp32, int8 cache only
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Variable-length query chunks attending causally to their cached prefix and to themselves, every key
    read through the block table. Same signature and contract as ``kernels.reference.prefill_attention``;
    the Triton backend's ``prefill_attention`` is this launcher.

    Raises:
        ValueError: on shape/dtype/stride/device mismatches or an unsupported device.
    """
    name = "paged_prefill_attention"
    num_seqs = context_lens.shape[0] if context_lens.dim() == 1 else -1
    num_heads, num_kv_heads, head_dim = _check_attention_inputs(
        name, query, kv_cache, block_tables, context_lens, scale, sliding_window, num_seqs, kv_scales
    )
    _check_cu(name, cu_seqlens_q, num_seqs, query.device)
    out = _check_out(name, out, query)
    if num_seqs == 0 or query.shape[0] == 0:
        return out
    max_q = _max_len(cu_seqlens_q, max_query_len)
    if max_q <= 0:
        return out
    k_cache, v_cache = kv_cache[0], kv_cache[1]  # [num_blocks, block_size, num_kv_heads, head_dim]
    scales = _scales_or_dummy(kv_cache, kv_scales)  # [2, num_blocks, block_size, num_kv_heads]
    args = (
        out, query, k_cache, v_cache, scales[0], scales[1], block_tables, cu_seqlens_q, context_lens,
        float(scale) * _LOG2E, int(sliding_window or 0),
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(1), k_cache.stride(2), v_cache.stride(1), v_cache.stride(2), k_cache.stride(0),
        scales.stride(1), scales.stride(2), block_tables.stride(0),
    )  # fmt: skip
    _launch(
        query, out, max_q, num_seqs, args,
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=kv_cache.shape[2], PAGED=True, USE_WINDOW=sliding_window is not None,
        DOT_PRECISION=_dot_precision(query.dtype),
    )  # fmt: skip
    return out


def flash_attention_varlen(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cu_seqlens: torch.Tensor,  # [num_seqs + 1] int32/int64, sequence boundaries (queries and keys alike)
    scale: float,
    sliding_window: int | None = None,
    *,
    out: torch.Tensor | None = None,
    max_seqlen: int | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Causal self-attention of packed variable-length sequences held contiguously (no cache): sequence ``s``
    is rows ``cu_seqlens[s]:cu_seqlens[s+1]`` of query, key and value. GQA when ``num_heads`` is a
    multiple of ``num_kv_heads`` (query head ``h`` uses KV head ``h // group``, read in place).

    Raises:
        ValueError: on shape/dtype/stride/device mismatches or an unsupported device.
    """
    name = "flash_attention_varlen"
    if query.dim() != 3 or key.dim() != 3 or key.shape != value.shape:
        raise ValueError(f"{name}: query [T, H, D], key/value [T, KVH, D], got {tuple(query.shape)}, "
                         f"{tuple(key.shape)}, {tuple(value.shape)}")  # fmt: skip
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    if key.shape[0] != num_tokens or key.shape[2] != head_dim:
        raise ValueError(f"{name}: key {tuple(key.shape)} does not match query {tuple(query.shape)}")
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(f"{name}: num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    for t, what in ((key, "key"), (value, "value")):
        if t.dtype != query.dtype or t.device != query.device:
            raise ValueError(f"{name}: {what} is {t.dtype} on {t.device}, query {query.dtype} on {query.device}")
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: {what} needs a contiguous last dimension")
    if query.stride(-1) != 1:
        raise ValueError(f"{name}: query needs a contiguous last dimension")
    if sliding_window is not None and (int(sliding_window) != sliding_window or sliding_window < 1):
        raise ValueError(f"{name}: sliding_window must be None or an int >= 1, got {sliding_window}")
    _check_device(query, f"{name}: query")
    num_seqs = cu_seqlens.shape[0] - 1 if cu_seqlens.dim() == 1 else -1
    _check_cu(name, cu_seqlens, num_seqs, query.device)
    out = _check_out(name, out, query)
    if num_seqs <= 0 or num_tokens == 0:
        return out
    max_q = _max_len(cu_seqlens, max_seqlen)
    if max_q <= 0:
        return out
    args = (
        out, query, key, value, key, value, cu_seqlens, cu_seqlens, cu_seqlens,
        float(scale) * _LOG2E, int(sliding_window or 0),
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key.stride(0), key.stride(1), value.stride(0), value.stride(1), 0, 0, 0, 0,
    )  # fmt: skip
    _launch(
        query, out, max_q, num_seqs, args,
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=1, PAGED=False, USE_WINDOW=sliding_window is not None,
        DOT_PRECISION=_dot_precision(query.dtype),
    )  # fmt: skip
    return out
