"""Which x86 vector instructions the CPU levers may count on: the hardware's, as capped by the environment.

Some CPU levers only pay where an instruction set exists: the bf16 screen of the greedy LM head
(``model.ScreenedArgmax``) is twice the fp32 GEMM's speed only with AVX512-BF16 or AMX-BF16 (elsewhere
oneDNN emulates bf16 and the screen costs more than it saves). Hardware support is not the whole story:
``ONEDNN_MAX_CPU_ISA`` caps what oneDNN's GEMMs use and ``ATEN_CPU_CAPABILITY`` what torch's own kernels
use, so a process run with ``ONEDNN_MAX_CPU_ISA=AVX2`` on an AMX machine behaves like an AVX2 machine
and must be tuned like one. ``current()`` combines the two.

Wiring (``kvserve/workers/models/model.py``): where a lever now asks ``torch.cpu._is_avx512_bf16_supported()`` (the
hardware only), ask ``cpu_features.current().native_bf16_gemm`` instead (``ScreenedArgmax.build`` and the
bf16 branch of ``onednn_linear_supported``); log ``current().describe()`` once at engine start so that a
benchmark row says what it ran on.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

# oneDNN's ONEDNN_MAX_CPU_ISA values, weakest first (its documented order; "ALL" = no cap).
ONEDNN_ISAS = (
    "SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI", "AVX512_CORE_BF16",
    "AVX10_1_512", "AVX512_CORE_FP16", "AVX10_1_512_AMX", "AVX512_CORE_AMX", "AVX10_1_512_AMX_FP16",
    "AVX512_CORE_AMX_FP16", "ALL",
)  # fmt: skip
AVX512_BASE = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq"})  # what oneDNN's AVX512_CORE needs


@dataclass(frozen=True)
class CpuFeatures:
    """The CPU's flags (``/proc/cpuinfo`` names) and the environment's caps on their use."""

    model_name: str
    flags: frozenset[str]
    onednn_isa_cap: str | None = None  # ONEDNN_MAX_CPU_ISA (upper case), None = no cap
    aten_capability_cap: str | None = None  # ATEN_CPU_CAPABILITY (upper case), None = no cap

    def __post_init__(self) -> None:
        if self.onednn_isa_cap is not None and self.onednn_isa_cap not in ONEDNN_ISAS:
            raise ValueError(f"ONEDNN_MAX_CPU_ISA={self.onednn_isa_cap!r} is not one of {ONEDNN_ISAS}")

    def onednn_allows(self, isa: str) -> bool:
        """Whether the ``ONEDNN_MAX_CPU_ISA`` cap (if any) lets oneDNN use ``isa`` (a ``ONEDNN_ISAS`` name)."""
        cap = self.onednn_isa_cap
        return cap is None or ONEDNN_ISAS.index(isa) <= ONEDNN_ISAS.index(cap)

    @property
    def avx2(self) -> bool:
        return {"avx2", "fma"} <= self.flags

    @property
    def avx512(self) -> bool:
        """AVX-512 (F, BW, VL, DQ) in hardware and usable by oneDNN."""
        return AVX512_BASE <= self.flags and self.onednn_allows("AVX512_CORE")

    @property
    def native_bf16_gemm(self) -> bool:
        """oneDNN runs bf16 GEMMs natively (AVX512-BF16 or AMX-BF16): about twice its fp32 speed.

        False where it would emulate them (no such instructions, or capped below them).
        """
        avx512_bf16 = self.avx512 and "avx512_bf16" in self.flags and self.onednn_allows("AVX512_CORE_BF16")
        amx = {"amx_bf16", "amx_tile"} <= self.flags and self.onednn_allows("AVX512_CORE_AMX")
        return avx512_bf16 or amx

    @property
    def aten_avx512(self) -> bool:
        """torch's own vectorised kernels (reductions, element-wise) may use AVX-512."""
        cap = self.aten_capability_cap
        return AVX512_BASE <= self.flags and (cap is None or cap.startswith("AVX512"))

    def describe(self) -> str:
        """One line for logs and result tables, e.g. ``Intel Xeon; avx2 avx512 avx512_bf16 amx_bf16``."""
        have = [name for name in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "avx512_fp16") if name in self.flags]
        caps = [f"{k}={v}" for k, v in (("ONEDNN_MAX_CPU_ISA", self.onednn_isa_cap),
                                          ("ATEN_CPU_CAPABILITY", self.aten_capability_cap)) if v]  # fmt: skip
        return f"{self.model_name}; {' '.join(have) or 'no AVX2'}" + (f"; capped: {', '.join(caps)}" if caps else "")


def parse_cpuinfo(text: str) -> tuple[str, frozenset[str]]:
    """``(model name, flags)`` of the first processor in ``/proc/cpuinfo`` text (empty if absent)."""
    name, flags = "", frozenset[str]()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not name:
            name = value.strip()
        elif key == "flags" and not flags:
            flags = frozenset(value.split())
        if name and flags:
            break
    return name, flags


def detect(cpuinfo: str | None = None, environ: Mapping[str, str] | None = None) -> CpuFeatures:
    """The features from ``cpuinfo`` text (default: ``/proc/cpuinfo``) and ``environ`` (default: os.environ).

    Without ``/proc/cpuinfo`` (not Linux) the flags come from torch's own probes (hardware only).

    Raises:
        ValueError: ``ONEDNN_MAX_CPU_ISA`` holds a value oneDNN does not know.
    """
    env = os.environ if environ is None else environ
    if cpuinfo is None:
        path = Path("/proc/cpuinfo")
        cpuinfo = path.read_text() if path.is_file() else ""
    name, flags = parse_cpuinfo(cpuinfo)
    if not flags:
        flags = _torch_probed_flags()
    onednn = env.get("ONEDNN_MAX_CPU_ISA") or env.get("DNNL_MAX_CPU_ISA")  # the latter: oneDNN's older name
    aten = env.get("ATEN_CPU_CAPABILITY")
    return CpuFeatures(
        model_name=name or "unknown CPU",
        flags=flags,
        onednn_isa_cap=onednn.strip().upper() if onednn else None,
        aten_capability_cap=aten.strip().upper() if aten else None,  # "DEFAULT" = torch's scalar kernels
    )


def _torch_probed_flags() -> frozenset[str]:
    import torch

    probes = {
        "avx2": "_is_avx2_supported",
        "avx512f": "_is_avx512_supported",
        "avx512_bf16": "_is_avx512_bf16_supported",
        "amx_tile": "_is_amx_tile_supported",
    }
    found = {flag for flag, fn in probes.items() if getattr(torch.cpu, fn, lambda: False)()}
    if "avx2" in found:
        found.add("fma")
    if "avx512f" in found:
        found |= AVX512_BASE
    if "amx_tile" in found and "avx512_bf16" in found:
        found.add("amx_bf16")
    return frozenset(found)


@functools.cache
def current() -> CpuFeatures:
    """This process's features (read once: the caps are environment variables read at start-up)."""
    return detect()
