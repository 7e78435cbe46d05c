"""``python -m kvserve.cluster.bench.cpu_peak``: the CPU's fp32 GEMM peak as the engine's projections see it.

``bench offline`` reports model GFLOP/s; this measures what to compare them with, with the library the
projections use: torch's default ``mm`` (MKL on x86), and oneDNN with a pre-packed weight
(``torch.ops.mkldnn``), fp32 and bf16, and kvserve's own packed AVX2 GEMM (``kvserve/kernels/csrc``, what
``workers.models.model.Linear`` runs for decode-sized batches where it is built), on a square 2048 GEMM and on
the standard models' shapes (decode rows and a prefill chunk; SmolLM2-135M's decode rows). Best of
``--repeats`` timings per case. The ISA caps (``ONEDNN_MAX_CPU_ISA``, ``ATEN_CPU_CAPABILITY``) apply
as for the engine; the JSON records them (``workers.host.cpu_features``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from kvserve.kernels import cpu_backend
from kvserve.workers.host.cpu_features import current
from kvserve.workers.models.random_model import SIZES, VOCAB_SIZE

SQUARE = 2048


@dataclass(frozen=True)
class GemmCase:
    """``[m, k] @ [k, n]``: ``m`` rows (tokens), ``k`` inputs, ``n`` outputs (weight ``[n, k]``)."""

    name: str
    m: int
    k: int
    n: int

    @property
    def flops(self) -> int:
        return 2 * self.m * self.k * self.n


def model_cases(size: str, rows: int, label: str) -> list[GemmCase]:
    """The per-layer projections (fused QKV, O, fused gate|up, down) and the LM head of a standard model."""
    s = SIZES[size]
    h, inter = s.hidden_size, s.intermediate_size
    qkv = h + 2 * s.num_key_value_heads * (h // s.num_attention_heads)
    return [
        GemmCase(f"{size} {label} qkv", rows, h, qkv),
        GemmCase(f"{size} {label} o", rows, h, h),
        GemmCase(f"{size} {label} gate_up", rows, h, 2 * inter),
        GemmCase(f"{size} {label} down", rows, inter, h),
        GemmCase(f"{size} {label} lm_head", rows, h, VOCAB_SIZE),
    ]


def smollm2_decode_cases(rows: int = 64) -> list[GemmCase]:
    """SmolLM2-135M (hidden 576, 9 heads / 3 KV heads of 64, intermediate 1536, vocab 49152)."""
    return [
        GemmCase("smollm2 decode qkv", rows, 576, 960),
        GemmCase("smollm2 decode o", rows, 576, 576),
        GemmCase("smollm2 decode gate_up", rows, 576, 3072),
        GemmCase("smollm2 decode down", rows, 1536, 576),
        GemmCase("smollm2 decode lm_head", rows, 576, 49152),
    ]


def default_cases() -> list[GemmCase]:
    return [
        GemmCase("square", SQUARE, SQUARE, SQUARE),
        *model_cases("tiny", 64, "decode"),
        *model_cases("small", 32, "decode"),
        *model_cases("small", 512, "prefill"),
        *smollm2_decode_cases(),
    ]


def best_seconds(fn: Callable[[], object], repeats: int, min_seconds: float = 0.05) -> float:
    """Best per-call time over ``repeats`` batches, each batch long enough to time (>= ``min_seconds``)."""
    fn()
    t0 = time.perf_counter()
    fn()
    once = max(time.perf_counter() - t0, 1e-7)
    calls = max(1, int(min_seconds / once))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best


def _onednn_linear(x: torch.Tensor, w: torch.Tensor, batch_hint: int) -> Callable[[], torch.Tensor]:
    """``x @ w.T`` through oneDNN with ``w`` packed once, as ``workers.models.model.Linear`` runs it."""
    packed = torch.ops.mkldnn._reorder_linear_weight(w, batch_hint)
    return lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def measure(case: GemmCase, repeats: int) -> dict[str, float | None]:
    """GFLOP/s of ``case`` for each library path (None where oneDNN is not built in)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(case.m, case.k, generator=gen)
    w = torch.randn(case.n, case.k, generator=gen)
    out: dict[str, float | None] = {"mm_fp32": case.flops / best_seconds(lambda: torch.mm(x, w.t()), repeats) / 1e9}
    onednn = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    for dtype, key in ((torch.float32, "onednn_fp32"), (torch.bfloat16, "onednn_bf16")):
        if not onednn:
            out[key] = None
            continue
        try:
            run = _onednn_linear(x.to(dtype), w.to(dtype), case.m)
        except RuntimeError:  # NOTE: oneDNN refuses bf16 where ONEDNN_MAX_CPU_ISA caps below AVX512-BF16
            out[key] = None
            continue
        out[key] = case.flops / best_seconds(run, repeats) / 1e9
    out["kvserve_fp32"] = None
    if cpu_backend.packed_gemm_available(w):
        packed = cpu_backend.pack_weight(w)
        run = lambda: cpu_backend.packed_linear(x, packed, case.n)  # noqa: E731
        out["kvserve_fp32"] = case.flops / best_seconds(run, repeats) / 1e9
    return out


def run(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    cases = [GemmCase("square", args.square, args.square, args.square)] if args.square_only else default_cases()
    if args.square != SQUARE and not args.square_only:
        cases[0] = GemmCase("square", args.square, args.square, args.square)
    rows = [{**asdict(c), **measure(c, args.repeats)} for c in cases]
    result = {"cpu": current().describe(), "threads": torch.get_num_threads(), "torch": torch.__version__, "rows": rows}
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{result['cpu']}; {result['threads']} threads; torch {result['torch']}; GFLOP/s (best of {args.repeats})")
    print("| case | m x k x n | torch mm fp32 | oneDNN packed fp32 | oneDNN packed bf16 | kvserve packed fp32 |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        keys = ("mm_fp32", "onednn_fp32", "onednn_bf16", "kvserve_fp32")
        cells = [f"{r[k]:.0f}" if r[k] is not None else "-" for k in keys]
        print(f"| {r['name']} | {r['m']} x {r['k']} x {r['n']} | " + " | ".join(cells) + " |")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvserve.cluster.bench.cpu_peak", description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--repeats", type=int, default=5, help="timed batches per case (best reported)")
    p.add_argument("--square", type=int, default=SQUARE, help="size of the square case")
    p.add_argument("--square-only", action="store_true", help="only the square case")
    p.add_argument("--json", action="store_true", help="one JSON object")
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
