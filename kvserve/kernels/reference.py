"""Plain-torch paged-attention and cache ops: the CPU backend and the Triton kernels' reference.

KV cache layout (fixed by docs/architecture.md), one tensor per layer:
    kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim]   (0 = K, 1 = V)
Token ``t`` of a sequence lives in slot ``block_table[t // block_size] * block_size + t % block_size``.
A negative slot in ``slot_mapping`` means "do not store" (padding, or a token already cached).

Every function here has the same signature as its Triton twin in ``kernels.attention`` /
``kernels.cache_ops``; ``kernels.get_backend()`` picks one.
"""

from __future__ import annotations

import warnings
import weakref

import torch

# The torch backend's RMSNorm, residual-add + RMSNorm and SiLU-and-mul (their own module: no cache involved).
from kvserve.kernels.norm_act_reference import fused_add_rms_norm, rms_norm, silu_and_mul  # noqa: F401

# NOTE: the CPU decode path builds sparse CSR patterns (see _decode_attention_sparse); torch warns once
# that CSR support is "beta". The ops used (sampled_addmm, CSR construction) are long-standing.
warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta state", category=UserWarning)


# Quantized KV caches (see ``store_kv``): fp8 = float8_e4m3fn with no per-element scale (the model layer
# folds a per-tensor checkpoint scale into q/k/v); int8 = symmetric int8 with one fp32 scale per
# (K|V, slot, kv head) in a separate ``kv_scales`` tensor [2, num_blocks, block_size, num_kv_heads].
FP8_MAX = 448.0  # largest finite e4m3 value
FP8 = torch.float8_e4m3fn
INT8_MAX = 127.0
INT8_MIN_AMAX = 1e-30  # rows quieter than this quantize to zero (127 / amax would overflow fp32)


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """fp8 tensors as raw bytes: torch has no CPU index kernels for fp8, and copies are bit-exact anyway."""
    return t.view(torch.uint8) if t.dtype == FP8 else t


def check_kv_scales(kv_cache: torch.Tensor, kv_scales: torch.Tensor | None) -> None:
    """``kv_scales`` is given exactly for int8 caches, shaped like the cache without head_dim, fp32."""
    if kv_cache.dtype == torch.int8:
        if kv_scales is None:
            raise ValueError("an int8 KV cache needs kv_scales [2, num_blocks, block_size, num_kv_heads]")
        if tuple(kv_scales.shape) != tuple(kv_cache.shape[:4]) or kv_scales.dtype != torch.float32:
            raise ValueError(
                f"kv_scales must be float32 {tuple(kv_cache.shape[:4])}, got {kv_scales.dtype} {tuple(kv_scales.shape)}"
            )
    elif kv_scales is not None:
        raise ValueError(f"kv_scales is only for an int8 KV cache; pass None for {kv_cache.dtype}")


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [..., head_dim] -> int8, [...] fp32
    """Symmetric per-row int8: ``scale = amax / 127``, ``q = floor(x * 127 / amax + 0.5)``.

    NOTE: round-half-up through floor so the Triton store (no rint in the interpreter) is bit-identical.
    A zero row (amax <= 1e-30) gets q 0. Dequantize with ``q * scale``: error <= scale / 2 per element.
    """
    x = x.float()
    amax = x.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(amax > INT8_MIN_AMAX, INT8_MAX / amax.clamp_min(INT8_MIN_AMAX), torch.zeros_like(amax))
    q = torch.floor(x * inv + 0.5).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, (amax / INT8_MAX).squeeze(-1)


def fp8_to_float(raw: torch.Tensor) -> torch.Tensor:  # uint8 bits of e4m3 -> float32
    """e4m3 bytes to fp32, 4-7x faster than torch's CPU cast: the 7 exponent|mantissa bits shifted into
    an fp16's place are the same number times 2^-8 (subnormals included), and fp16 -> fp32 is vectorized.
    NaN (never stored: stores saturate) reads as +-480.

    NOTE: ``(w + (w & 0x80)) << 7`` is ``sign << 15 | (w & 0x7F) << 7`` in three passes instead of
    five: adding the sign bit to itself carries it from bit 14 to bit 15 (int16 wraps; checked on all
    256 bytes by the tests).
    """
    w = raw.to(torch.int16)
    return ((w + (w & 0x80)) << 7).view(torch.float16).float().mul_(256.0)


