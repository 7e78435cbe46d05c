"""`kvserve bench kernels`: check the Triton paged-attention kernels against the reference, and time them.

On a GPU, for every (block size, batch, context) of the grid it

1. checks decode against ``kernels.reference`` in bf16 and fp16 (sizes the reference can hold),
2. times decode with ``triton.testing.do_bench`` in ``--time-dtype`` and reports the achieved bandwidth
   (bytes of Q + K/V read once + output written once, over kernel time) next to a measured
   device-to-device copy bandwidth (read + write bytes over copy time),
   once per ``--kv-cache-dtypes`` entry: ``auto`` (a cache of the query's dtype, as above), ``fp8``
   (float8_e4m3fn) and ``int8`` (with per (token, KV head) fp32 scales). A quantized cache is filled by
   ``kernels.cache_ops.store_kv`` from random K/V, checked against the fp32 reference run on the
   dequantized cache (``kernels.reference.dequantize_cache``), and its bandwidth counts K/V at one byte
   per element plus, for int8, the scales (4 bytes per token per KV head, for K and for V),
3. times prefill (no cached prefix; ``kernels.prefill``, the Triton backend's prefill, paged and contiguous)
   against ``torch.nn.functional.scaled_dot_product_attention`` on the same data laid out contiguously, and
   checks the outputs agree,
4. times a paged prefill with a cached prefix (``--prefix-lens`` cached tokens, ``--prefix-new-tokens`` new
   ones, keys read through the block table) beside SDPA, which cannot read a paged cache: once on K/V
   gathered beforehand and once including that gather (what a caller without a paged kernel pays).

Each row is printed (and flushed) as soon as it is measured; the tables follow at the end. The bandwidth
reference is measured on a 4 GiB buffer after a warm-up, as a device-to-device copy (read + write bytes)
and as a read-only reduction (the access pattern of decode), and printed with the card's nominal bandwidth
where the device is known (``NOMINAL_BANDWIDTH_GBS``). The default grid is sized to finish in about a
minute on an H200 (the points of the issue's targets); widen it with the options.

``--dry-run`` runs on CPU under the Triton interpreter (``TRITON_INTERPRET=1``) with tiny sizes: it checks
that everything parses, launches and matches the reference, and makes no timing claims.

Usage: ``python -m kvserve.cluster.bench.kernels [--dry-run] [--json-out PATH]`` (the CLI wires ``add_arguments``
and ``run`` into ``kvserve bench kernels``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import sys
import time
from typing import Any

import torch

TOLERANCE = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1e-2}
# Bound on a quantized cache's store error (norm of dequantized - stored K/V over the norm of the K/V, N(0, 1)
# data): e4m3 keeps 3 mantissa bits (rounding error <= 2^-4 relative, ~0.03 in norm); int8's is <= amax/254
# per element (~0.007 in norm for rows of 64-128 Gaussians). A store that drops or garbles values fails it.
STORE_TOLERANCE = {"fp8": 0.05, "int8": 0.02}
SHORT = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}
DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
}


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _names(text: str) -> list[str]:
    out = []
    for x in text.split(","):
        x = x.strip()
        if x:
            if x not in DTYPES:
                raise argparse.ArgumentTypeError(f"unknown dtype {x!r}; expected one of {sorted(DTYPES)}")
            out.append(str(DTYPES[x]).removeprefix("torch."))
    return out


KV_CACHE_DTYPES = ("auto", "fp8", "int8")  # "auto": a cache of the query's dtype


def _kv_names(text: str) -> list[str]:
    out: list[str] = []
    for x in text.split(","):
        x = x.strip().lower()
        if not x:
            continue
        if x not in KV_CACHE_DTYPES:
            raise argparse.ArgumentTypeError(f"unknown KV cache dtype {x!r}; expected one of {KV_CACHE_DTYPES}")
        if x not in out:
            out.append(x)
    if not out:
        raise argparse.ArgumentTypeError(f"no KV cache dtype given; expected some of {KV_CACHE_DTYPES}")
    return out


def _quantized_dtype(name: str) -> torch.dtype:
    return {"fp8": torch.float8_e4m3fn, "int8": torch.int8}[name]


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Register the bench's options on ``parser`` (a subcommand parser of ``kvserve bench``)."""
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="CPU/interpreter smoke run with tiny sizes: parse, launch, verify; no timing",
    )
    parser.add_argument("--json-out", default=None, metavar="PATH", help="write the results as JSON here")
    parser.add_argument("--batches", type=_ints, default=[1, 16, 256], help="decode batch sizes")
    parser.add_argument("--contexts", type=_ints, default=[4096, 32768], help="decode context lengths")
    parser.add_argument("--block-sizes", type=_ints, default=[16], help="KV block sizes")
    parser.add_argument("--num-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument(
        "--check-dtypes",
        type=_names,
        default=["bfloat16", "float16"],
        help="dtypes checked against the reference",
    )
    parser.add_argument("--time-dtype", type=_names, default=["bfloat16"], help="dtype timed")
    parser.add_argument(
        "--kv-cache-dtypes",
        type=_kv_names,
        default=list(KV_CACHE_DTYPES),
        help="decode KV cache dtypes, comma list of auto (the query's dtype), fp8, int8 (per-row scales)",
    )
    parser.add_argument(
        "--check-max-tokens",
        type=int,
        default=1 << 17,
        help="check decode against the reference only when batch*context <= this",
    )
    parser.add_argument("--max-kv-gib", type=float, default=48.0, help="skip configs whose K/V exceed this")
    parser.add_argument("--prefill-lens", type=_ints, default=[2048, 8192], help="prefill sequence lengths")
    parser.add_argument("--prefill-batches", type=_ints, default=[1, 4], help="prefill batch sizes")
    parser.add_argument(
        "--prefix-lens", type=_ints, default=[1024, 8192], help="cached prefix lengths of the prefix rows"
    )
    parser.add_argument("--prefix-new-tokens", type=int, default=512, help="new tokens after the cached prefix")
    parser.add_argument("--prefix-batches", type=_ints, default=[1], help="batch sizes of the prefix rows")
    parser.add_argument(
        "--no-cuda-graph",
        dest="cuda_graph",
        action="store_false",
        help="time eager launches (includes Python launch overhead) instead of a CUDA graph",
    )
    parser.add_argument("--warmup-ms", type=int, default=10)
    parser.add_argument("--rep-ms", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    return parser


@dataclasses.dataclass
class DecodeRow:
    block_size: int
    batch: int
    context: int
    num_splits: int
    checks: dict[str, float]  # dtype (or "dtype/N-split" for a forced split count) -> rel. error vs reference
    kv_cache_dtype: str = "auto"  # "auto" (the query's dtype) | "fp8" | "int8"
    store_rel_err: float | None = None  # fp8/int8, checked rows: dequantized cache vs the K/V stored into it
    timing: str | None = None  # "cudagraph" | "eager"
    time_us: float | None = None
    bytes_moved: int | None = None
    bandwidth_gbs: float | None = None
    fraction_of_reference: float | None = None  # of the measured reference (best of copy and read)
    fraction_of_nominal: float | None = None  # of the card's nominal bandwidth, where known
    skipped: str | None = None


@dataclasses.dataclass
class PrefillRow:
    block_size: int
    batch: int
    seq_len: int
    checks: dict[str, float]  # dtype (or "dtype/contiguous") -> rel. error vs reference (dry run) or SDPA (GPU)
    prefix: int = 0  # cached tokens before the seq_len new ones (read through the block table)
    timing: str | None = None
    triton_us: float | None = None  # the paged kernel (kernels.prefill.paged_prefill_attention)
    contiguous_us: float | None = None  # the same kernel on contiguous K/V (no prefix rows only)
    sdpa_us: float | None = None  # SDPA on contiguous K/V (gathered beforehand for prefix rows)
    sdpa_gather_us: float | None = None  # prefix rows: gathering K/V out of the paged cache, then SDPA
    triton_tflops: float | None = None
    sdpa_tflops: float | None = None
    skipped: str | None = None


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.float(), ref.float()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def _paged(
    batch: int,
    ctx: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: str,
    gen: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A cache holding ``batch`` sequences of ``ctx`` tokens each, in shuffled blocks."""
    per_seq = math.ceil(ctx / block_size)
    num_blocks = batch * per_seq + 1
    kv_cache = torch.randn(
        (2, num_blocks, block_size, num_kv_heads, head_dim), dtype=dtype, device=device, generator=gen
    )
    perm = torch.randperm(num_blocks, device=device, generator=gen)[: batch * per_seq]
    block_tables = perm.view(batch, per_seq).to(torch.int32)
    context_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    return kv_cache, block_tables, context_lens


def _quantized_paged(
    batch: int,
    ctx: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    kv_dtype: torch.dtype,
    src_dtype: torch.dtype,
    device: str,
    gen: torch.Generator,
    chunk_tokens: int = 1 << 16,
    store_err: list[float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """Like ``_paged``, for an fp8/int8 cache: each sequence's ``ctx`` tokens get random ``src_dtype`` K/V
    quantized into their slots by ``cache_ops.store_kv`` (``chunk_tokens`` tokens per launch, so the
    unquantized K/V never exist whole); slots no sequence covers stay zero, as in a served cache. With a
    ``store_err`` list, appends the stored tokens' relative error (dequantized cache vs the K/V stored).

    Returns ``(kv_cache, kv_scales or None, block_tables, context_lens)``.
    """
    from kvserve.kernels import cache_ops, reference

    per_seq = math.ceil(ctx / block_size)
    num_blocks = batch * per_seq + 1
    kv_cache = torch.zeros((2, num_blocks, block_size, num_kv_heads, head_dim), dtype=kv_dtype, device=device)
    kv_scales = None
    if kv_dtype == torch.int8:
        kv_scales = torch.zeros((2, num_blocks, block_size, num_kv_heads), dtype=torch.float32, device=device)
    perm = torch.randperm(num_blocks, device=device, generator=gen)[: batch * per_seq]
    block_tables = perm.view(batch, per_seq).to(torch.int32)
    context_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    pos = torch.arange(ctx, device=device)
    slots = (block_tables.long()[:, pos // block_size] * block_size + pos % block_size).view(-1)  # [batch * ctx]
    err_sq = ref_sq = 0.0
    for start in range(0, slots.numel(), chunk_tokens):
        chunk = slots[start : start + chunk_tokens]
        src = torch.randn((2, chunk.numel(), num_kv_heads, head_dim), dtype=src_dtype, device=device, generator=gen)
        cache_ops.store_kv(src[0], src[1], kv_cache, chunk, kv_scales)
        if store_err is not None:
            blk, off = chunk // block_size, chunk % block_size
            # NOTE: raw bytes, as torch has no CPU index kernels for fp8; [2, n, 1 (block), kvh, hd]
            stored = reference.raw_bytes(kv_cache)[:, blk, off].view(kv_dtype).unsqueeze(2)
            scales = kv_scales[:, blk, off].unsqueeze(2) if kv_scales is not None else None
            src = src.float()
            err_sq += float((reference.dequantize_cache(stored, scales).squeeze(2) - src).square().sum())
            ref_sq += float(src.square().sum())
            del stored, scales
        del src
    if store_err is not None:
        store_err.append(math.sqrt(err_sq / max(ref_sq, 1e-30)))
    return kv_cache, kv_scales, block_tables, context_lens


def _generator(device: str, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


class Timer:
    """Median kernel time in ms: a CUDA graph replay when possible (no Python launch overhead in the
    number), else eager ``triton.testing.do_bench``."""

    def __init__(self, args: argparse.Namespace) -> None:
        from triton.testing import do_bench, do_bench_cudagraph

        self.args = args
        self._eager = do_bench
        self._graph = do_bench_cudagraph

    def __call__(self, fn: Any) -> tuple[float, str]:
        fn()  # compile outside the measurement (and outside any graph capture)
        torch.cuda.synchronize()
        if self.args.cuda_graph:
            try:
                return self._graph(fn, rep=self.args.rep_ms, return_mode="median"), "cudagraph"
            except Exception as exc:  # any capture failure: fall back to eager timing (the row says which)
                print(
                    f"cuda graph timing failed ({type(exc).__name__}: {exc}); timing eagerly", file=sys.stderr
                )
                torch.cuda.synchronize()
        ms = self._eager(fn, warmup=self.args.warmup_ms, rep=self.args.rep_ms, return_mode="median")
        return ms, "eager"

    def eager(self, fn: Any) -> float:
        """Median ms of eager launches (for references whose graph capture would change what is measured)."""
        return self._eager(fn, warmup=self.args.warmup_ms, rep=self.args.rep_ms, return_mode="median")


# Nominal HBM bandwidth (GB/s) by device-name substring, most specific first: the vendor's figure, printed
# beside the measured reference so a reading can be judged against the card, not only against a copy.
NOMINAL_BANDWIDTH_GBS = (
    ("H200", 4800.0),
    ("H100 NVL", 3900.0),
    ("H100 PCIe", 2000.0),
    ("H100", 3350.0),
    ("H20", 4000.0),
    ("GH200", 4000.0),
    ("B200", 8000.0),
    ("A100-SXM4-80GB", 2039.0),
    ("A100 80GB PCIe", 1935.0),
    ("A100", 1555.0),
    ("L40S", 864.0),
    ("L4", 300.0),
    ("A10G", 600.0),
)
REFERENCE_BUFFER_BYTES = 4 << 30  # far beyond L2 (50-60 MB), so the reference streams HBM as decode does


def nominal_bandwidth_gbs(device_name: str) -> float | None:
    """The vendor's HBM bandwidth for a device name (``torch.cuda.get_device_name()``), None if unknown."""
    for key, gbs in NOMINAL_BANDWIDTH_GBS:
        if key.lower() in device_name.lower():
            return gbs
    return None


def _reference_bandwidth(device: str, timer: Timer, nbytes: int = REFERENCE_BUFFER_BYTES) -> dict[str, float]:
    """Measured HBM bandwidth in GB/s: ``copy`` (device-to-device, read + write bytes) and ``read`` (a sum
    over the buffer, read bytes; decode's own pattern), each on ``nbytes`` after warm-up launches.

    NOTE: a 1 GiB copy timed inside a CUDA graph read 2.7 TB/s on an H200 while decode reached 4.1 TB/s:
    the reference is timed eagerly (many back-to-back launches) on a bigger buffer, and read-only too.
    """
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    sink = torch.empty((), dtype=torch.float32, device=device)
    copy_fn = lambda: dst.copy_(src)  # noqa: E731
    read_fn = lambda: torch.sum(src, out=sink)  # noqa: E731
    result = {}
    for name, fn, moved in (("copy", copy_fn, 2 * nbytes), ("read", read_fn, nbytes)):
        for _ in range(3):  # warm-up: clocks up, allocator and kernels ready
            fn()
        torch.cuda.synchronize()
        ms = timer.eager(fn)
        result[name] = moved / (ms * 1e-3) / 1e9
    return result  # NOTE: the buffers go with this frame; the caller empties the cache


def _time_decode(
    row: DecodeRow,
    timer: Timer,
    ref_gbs: tuple[float | None, float | None],
    q: torch.Tensor,
    kv: torch.Tensor,
    kv_scales: torch.Tensor | None,
    bt: torch.Tensor,
    cl: torch.Tensor,
    scale: float,
    kv_bytes: int,
) -> None:
    """Time one decode (into a preallocated output) and fill ``row``'s timing fields; bytes moved =
    Q read + output written (query dtype) + ``kv_bytes`` (K/V, and int8 scales, read once) + the block table."""
    from kvserve.kernels import attention

    out = torch.empty_like(q)

    def call() -> torch.Tensor:
        return attention.decode_attention(q, kv, bt, cl, scale, out=out, kv_scales=kv_scales)

    ms, row.timing = timer(call)
    moved = 2 * q.numel() * q.element_size() + kv_bytes + bt.numel() * bt.element_size()
    row.time_us = ms * 1e3
    row.bytes_moved = moved
    row.bandwidth_gbs = moved / (ms * 1e-3) / 1e9
    measured, nominal = ref_gbs
    row.fraction_of_reference = row.bandwidth_gbs / measured if measured else None
    row.fraction_of_nominal = row.bandwidth_gbs / nominal if nominal else None


def _checks_text(checks: dict[str, float], store: float | None = None) -> str:
    items = [f"{_short(k)}={v:.1e}" for k, v in checks.items()]
    if store is not None:
        items.insert(0, f"store={store:.1e}")
    return " ".join(items) or "-"


def _emit_decode(row: DecodeRow) -> None:
    """One line per decode row, flushed as soon as it is measured (a long grid shows progress in the log)."""
    what = row.skipped or _checks_text(row.checks, row.store_rel_err)
    timing = ""
    if row.time_us is not None:
        timing = f" {row.time_us:.1f} us {row.bandwidth_gbs:.0f} GB/s"
        if row.fraction_of_reference is not None:
            timing += f" ({100 * row.fraction_of_reference:.0f}% of ref"
            timing += f", {100 * row.fraction_of_nominal:.0f}% of nominal)" if row.fraction_of_nominal else ")"
    print(f"decode block={row.block_size} batch={row.batch} ctx={row.context} kv={row.kv_cache_dtype} "
          f"splits={row.num_splits}: {what}{timing}", flush=True)  # fmt: skip


def _emit_prefill(row: PrefillRow) -> None:
    what = row.skipped or _checks_text(row.checks)
    timing = ""
    if row.triton_us is not None:
        timing = f" triton {row.triton_us:.1f} us ({row.triton_tflops:.1f} TF/s) sdpa {row.sdpa_us:.1f} us"
        timing += f" ({row.sdpa_tflops:.1f} TF/s)"
        if row.contiguous_us is not None:
            timing += f" triton-contiguous {row.contiguous_us:.1f} us"
        if row.sdpa_gather_us is not None:
            timing += f" gather+sdpa {row.sdpa_gather_us:.1f} us"
    print(f"prefill block={row.block_size} batch={row.batch} prefix={row.prefix} new={row.seq_len}: {what}{timing}",
          flush=True)  # fmt: skip


def _check_splits(
    row: DecodeRow, name: str, ref: torch.Tensor, forced_splits: list[int | None], decode: Any
) -> None:
    """Record ``decode(num_splits=n)``'s error vs ``ref`` for each forced split count (None = the launcher's)."""
    for forced in forced_splits:
        row.checks[name if forced is None else f"{name}/{forced}-split"] = _rel_err(decode(num_splits=forced), ref)


def _bench_decode(
    args: argparse.Namespace, device: str, timer: Timer | None, ref_gbs: tuple[float | None, float | None]
) -> list[DecodeRow]:
    from kvserve.kernels import attention, reference

    rows = []
    h, kvh, hd = args.num_heads, args.num_kv_heads, args.head_dim
    scale = hd**-0.5
    time_dtype = DTYPES[args.time_dtype[0]]
    # NOTE: Triton converts float8e4nv only on compute capability >= 8.9 (the kernels refuse fp8 below it).
    fp8_ok = device != "cuda" or torch.cuda.get_device_capability() >= (8, 9)
    # the dry run also forces the split + merge path the tiny sizes would not pick
    forced_splits = [None, 3] if args.dry_run else [None]
    for bs in args.block_sizes:
        for batch in args.batches:
            for ctx in args.contexts:
                # what the launcher picks: it bounds the context by the block table's width (no sync)
                table_tokens = math.ceil(ctx / bs) * bs
                splits = attention.choose_num_splits(
                    batch, kvh, table_tokens, bs, num_sms=attention._num_sms(torch.device(device))
                )
                check = batch * ctx <= args.check_max_tokens
                for kv_name in args.kv_cache_dtypes:
                    row = DecodeRow(bs, batch, ctx, splits, checks={}, kv_cache_dtype=kv_name)
                    rows.append(row)
                    tokens = batch * ctx
                    if kv_name == "auto":
                        kv_bytes = 2 * tokens * kvh * hd * time_dtype.itemsize
                    else:  # one byte per element, plus int8's fp32 scale per (token, KV head) for K and V
                        kv_bytes = 2 * tokens * kvh * (hd + (4 if kv_name == "int8" else 0))
                    if kv_bytes > args.max_kv_gib * (1 << 30):
                        row.skipped = f"K/V {kv_bytes / (1 << 30):.1f} GiB > --max-kv-gib"
                        _emit_decode(row)
                        continue
                    if kv_name == "fp8" and not fp8_ok:
                        row.skipped = "fp8 KV needs compute capability >= 8.9"
                        _emit_decode(row)
                        continue
                    gen = _generator(device, args.seed)
                    if kv_name == "auto":
                        if check:
                            for name in args.check_dtypes:
                                dtype = DTYPES[name]
                                kv, bt, cl = _paged(batch, ctx, bs, kvh, hd, dtype, device, gen)
                                q = torch.randn((batch, h, hd), dtype=dtype, device=device, generator=gen)
                                ref = reference.decode_attention(q, kv, bt, cl, scale)
                                decode = functools.partial(attention.decode_attention, q, kv, bt, cl, scale)
                                _check_splits(row, name, ref, forced_splits, decode)
                                del kv, bt, cl, q, ref
                        if timer is not None:
                            kv, bt, cl = _paged(batch, ctx, bs, kvh, hd, time_dtype, device, gen)
                            q = torch.randn((batch, h, hd), dtype=time_dtype, device=device, generator=gen)
                            _time_decode(row, timer, ref_gbs, q, kv, None, bt, cl, scale, kv_bytes)
                            del kv, bt, cl, q
                    else:
                        # One quantized cache (K/V drawn in the timed dtype, stored by the store kernel) serves
                        # every check and the timing; the reference runs in fp32 on its dequantized values.
                        store_err: list[float] = []
                        kv, sc, bt, cl = _quantized_paged(
                            batch,
                            ctx,
                            bs,
                            kvh,
                            hd,
                            _quantized_dtype(kv_name),
                            time_dtype,
                            device,
                            gen,
                            store_err=store_err if check else None,
                        )
                        if check:
                            row.store_rel_err = store_err[0]
                            deq = reference.dequantize_cache(kv, sc)
                            for name in args.check_dtypes:
                                dtype = DTYPES[name]
                                q = torch.randn((batch, h, hd), dtype=dtype, device=device, generator=gen)
                                ref = reference.decode_attention(q.float(), deq, bt, cl, scale)
                                decode = functools.partial(
                                    attention.decode_attention, q, kv, bt, cl, scale, kv_scales=sc
                                )
                                _check_splits(row, name, ref, forced_splits, decode)
                                del q, ref
                            del deq
                        if timer is not None:
                            q = torch.randn((batch, h, hd), dtype=time_dtype, device=device, generator=gen)
                            _time_decode(row, timer, ref_gbs, q, kv, sc, bt, cl, scale, kv_bytes)
                            del q
                        del kv, sc, bt, cl
                    _emit_decode(row)
                    if device == "cuda":
                        torch.cuda.empty_cache()
    return rows


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal SDPA on queries [B, H, L, D] over GQA K/V [B, Hkv, S, D]; the queries are the last L of the S
    positions (S > L: a cached prefix, causal mask aligned to the lower right)."""
    lq, lk = q.shape[2], k.shape[2]
    group = q.shape[1] // k.shape[1]
    if lq == lk:
        try:
            return torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=scale, enable_gqa=True
            )
        except TypeError:  # torch < 2.5 has no enable_gqa
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    from torch.nn.attention.bias import causal_lower_right

    bias = causal_lower_right(lq, lk)
    try:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale, enable_gqa=True)
    except (TypeError, RuntimeError, ValueError):  # a torch whose CausalBias path takes no GQA
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)


def _gather_kv(kv: torch.Tensor, bt: torch.Tensor, ctx: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of every sequence's first ``ctx`` tokens out of the paged cache, contiguous [B, Hkv, ctx, D]:
    what SDPA needs first, as it cannot follow a block table."""
    blocks = bt.long()
    k = kv[0][blocks].flatten(1, 2)[:, :ctx].transpose(1, 2).contiguous()
    v = kv[1][blocks].flatten(1, 2)[:, :ctx].transpose(1, 2).contiguous()
    return k, v


def _prefill_case(
    args: argparse.Namespace, row: PrefillRow, name: str, device: str, timer: Timer | None, contiguous: bool
) -> None:
    """Check (and time, for the timed dtype) one prefill point: ``row.batch`` sequences of ``row.seq_len`` new
    tokens after ``row.prefix`` cached ones, K/V all in a paged cache."""
    from kvserve.kernels import prefill, reference

    h, kvh, hd = args.num_heads, args.num_kv_heads, args.head_dim
    scale = hd**-0.5
    dtype = DTYPES[name]
    batch, new, ctx = row.batch, row.seq_len, row.prefix + row.seq_len
    gen = _generator(device, args.seed)
    kv, bt, cl = _paged(batch, ctx, row.block_size, kvh, hd, dtype, device, gen)
    q = torch.randn((batch * new, h, hd), dtype=dtype, device=device, generator=gen)
    cu = torch.arange(0, batch + 1, dtype=torch.int32, device=device) * new
    out = torch.empty_like(q)

    def triton_call() -> torch.Tensor:
        return prefill.paged_prefill_attention(q, kv, bt, cu, cl, scale, out=out, max_query_len=new)

    qs = q.view(batch, new, h, hd).transpose(1, 2).contiguous()  # [B, H, new, D]

    def gather_sdpa_call() -> torch.Tensor:
        return _sdpa(qs, *_gather_kv(kv, bt, ctx), scale)

    triton_call()
    k, v = _gather_kv(kv, bt, ctx)  # [B, Hkv, ctx, D]
    sdpa_out = _sdpa(qs, k, v, scale).transpose(1, 2).reshape(batch * new, h, hd)
    timing = timer is not None
    ref = sdpa_out if timing else reference.prefill_attention(q, kv, bt, cu, cl, scale)
    checked = name in args.check_dtypes
    if checked:
        row.checks[name] = _rel_err(out, ref)
        if not timing:  # the dry run also checks the SDPA path the GPU rows compare against
            row.checks[f"{name}/sdpa"] = _rel_err(sdpa_out, ref)
    kc = vc = None
    if contiguous:  # the same kernel on K/V held contiguously, [tokens, Hkv, D]
        kc = k.transpose(1, 2).reshape(batch * new, kvh, hd)
        vc = v.transpose(1, 2).reshape(batch * new, kvh, hd)
        out_c = prefill.flash_attention_varlen(q, kc, vc, cu, scale, max_seqlen=new)
        if checked:
            row.checks[f"{name}/contiguous"] = _rel_err(out_c, ref)
        del out_c
    if timing and name == args.time_dtype[0]:
        flops = 4 * batch * h * hd * new * (row.prefix + (new + 1) / 2)  # causal: QK^T and PV
        t_ms, row.timing = timer(triton_call)
        s_ms, _ = timer(lambda: _sdpa(qs, k, v, scale))
        row.triton_us, row.sdpa_us = t_ms * 1e3, s_ms * 1e3
        row.triton_tflops = flops / (t_ms * 1e-3) / 1e12
        row.sdpa_tflops = flops / (s_ms * 1e-3) / 1e12
        if kc is not None:
            out_c = torch.empty_like(q)
            c_ms, _ = timer(lambda: prefill.flash_attention_varlen(q, kc, vc, cu, scale, out=out_c, max_seqlen=new))
            row.contiguous_us = c_ms * 1e3
        if row.prefix:
            row.sdpa_gather_us = timer(gather_sdpa_call)[0] * 1e3


def _bench_prefill(args: argparse.Namespace, device: str, timer: Timer | None) -> list[PrefillRow]:
    """The no-prefix rows (``--prefill-lens`` x ``--prefill-batches``), then the cached-prefix rows
    (``--prefix-lens`` x ``--prefix-batches``, ``--prefix-new-tokens`` new tokens each)."""
    rows = []
    timing = timer is not None
    names = args.check_dtypes if not timing else sorted({*args.check_dtypes, args.time_dtype[0]})
    points = [(bs, b, n, 0) for bs in args.block_sizes for b in args.prefill_batches for n in args.prefill_lens]
    new = args.prefix_new_tokens
    points += [(bs, b, new, p) for bs in args.block_sizes for b in args.prefix_batches for p in args.prefix_lens]
    for bs, batch, new, prefix in points:
        row = PrefillRow(bs, batch, new, checks={}, prefix=prefix)
        for name in names:
            _prefill_case(args, row, name, device, timer, contiguous=prefix == 0)
        if device == "cuda":
            torch.cuda.empty_cache()
        rows.append(row)
        _emit_prefill(row)
    return rows


def _short(name: str) -> str:
    dtype, _, rest = name.partition("/")
    return SHORT.get(dtype, dtype) + (f"/{rest}" if rest else "")


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _print_tables(result: dict[str, Any]) -> None:
    ref = result.get("reference_bandwidth_gbs") or {}
    nominal = result.get("nominal_bandwidth_gbs")
    title = f"paged decode ({result['device']}, timed in {result['time_dtype']}, kv auto = query dtype"
    if ref:
        title += f"; HBM copy {ref['copy']:.0f}, read {ref['read']:.0f} GB/s measured"
        title += f", nominal {nominal:.0f} GB/s)" if nominal else ", nominal unknown)"
    else:
        title += ", no timing)"

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{100 * x:.0f}%"

    decode_rows = [
        [
            str(r["block_size"]), str(r["batch"]), str(r["context"]), r.get("kv_cache_dtype", "auto"),
            str(r["num_splits"]), r["skipped"] or _checks_text(r["checks"], r.get("store_rel_err")),
            _fmt(r["time_us"], ".1f"), _fmt(r["bandwidth_gbs"], ".0f"), pct(r["fraction_of_reference"]),
            pct(r["fraction_of_nominal"]),
        ]
        for r in result["decode"]
    ]  # fmt: skip

    def prefill_row(r: dict[str, Any], extra: list[str]) -> list[str]:
        return [
            str(r["block_size"]), str(r["batch"]), *extra, r["skipped"] or _checks_text(r["checks"]),
            _fmt(r["triton_us"], ".1f"), _fmt(r["sdpa_us"], ".1f"), _fmt(r["triton_tflops"], ".1f"),
            _fmt(r["sdpa_tflops"], ".1f"),
        ]  # fmt: skip

    plain = [prefill_row(r, [str(r["seq_len"])]) + [_fmt(r["contiguous_us"], ".1f")]
             for r in result["prefill"] if not r["prefix"]]  # fmt: skip
    prefixed = [prefill_row(r, [str(r["prefix"]), str(r["seq_len"])]) + [_fmt(r["sdpa_gather_us"], ".1f")]
                for r in result["prefill"] if r["prefix"]]  # fmt: skip
    timing_cols = ("triton us", "sdpa us", "triton TF/s", "sdpa TF/s")
    tables = [
        (title, ("block", "batch", "context", "kv", "splits", "check rel err", "time us", "GB/s", "of ref",
                 "of nominal"), decode_rows),
        ("prefill (no cached prefix): paged Triton vs torch SDPA on contiguous K/V",
         ("block", "batch", "seq len", "check rel err", *timing_cols, "triton contiguous us"), plain),
        ("prefill after a cached prefix: paged Triton vs SDPA on K/V gathered beforehand (and with the gather)",
         ("block", "batch", "prefix", "new", "check rel err", *timing_cols, "gather+sdpa us"), prefixed),
    ]  # fmt: skip
    verdict = "all passed" if result["checks_passed"] else "FAILED"
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # NOTE: the GPU machine may lack rich: plain markdown tables then
        for name, headers, rows in tables:
            print(f"\n{name}\n| " + " | ".join(headers) + " |\n|" + "---|" * len(headers))
            for row in rows:
                print("| " + " | ".join(row) + " |")
        print(f"checks: {verdict}")
        return
    # NOTE: piped into a log (gpu_check.sh), rich would wrap to 80 columns and cut the check cells.
    console = Console(width=None if sys.stdout.isatty() or "COLUMNS" in os.environ else 160)
    for name, headers, rows in tables:
        table = Table(title=name)
        for col in headers:
            table.add_column(col, justify="right")
        for row in rows:
            table.add_row(*row)
        console.print(table)
    console.print("checks: " + (f"[green]{verdict}[/green]" if result["checks_passed"] else f"[red]{verdict}[/red]"))


def _apply_dry_run_sizes(args: argparse.Namespace, device: str) -> None:
    args.batches, args.contexts, args.block_sizes = [1, 2], [17, 40], [16, 32]
    args.num_heads, args.num_kv_heads, args.head_dim = 4, 2, 64
    args.prefill_lens, args.prefill_batches = [5, 33], [1, 2]
    args.prefix_lens, args.prefix_new_tokens, args.prefix_batches = [17, 40], 9, [1, 2]
    if device == "cpu":  # NOTE: the interpreter has no bfloat16
        args.check_dtypes = ["float16", "float32"]
        args.time_dtype = ["float16"]


def _interpreted(module: Any) -> bool:
    """Whether an already imported kernel module was decorated under the Triton interpreter."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(module._paged_decode_kernel, InterpretedFunction)


def run(args: argparse.Namespace) -> int:
    """Run the kernel bench described by ``args`` (see ``add_arguments``); returns a process exit code.

    0 when every check is within tolerance, 1 when one is not, 2 when no GPU is there for a timed run.
    """
    has_cuda = torch.cuda.is_available()
    if args.dry_run and not has_cuda:
        # NOTE: must precede the first import of the kernels (triton.jit picks interpreter vs compiler then).
        os.environ["TRITON_INTERPRET"] = "1"
        if "kvserve.kernels.attention" in sys.modules and not _interpreted(sys.modules["kvserve.kernels.attention"]):
            print(
                "kvserve.kernels.attention was imported before TRITON_INTERPRET=1; run the dry run in a fresh "
                "process (python -m kvserve.cluster.bench.kernels --dry-run)",
                file=sys.stderr,
            )
            return 2
    if not args.dry_run and not has_cuda:
        print(
            "bench kernels: no CUDA device; use --dry-run for the CPU interpreter smoke test", file=sys.stderr
        )
        return 2
    device = "cuda" if has_cuda else "cpu"
    timing = not args.dry_run
    if args.dry_run:
        _apply_dry_run_sizes(args, device)
    torch.manual_seed(args.seed)

    timer = Timer(args) if timing else None
    started = time.perf_counter()
    device_name = torch.cuda.get_device_name() if has_cuda else "cpu (triton interpreter)"
    ref_bw = _reference_bandwidth(device, timer) if timer is not None else None
    nominal = nominal_bandwidth_gbs(device_name) if has_cuda else None
    if ref_bw is not None:
        print(f"{device_name}: HBM copy {ref_bw['copy']:.0f} GB/s, read {ref_bw['read']:.0f} GB/s (measured, "
              f"{REFERENCE_BUFFER_BYTES >> 30} GiB), nominal " + (f"{nominal:.0f} GB/s" if nominal else "unknown"),
              flush=True)  # fmt: skip
    best = max(ref_bw.values()) if ref_bw else None
    if has_cuda:
        torch.cuda.empty_cache()
    decode = _bench_decode(args, device, timer, (best, nominal))
    prefill = _bench_prefill(args, device, timer)
    errors = [
        (name.partition("/")[0], err) for row in [*decode, *prefill] for name, err in row.checks.items()
    ]
    store_errors = [(r.kv_cache_dtype, r.store_rel_err) for r in decode if r.store_rel_err is not None]
    checks_passed = (
        bool(errors)
        and all(err <= TOLERANCE[dtype] for dtype, err in errors)
        and all(err <= STORE_TOLERANCE[kv] for kv, err in store_errors)
    )
    result = {
        "mode": "dry-run" if args.dry_run else "full",
        "device": device_name,
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "time_dtype": args.time_dtype[0],
        "kv_cache_dtypes": args.kv_cache_dtypes,
        "model": {"num_heads": args.num_heads, "num_kv_heads": args.num_kv_heads, "head_dim": args.head_dim},
        "reference_bandwidth_gbs": ref_bw,  # {"copy": read + write, "read": read only}; None in a dry run
        "nominal_bandwidth_gbs": nominal,
        "tolerance": TOLERANCE,
        "store_tolerance": STORE_TOLERANCE,
        "decode": [dataclasses.asdict(r) for r in decode],
        "prefill": [dataclasses.asdict(r) for r in prefill],
        "checks_passed": checks_passed,
        "wall_s": time.perf_counter() - started,
    }
    _print_tables(result)
    if args.json_out:
        os.makedirs(os.path.dirname(os.path.abspath(args.json_out)), exist_ok=True)
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=2)
    return 0 if checks_passed else 1


def main(argv: list[str] | None = None) -> int:
    parser = add_arguments(
        argparse.ArgumentParser(prog="kvserve bench kernels", description=__doc__.split("\n")[0])
    )
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
