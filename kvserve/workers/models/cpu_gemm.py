"""Which CPU GEMM the model's projections run, chosen by timing them on this machine.

Three exact fp32 GEMMs can run a projection ``x @ w.T`` on CPU, and which is fastest depends on the
processor, not on its flags (issue 21):

- ``kvserve``: the C++ packed GEMM (``kvserve/kernels/csrc/cpu_ops.cpp``, AVX2) for decode-sized batches, MKL on
  the weight unpacked per call above ``PACKED_MAX_ROWS``. On an AVX2-only Zen 3, 2 threads, M = 32-64 on
  SmolLM2/small shapes it ran at 127-195 GFLOP/s against oneDNN's 112-155.
- ``onednn``: oneDNN's JIT GEMM on a weight packed once in its blocked layout. NOTE: torch's default fp32
  GEMM (MKL) takes its AVX2 path on AMD processors; on a Zen 5 with AVX-512, one thread, oneDNN packed
  ran SmolLM2's shapes at 245-259 GFLOP/s where MKL ran 96-113 and the C++ GEMM 130
  (``python -m kvserve.cluster.bench.cpu_peak``).
- MKL on the plain weight: for large prefill chunks under ``onednn``, only where it measured faster
  (``dense_from_rows``; on a Zen 3 from ~1k rows: 163-184 GFLOP/s against oneDNN's 137-160).

A weight is packed one way only (a second copy would double the model's memory), so one packing is
chosen for all projections: each candidate runs the model's own projection shapes (one layer's
weights) at a decode batch and a prefill chunk, and the one with the least time per token summed over
both wins (a served workload spends most of its FLOPs in prefill, a long chat in decode: neither is
weighted away). ``KVSERVE_CPU_GEMM=kvserve|onednn`` skips the timing (benchmarks, tests of each path).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from kvserve.kernels import cpu_backend
from kvserve.workers.host.path_choice import fastest, once_per_process

logger = logging.getLogger(__name__)

PACKINGS = ("kvserve", "onednn")
# Not a timed candidate: a different numeric mode, taken only when asked for (``cpu_weights=bf16``).
BF16_PACKING = "kvserve-bf16"
ENV_OVERRIDE = "KVSERVE_CPU_GEMM"
DECODE_ROWS = 16  # a server's per-worker decode batch
PREFILL_ROWS = 256  # a prefill chunk of one short prompt
DENSE_CHECK_ROWS = 1024  # where MKL on the plain weight may overtake oneDNN (it did on a Zen 3)
# Timed weights are cut to at most this [out, in] (a GEMM's speed no longer changes much with its size
# there), so that the choice costs well under a second at start-up for any model size.
TIMED_MAX_SHAPE = (1024, 2048)


@dataclass(frozen=True)
class GemmChoice:
    """The projections' packing, from which row count oneDNN hands over to MKL (None: never), and the
    measured seconds per token behind the choice (empty where nothing was timed)."""

    packing: str
    dense_from_rows: int | None
    seconds_per_token: dict[str, float] = field(default_factory=dict)
    reason: str = "measured"


def override() -> str | None:
    """``KVSERVE_CPU_GEMM`` (``auto``/unset -> None).

    Raises:
        ValueError: a value that is not a packing or ``auto``.
    """
    value = os.environ.get(ENV_OVERRIDE, "auto").strip().lower()
    if value in ("", "auto"):
        return None
    if value not in PACKINGS:
        raise ValueError(f"{ENV_OVERRIDE}={value!r}: expected one of {('auto', *PACKINGS)}")
    return value


def choose(weights: Sequence[torch.Tensor], repeats: int = 3, cpu_weights: str = "fp32") -> GemmChoice:
    """The packing for projections with these plain ``[out, in]`` fp32 weights (one layer's).

    Only packings this process can run are candidates (``kvserve`` needs the C++ kernels). The caller
    has checked that oneDNN applies (``onednn_linear_supported``). ``cpu_weights="bf16"`` takes the C++
    GEMM on bf16-packed weights, untimed: it is a numeric mode the user chose, not a faster equal.

    Raises:
        ValueError: ``cpu_weights="bf16"`` where the C++ kernels cannot run.
    """
    forced = override()
    weights = [w.detach()[: TIMED_MAX_SHAPE[0], : TIMED_MAX_SHAPE[1]].contiguous() for w in weights]
    kvserve_ok = all(cpu_backend.packed_gemm_available(w) for w in weights)
    if cpu_weights == "bf16":
        if not kvserve_ok:
            raise ValueError("cpu_weights=bf16 needs kvserve's C++ CPU kernels (AVX2 + FMA, `make setup`), "
                             "which this process cannot run")  # fmt: skip
        return GemmChoice(BF16_PACKING, None, reason="cpu_weights=bf16")
    if forced == "kvserve" and not kvserve_ok:
        raise ValueError(f"{ENV_OVERRIDE}=kvserve: the C++ kernels are not available in this process")
    if forced == "kvserve":
        return GemmChoice("kvserve", None, reason=f"{ENV_OVERRIDE}")
    if forced == "onednn" or not kvserve_ok:
        reason = f"{ENV_OVERRIDE}" if forced else "only candidate"
        shapes = tuple((tuple(w.shape), str(w.dtype)) for w in weights)
        dense_from = once_per_process(("cpu_gemm_dense", shapes, repeats, torch.get_num_threads()),
                                      lambda: _dense_from_rows(weights, repeats))  # fmt: skip
        return GemmChoice("onednn", dense_from, reason=reason)
    shapes = tuple((tuple(w.shape), str(w.dtype)) for w in weights)
    return once_per_process(("cpu_gemm", shapes, repeats, torch.get_num_threads()), lambda: _timed(weights, repeats))


def _timed(weights: Sequence[torch.Tensor], repeats: int) -> GemmChoice:
    per_token = {name: 0.0 for name in PACKINGS}
    generator = torch.Generator().manual_seed(0)
    for rows in (DECODE_ROWS, PREFILL_ROWS):
        inputs = [torch.randn(rows, w.shape[1], generator=generator).to(w.dtype) for w in weights]
        # NOTE: both row counts are below DENSE_CHECK_ROWS: oneDNN runs them whatever the MKL hand-over
        runs = {name: _runner(name, weights, inputs, None) for name in PACKINGS}
        _, best = fastest(runs, repeats)
        for name, seconds in best.items():
            per_token[name] += seconds / rows
    winner = min(PACKINGS, key=lambda name: per_token[name])
    # The MKL hand-over is timed only where it can apply: a kvserve winner never needs it.
    dense_from = _dense_from_rows(weights, repeats) if winner == "onednn" else None
    return GemmChoice(winner, dense_from, per_token)


PACKED_MAX_ROWS = 128  # ``kvserve`` packing: the C++ GEMM up to this many rows, MKL (unpacked) above


def pack(weight: torch.Tensor, packing: str) -> torch.Tensor:
    """``weight`` ``[out, in]`` in ``packing``'s layout (it replaces the plain weight: no extra memory)."""
    if packing == "kvserve":
        return cpu_backend.pack_weight(weight)
    if packing == BF16_PACKING:
        return cpu_backend.pack_weight(weight, torch.bfloat16)
    if packing == "onednn":
        return torch.ops.mkldnn._reorder_linear_weight(weight, DECODE_ROWS)
    raise ValueError(f"unknown packing {packing!r}; known: {(*PACKINGS, BF16_PACKING)}")


def unpack(packed: torch.Tensor, packing: str, out_features: int) -> torch.Tensor:
    """The plain ``[out, in]`` weight back, bit-exact (``kvserve-bf16``: the bf16-rounded values, fp32)."""
    if packing in ("kvserve", BF16_PACKING):
        return cpu_backend.unpack_weight(packed, out_features).contiguous()
    return packed.to_dense()


def linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    packing: str,
    out_features: int,
    bias: torch.Tensor | None = None,
    dense_from_rows: int | None = None,
) -> torch.Tensor:
    """``x @ w.T + bias`` with ``w`` packed by ``pack(w, packing)``."""
    rows = x.shape[0]
    if packing in ("kvserve", BF16_PACKING):
        if rows <= PACKED_MAX_ROWS:
            out = cpu_backend.packed_linear(x, packed, out_features)
            return out if bias is None else out.add_(bias)
        return nn.functional.linear(x, cpu_backend.unpack_weight(packed, out_features), bias)
    if dense_from_rows is not None and rows >= dense_from_rows:
        return nn.functional.linear(x, packed.to_dense(), bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _runner(
    packing: str, weights: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], dense_from: int | None
) -> Callable[[], None]:
    """One call of every projection, as ``Linear.forward`` runs it under ``packing``."""
    packed = [pack(w.detach(), packing) for w in weights]

    def run() -> None:
        with torch.inference_mode():
            for p, w, x in zip(packed, weights, inputs, strict=True):
                linear(x, p, packing, w.shape[0], None, dense_from)

    return run


def _dense_from_rows(weights: Sequence[torch.Tensor], repeats: int) -> int | None:
    """``DENSE_CHECK_ROWS`` if MKL on the plain weights beat oneDNN packed there, else None (oneDNN always)."""
    generator = torch.Generator().manual_seed(1)
    inputs = [torch.randn(DENSE_CHECK_ROWS, w.shape[1], generator=generator).to(w.dtype) for w in weights]
    winner, _ = fastest({
        "onednn": _runner("onednn", weights, inputs, None),
        "dense": _runner("onednn", weights, inputs, DENSE_CHECK_ROWS),
    }, repeats)  # fmt: skip
    return DENSE_CHECK_ROWS if winner == "dense" else None
