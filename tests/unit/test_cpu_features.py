"""``workers.host.cpu_features``: hardware flags combined with the environment's ISA caps."""

from __future__ import annotations

import pytest

from kvserve.workers.host.cpu_features import CpuFeatures, current, detect, parse_cpuinfo

SPR = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Processor
flags\t\t: fpu sse4_1 avx avx2 fma avx512f avx512dq avx512bw avx512vl avx512_bf16 amx_bf16 amx_tile amx_int8

processor\t: 1
model name\t: second
flags\t\t: fpu
"""
ZEN5 = "model name\t: AMD EPYC\nflags\t: avx avx2 fma avx512f avx512dq avx512bw avx512vl avx512_bf16\n"
ZEN3 = "model name\t: AMD EPYC 7B13\nflags\t: avx avx2 fma\n"


def test_parse_takes_the_first_processor() -> None:
    name, flags = parse_cpuinfo(SPR)
    assert name == "Intel(R) Xeon(R) Processor" and "amx_bf16" in flags and "fpu" in flags
    assert parse_cpuinfo("") == ("", frozenset())


@pytest.mark.parametrize(
    ("cpuinfo", "env", "avx512", "bf16"),
    [
        (SPR, {}, True, True),
        (ZEN5, {}, True, True),
        (ZEN3, {}, False, False),
        (ZEN5, {"ONEDNN_MAX_CPU_ISA": "avx2"}, False, False),  # capped below AVX-512: tune as AVX2
        (ZEN5, {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}, True, False),  # AVX-512 without its bf16 GEMMs
        (ZEN5, {"DNNL_MAX_CPU_ISA": "AVX512_CORE_BF16"}, True, True),
        (SPR, {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI"}, True, False),
        (SPR, {"ONEDNN_MAX_CPU_ISA": "ALL"}, True, True),
    ],
)
def test_levers_follow_hardware_and_caps(cpuinfo: str, env: dict[str, str], avx512: bool, bf16: bool) -> None:
    f = detect(cpuinfo, env)
    assert f.avx2 and (f.avx512, f.native_bf16_gemm) == (avx512, bf16)


def test_aten_cap_and_description() -> None:
    assert detect(SPR, {}).aten_avx512
    capped = detect(SPR, {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"})
    assert not capped.aten_avx512 and not detect(SPR, {"ATEN_CPU_CAPABILITY": "default"}).aten_avx512
    assert capped.describe() == (
        "Intel(R) Xeon(R) Processor; avx2 avx512f avx512_bf16 amx_bf16; capped: ONEDNN_MAX_CPU_ISA=AVX2, "
        "ATEN_CPU_CAPABILITY=AVX2"
    )
    assert detect(ZEN3, {}).describe() == "AMD EPYC 7B13; avx2"


def test_an_unknown_onednn_isa_is_refused() -> None:
    with pytest.raises(ValueError, match="ONEDNN_MAX_CPU_ISA='AVX3'"):
        detect(ZEN5, {"ONEDNN_MAX_CPU_ISA": "avx3"})
    with pytest.raises(ValueError):
        CpuFeatures("x", frozenset(), onednn_isa_cap="avx2")  # names are upper case


def test_this_machine_agrees_with_torch() -> None:
    import torch

    f = current()
    assert f is current()  # read once
    if f.onednn_isa_cap is None:
        assert ("avx512_bf16" in f.flags) == torch.cpu._is_avx512_bf16_supported()
        assert f.avx2 == torch.cpu._is_avx2_supported()


@pytest.mark.parametrize("cap", [None, "AVX2"])
def test_native_bf16_gemm_predicts_whether_onednn_packs_bf16(cap: str | None) -> None:
    """What the bf16 screen needs: oneDNN packs a bf16 weight exactly where ``native_bf16_gemm`` says so.

    NOTE: run in a child process, since oneDNN reads ONEDNN_MAX_CPU_ISA once. On an AVX512-BF16 machine
    with the cap, the hardware probe (``torch.cpu._is_avx512_bf16_supported``) says yes and oneDNN
    refuses: the case the screen's own check gets wrong.
    """
    import os
    import subprocess
    import sys

    code = (
        "import torch\nfrom kvserve.workers.host.cpu_features import current\n"
        "try:\n    torch.ops.mkldnn._reorder_linear_weight(torch.ones(32, 32, dtype=torch.bfloat16), 8); ok = True\n"
        "except RuntimeError:\n    ok = False\n"
        "print(ok, current().native_bf16_gemm)\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")}
    if cap:
        env["ONEDNN_MAX_CPU_ISA"] = cap
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    packs, predicted = out.split()
    # NOTE: a CPU with AVX-512 (BW/VL/DQ) but no bf16 instructions lets oneDNN pack bf16 (emulated):
    # native_bf16_gemm is False there by design (the screen would be slower), so only check one way.
    if predicted == "True":
        assert packs == "True"
    if cap == "AVX2":
        assert predicted == "False"
        if "avx_ne_convert" not in current().flags:  # AVX2-class bf16 conversions: oneDNN may pack there
            assert packs == "False"