def _to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Values as an unscaled cache stores them; fp8 saturates (a plain cast turns overflow into NaN)."""
    if dtype == FP8:
        return x.float().clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return x.to(dtype)


def store_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, negative = skip
    kv_scales: torch.Tensor | None = None,  # [2, num_blocks, block_size, num_kv_heads] fp32, int8 caches only
) -> None:
    """Write each token's K and V into its slot of the paged cache (in place).

    fp8 caches store a saturating cast; int8 caches store ``quantize_int8`` of each (token, head) row
    and its scale in ``kv_scales``.
    """
    check_kv_scales(kv_cache, kv_scales)
    num_blocks, block_size = kv_cache.shape[1], kv_cache.shape[2]
    if not _SkipFreeSlots.check(slot_mapping):
        keep = slot_mapping >= 0
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    flat = raw_bytes(kv_cache).view(2, num_blocks * block_size, *kv_cache.shape[3:])
    if kv_scales is not None:
        scales = kv_scales.view(2, num_blocks * block_size, kv_cache.shape[3])
        q, s = quantize_int8(torch.stack((key, value)))  # K and V in one pass of ops
        for i in range(2):
            flat[i].index_copy_(0, slot_mapping, q[i])
            scales[i].index_copy_(0, slot_mapping, s[i])
        return
    flat[0].index_copy_(0, slot_mapping, raw_bytes(_to_cache_dtype(key, kv_cache.dtype)))
    flat[1].index_copy_(0, slot_mapping, raw_bytes(_to_cache_dtype(value, kv_cache.dtype)))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` (HF's neox formula, same roundings) for ``[tokens, heads, head_dim]``;
    ``signed_sin`` is sin with its first half negated, so ``rotate_half(x) * sin == roll(x, half) * signed_sin``."""
    rotated = x.roll(x.shape[-1] // 2, dims=-1).mul_(signed_sin)
    return (x * cos).add_(rotated)


def rope_store_kv(
    qkv: torch.Tensor,  # [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim]: q | k | v
    cos: torch.Tensor,  # [num_tokens, 1, head_dim], gathered for the tokens' positions
    signed_sin: torch.Tensor,  # [num_tokens, 1, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, negative = skip
    num_heads: int,
    num_kv_heads: int,
    kv_scales: torch.Tensor | None = None,
    store=None,  # the backend's store_kv (default: this module's)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # q [T, H, D], k and v [T, KVH, D]
    """Rotate q and k (one pass over both), store k and v in the cache, return q, k and v.

    Backends may rotate ``qkv`` in place (the CPU kernels do); callers must not read ``qkv`` afterwards.
    """
    num_tokens, head_dim = qkv.shape[0], kv_cache.shape[-1]
    q_and_k = (num_heads + num_kv_heads) * head_dim
    qk = apply_rope(qkv[:, :q_and_k].view(num_tokens, -1, head_dim), cos, signed_sin)
    q, k = qk.split([num_heads, num_kv_heads], dim=1)
    v = qkv[:, q_and_k:].view(num_tokens, num_kv_heads, head_dim)
    (store or store_kv)(k, v, kv_cache, slot_mapping, kv_scales=kv_scales)
    return q, k, v


class _SkipFreeSlots:
    """Whether a slot mapping has no skipped (negative) slot, remembered for the last tensor checked.

    NOTE: every layer of a step stores through the same ``slot_mapping`` tensor; checking it once per
    step instead of once per layer saves three ops and a host sync per layer of a CPU decode step.
    Keyed like ``_DecodePlan``: the tensor's identity (weak reference) and version counter.
    """

    _ref: weakref.ref | None = None
    _key: int | None = None

    @classmethod
    def check(cls, slot_mapping: torch.Tensor) -> bool:
        if cls._ref is not None and cls._ref() is slot_mapping and cls._key == _version(slot_mapping):
            return True
        if not bool((slot_mapping >= 0).all()):
            return False
        cls._ref, cls._key = weakref.ref(slot_mapping), _version(slot_mapping)
        return True


def dequantize_cache(kv_cache: torch.Tensor, kv_scales: torch.Tensor | None = None) -> torch.Tensor:
    """The whole cache as fp32 values (tests, debugging): what attention reads from it."""
    check_kv_scales(kv_cache, kv_scales)
    if kv_cache.dtype == FP8:
        return fp8_to_float(raw_bytes(kv_cache))
    if kv_scales is not None:
        return kv_cache.float() * kv_scales.unsqueeze(-1)
    return kv_cache.float()


def _window_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
    """Boolean mask [..., q, k]: True where query position may attend to key position."""
    allowed = k_pos <= q_pos
    if sliding_window is not None:
        # NOTE: same convention as HF Mistral: a query sees the last `sliding_window` tokens, itself included.
        allowed = allowed & (k_pos > q_pos - sliding_window)
    return allowed


def _gather_head_major(
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq]
    positions: torch.Tensor,  # [num_seqs, width] int64 token positions, each inside its sequence
    dtype: torch.dtype,
    kv_scales: torch.Tensor | None = None,  # [2, num_blocks, block_size, num_kv_heads], int8 caches
) -> tuple[torch.Tensor, torch.Tensor]:  # 2 x [num_kv_heads, num_seqs, width, head_dim]
    """K and V of the given positions (dequantized), laid out per KV head so attention runs as batched GEMMs.

    NOTE: one ``index_select`` of head_dim-sized rows per tensor: a row copy each (memcpy), where
    advanced indexing on the 5-D cache copies element by element; the per-head layout comes straight
    out of the gather instead of from a transpose copy afterwards. A quantized cache is gathered at its
    own width (1 byte per element) and only the gathered rows are converted.
    """
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    num_seqs, width = positions.shape
    slots = block_tables.long().gather(1, positions // block_size) * block_size + positions % block_size
    rows = (slots * num_kv_heads).unsqueeze(0) + torch.arange(num_kv_heads, device=slots.device).view(-1, 1, 1)
    rows = rows.view(-1)  # [num_kv_heads * num_seqs * width]
    flat = raw_bytes(kv_cache).reshape(2, num_blocks * block_size * num_kv_heads, head_dim)
    shape = (num_kv_heads, num_seqs, width, head_dim)
    quantized = kv_cache.dtype in (FP8, torch.int8)
    keys, values = (
        (_dequantize_rows(flat[i], rows, kv_scales, i) if quantized else flat[i].index_select(0, rows))
        .view(shape)
        .to(dtype)
        for i in range(2)
    )
    return keys, values


def _decode_positions(
    context_lens: torch.Tensor, sliding_window: int | None
) -> tuple[torch.Tensor, torch.Tensor]:  # 2 x [num_seqs, width]
    """Token positions each decode query attends to, padded to the widest with a repeat of the
    sequence's first visible position (a real token), and which of them are not padding."""
    lens = context_lens.long()
    first = (lens - sliding_window).clamp_min(0) if sliding_window is not None else torch.zeros_like(lens)
    width = int((lens - first).max())
    pos = first.unsqueeze(1) + torch.arange(width, device=lens.device)
    visible = pos < lens.unsqueeze(1)
    return torch.where(visible, pos, first.unsqueeze(1)), visible


class _DecodePlan:
    """Index structures of one decode batch for ``_decode_attention_sparse``, shared by its layers.

    NOTE: every layer of a step passes the same ``block_tables`` / ``context_lens`` tensors, so the
    plan (cache row of every visible token, the sparse pattern) is built once per step: the last one
    is kept, keyed by those tensors' identity (weak references) and version counters (inference-mode
    tensors have none; the runner makes fresh ones every step and never writes them afterwards).

    Columns of the pattern index the K/V rows attention reads from: the cache itself
    (``slot * num_kv_heads + kv_head``), or with ``compact`` a dense copy holding each visible
    (sequence, KV head, token) row once, in that order (``gather_rows`` lists their cache rows), which a
    quantized cache dequantizes into: one conversion per visible element, no padding, no per-query-head
    duplicates.
    """

    _last: _DecodePlan | None = None

    def __init__(
        self,
        block_tables: torch.Tensor,  # [num_seqs, max_blocks]
        context_lens: torch.Tensor,  # [num_seqs]
        sliding_window: int | None,
        num_heads: int,
        kv_shape: tuple[int, ...],
        dtype: torch.dtype,
        compact: bool,
    ) -> None:
        self.key = _plan_key(block_tables, context_lens, sliding_window, num_heads, kv_shape, dtype, compact)
        self._refs = (weakref.ref(block_tables), weakref.ref(context_lens))
        _, num_blocks, block_size, num_kv_heads, _ = kv_shape
        num_seqs = context_lens.shape[0]
        pos, visible = _decode_positions(context_lens, sliding_window)
        self.width = width = pos.shape[1]
        slots = block_tables.long().gather(1, pos // block_size) * block_size + pos % block_size
        kv_rows = slots.unsqueeze(1) * num_kv_heads + torch.arange(num_kv_heads, device=pos.device).view(1, -1, 1)
        if compact:  # kv_rows [seqs, kv_heads, width] -> positions in the dense copy
            mask = visible.unsqueeze(1).expand_as(kv_rows)
            self.gather_rows = kv_rows[mask]
            index = mask.reshape(-1).cumsum(0).sub_(1).view_as(kv_rows)
            # Padding repeats the sequence's first visible position (see _decode_positions): column 0.
            kv_rows = torch.where(mask, index, index[..., :1])
            num_columns = self.gather_rows.numel()
        else:
            num_columns = num_blocks * block_size * num_kv_heads
        group = num_heads // num_kv_heads
        n = num_seqs * num_heads
        self.rows = kv_rows.repeat_interleave(group, dim=1).reshape(n, width)
        self.hidden = ~visible.unsqueeze(1)  # [num_seqs, 1, width]
        self.pattern = torch.sparse_csr_tensor(
            torch.arange(0, n * width + 1, width, device=pos.device),
            self.rows.view(-1),
            torch.zeros(n * width, dtype=dtype, device=pos.device),
            size=(n, num_columns),
            check_invariants=False,
        )

    @classmethod
    def get(
        cls,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        sliding_window: int | None,
        num_heads: int,
        kv_shape: tuple[int, ...],
        dtype: torch.dtype,
        compact: bool = False,
    ) -> _DecodePlan:
        """The plan for this batch: the last one if built for these very tensors, else a new one."""
        plan = cls._last
        key = _plan_key(block_tables, context_lens, sliding_window, num_heads, kv_shape, dtype, compact)
        fresh = plan is not None and plan.key == key
        if not (fresh and plan._refs[0]() is block_tables and plan._refs[1]() is context_lens):
            plan = cls._last = cls(block_tables, context_lens, sliding_window, num_heads, kv_shape, dtype, compact)
        return plan


def _plan_key(block_tables: torch.Tensor, context_lens: torch.Tensor, *rest: object) -> tuple:
    return (*rest, _version(block_tables), _version(context_lens))


def _version(t: torch.Tensor) -> int | None:
    return None if t.is_inference() else t._version


def _decode_attention_sparse(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim] fp32/fp64 on CPU
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    kv_scales: torch.Tensor | None,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    """Decode attention as a sparse product over the K/V rows of the visible tokens: no padded copy.

    Each (sequence, query head) is one row of a sparse pattern whose columns are the K/V rows of its
    visible tokens. ``Q K^T`` is then a sampled dense-dense product (only those dot products), and
    ``P V`` an embedding bag (per-row weighted sum of V rows). Padding (see ``_decode_positions``)
    keeps the pattern a dense ``[rows, width]`` grid. A cache of the query's dtype is read where it
    lies; a quantized one is first dequantized into a dense copy of just the visible rows.
    """
    num_seqs, num_heads, head_dim = query.shape
    compact = kv_cache.dtype != query.dtype
    plan = _DecodePlan.get(
        block_tables, context_lens, sliding_window, num_heads, tuple(kv_cache.shape), query.dtype, compact
    )
    n = num_seqs * num_heads
    flat = raw_bytes(kv_cache).view(2, -1, head_dim)  # [K|V, cache row = slot * num_kv_heads + kv_head, head_dim]
    if compact:
        keys, values = (_dequantize_rows(flat[i], plan.gather_rows, kv_scales, i) for i in range(2))
    else:
        keys, values = flat[0], flat[1]
    scores = torch.sparse.sampled_addmm(plan.pattern, query.reshape(n, head_dim), keys.t(), beta=0.0, alpha=scale)
    scores = scores.values().view(num_seqs, num_heads, plan.width).masked_fill_(plan.hidden, float("-inf"))
    probs = torch.softmax(scores, dim=-1).view(n, plan.width)
    out = torch.nn.functional.embedding_bag(plan.rows, values, per_sample_weights=probs, mode="sum")
    return out.view(num_seqs, num_heads, head_dim)


def _dequantize_rows(
    rows: torch.Tensor, index: torch.Tensor, kv_scales: torch.Tensor | None, which: int
) -> torch.Tensor:  # [len(index), head_dim] float32
    """Rows ``index`` of one flattened K (``which`` 0) or V (1) cache (raw bytes for fp8) as fp32 values.

    NOTE: int8 is converted, then scaled in place: a mixed-type ``int8 * fp32`` takes torch's slow
    promoting path (measured 2.3x slower than the two vectorized passes).
    """
    picked = rows.index_select(0, index)
    if kv_scales is not None:
        return picked.float().mul_(kv_scales[which].view(-1).index_select(0, index).unsqueeze(1))
    return fp8_to_float(picked) if rows.dtype == torch.uint8 else picked.float()


# Caches the fp32 CPU decode reads in place (fp32) or through a dense fp32 copy of the visible rows.
_FP32_READABLE = (torch.float32, torch.float16, torch.bfloat16, FP8, torch.int8)


def decode_attention(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32, padded with any valid id
    context_lens: torch.Tensor,  # [num_seqs] int32, tokens in cache incl. the query's own
    scale: float,
    sliding_window: int | None = None,
    kv_scales: torch.Tensor | None = None,  # [2, num_blocks, block_size, num_kv_heads] fp32, int8 caches only
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    """One query token per sequence attending to its whole cached context (or its last ``sliding_window``).

    Only the visible tokens' K/V are read. On CPU, fp32 queries over an fp32 or narrower cache (and
    fp64 over fp64) take ``_decode_attention_sparse``; any other dtype or device gathers the contexts
    per KV head (padded to the longest) and runs the ``group`` query heads sharing a KV head as the
    rows of batched GEMMs.
    """
    check_kv_scales(kv_cache, kv_scales)
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[3]
    group = num_heads // num_kv_heads
    if num_seqs == 0:
        return query.new_empty(query.shape)
    # fp32 queries over an fp32 cache (read in place) or a quantized one (dequantized to fp32 rows).
    sparse = query.dtype == torch.float32 and kv_cache.dtype in _FP32_READABLE
    cpu = query.device.type == "cpu" and kv_cache.is_contiguous()
    if cpu and (sparse or query.dtype == kv_cache.dtype == torch.float64):
        return _decode_attention_sparse(query, kv_cache, block_tables, context_lens, scale, sliding_window, kv_scales)
    pos, visible = _decode_positions(context_lens, sliding_window)
    width = pos.shape[1]
    keys, values = _gather_head_major(kv_cache, block_tables, pos, query.dtype, kv_scales)  # [kv_heads, seqs, width, d]
    batch = num_kv_heads * num_seqs
    q = query.reshape(num_seqs, num_kv_heads, group, head_dim).transpose(0, 1).reshape(batch, group, head_dim)
    scores = torch.bmm(q, keys.view(batch, width, head_dim).transpose(1, 2)) * scale  # [batch, group, width]
    scores = scores.view(num_kv_heads, num_seqs, group, width).masked_fill(
        ~visible.view(1, num_seqs, 1, width), float("-inf")
    )
    probs = torch.softmax(scores.float(), dim=-1).to(query.dtype).view(batch, group, width)
    out = torch.bmm(probs, values.view(batch, width, head_dim))  # [kv_heads * seqs, group, head_dim]
    return out.view(num_kv_heads, num_seqs, group, head_dim).transpose(0, 1).reshape(num_seqs, num_heads, head_dim)


def prefill_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    cu_seqlens_q: torch.Tensor,  # [num_seqs + 1] int32, query chunk boundaries
    context_lens: torch.Tensor,  # [num_seqs] int32, cached prefix + this chunk (all already stored)
    scale: float,
    sliding_window: int | None = None,
    kv_scales: torch.Tensor | None = None,  # [2, num_blocks, block_size, num_kv_heads] fp32, int8 caches only
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Variable-length query chunks attending causally to their cached prefix and to themselves.

    Sequence ``s`` owns queries ``cu_seqlens_q[s]:cu_seqlens_q[s+1]``; they sit at the last
    ``q_len`` positions of its ``context_lens[s]`` tokens, whose K/V are all in the cache already.
    """
    check_kv_scales(kv_cache, kv_scales)
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[3]
    out = torch.empty_like(query)
    starts = cu_seqlens_q.tolist()
    lens = context_lens.tolist()
    dev = query.device
    # NOTE: one iteration per sequence (not per token), each a single SDPA call. The 4-D form with
    # enable_gqa takes torch's fused CPU (flash) kernel: the query heads sharing a KV head read it in
    # place, and no [q_len, ctx] score matrix is materialized (3-D inputs fall back to the math path).
    gqa = num_kv_heads != num_heads
    for s, ctx in enumerate(lens):
        q0, q1 = starts[s], starts[s + 1]
        q_len = q1 - q0
        if q_len == 0:
            continue
        # Keys before the first query's window are never needed: do not read them.
        first = max(0, ctx - q_len - sliding_window + 1) if sliding_window is not None else 0
        k_pos = torch.arange(first, ctx, device=dev)
        keys, values = _gather_head_major(
            kv_cache, block_tables[s : s + 1], k_pos.unsqueeze(0), query.dtype, kv_scales
        )
        q = query[q0:q1].transpose(0, 1).unsqueeze(0)  # [1, num_heads, q_len, head_dim]
        k, v = keys.transpose(0, 1), values.transpose(0, 1)  # [1, kv_heads, ctx - first, head_dim]
        if first == 0 and q_len == ctx and sliding_window is None:
            # A whole prompt: plain causal attention, no mask tensor.
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            q_pos = torch.arange(ctx - q_len, ctx, device=dev).unsqueeze(1)
            mask = _window_mask(q_pos, k_pos.unsqueeze(0), sliding_window)  # [q_len, ctx - first]
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
        out[q0:q1] = o[0].transpose(0, 1)
    return out


def copy_blocks(
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    src: torch.Tensor,  # [n] int64 block ids
    dst: torch.Tensor,  # [n] int64 block ids
) -> None:
    """Copy whole blocks inside one cache (copy-on-write)."""
    raw = raw_bytes(kv_cache)
    raw[:, dst.long()] = raw[:, src.long()]


def swap_blocks(
    src_cache: torch.Tensor,  # [2, num_src_blocks, block_size, num_kv_heads, head_dim]
    dst_cache: torch.Tensor,  # [2, num_dst_blocks, block_size, num_kv_heads, head_dim]
    src_ids: torch.Tensor,  # [n] int64 block ids in src_cache
    dst_ids: torch.Tensor,  # [n] int64 block ids in dst_cache
) -> None:
    """Move blocks between two caches (device pool <-> host swap space); bit-exact."""
    src_ids = src_ids.to(src_cache.device).long()
    gathered = raw_bytes(src_cache)[:, src_ids]
    raw_bytes(dst_cache)[:, dst_ids.to(dst_cache.device).long()] = gathered.to(dst_cache.device, non_blocking=True)
