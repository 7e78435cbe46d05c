"""The projections' CPU GEMM: each packing computes ``x @ w.T`` (to fp32 rounding) and round-trips its
weight bit-exactly, and the packing is the one that timed fastest here (or the one forced)."""

from __future__ import annotations

import pytest
import torch

from kvserve.kernels import cpu_ext
from kvserve.workers.host.path_choice import forget_choices
from kvserve.workers.models import cpu_gemm

AVAILABLE = ["onednn"] + (["kvserve"] if cpu_ext.available() else [])


@pytest.fixture(autouse=True)
def _measure_afresh() -> None:
    """Each test rigs its own timings: a choice remembered from another test must not answer for it."""
    forget_choices()
    yield
    forget_choices()


@pytest.mark.parametrize("packing", AVAILABLE)
@pytest.mark.parametrize("rows", [1, 7, 16, 129, 300])
def test_each_packing_computes_the_projection(packing: str, rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    w, x, b = torch.randn(40, 24, generator=g), torch.randn(rows, 24, generator=g), torch.randn(40, generator=g)
    packed = cpu_gemm.pack(w, packing)
    assert torch.equal(cpu_gemm.unpack(packed, packing, 40), w)
    for dense_from in (None, 128):
        out = cpu_gemm.linear(x, packed, packing, 40, b, dense_from)
        torch.testing.assert_close(out, torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-5)


def _rig(monkeypatch: pytest.MonkeyPatch, per_call: dict[str, float], dense_wins: bool) -> None:
    """``fastest`` that reports ``per_call`` seconds for every timed row count, and MKL vs oneDNN at 1024 rows."""

    def rigged(candidates, repeats=3):
        if set(candidates) == {"onednn", "dense"}:
            return ("dense" if dense_wins else "onednn"), {}
        return min(per_call, key=per_call.get), dict(per_call)

    monkeypatch.setattr(cpu_gemm, "fastest", rigged)


@pytest.mark.skipif(not cpu_ext.available(), reason="one candidate only without the C++ kernels")
@pytest.mark.parametrize("winner", ["kvserve", "onednn"])
def test_the_faster_packing_is_chosen(monkeypatch: pytest.MonkeyPatch, winner: str) -> None:
    monkeypatch.delenv(cpu_gemm.ENV_OVERRIDE, raising=False)
    loser = next(p for p in cpu_gemm.PACKINGS if p != winner)
    _rig(monkeypatch, {winner: 1.0, loser: 2.0}, dense_wins=False)
    choice = cpu_gemm.choose([torch.randn(32, 16), torch.randn(16, 32)])
    assert choice.packing == winner and choice.dense_from_rows is None
    assert choice.seconds_per_token[winner] < choice.seconds_per_token[loser]


def test_mkl_takes_large_chunks_only_where_it_won(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_gemm.ENV_OVERRIDE, "onednn")
    _rig(monkeypatch, {"kvserve": 1.0, "onednn": 1.0}, dense_wins=True)
    assert cpu_gemm.choose([torch.randn(32, 16)]).dense_from_rows == cpu_gemm.DENSE_CHECK_ROWS
    forget_choices()  # NOTE: a new rig is a new machine: measure again
    _rig(monkeypatch, {"kvserve": 1.0, "onednn": 1.0}, dense_wins=False)
    assert cpu_gemm.choose([torch.randn(32, 16)]).dense_from_rows is None


@pytest.mark.parametrize("forced", AVAILABLE)
def test_the_environment_forces_a_packing_without_timing(monkeypatch: pytest.MonkeyPatch, forced: str) -> None:
    monkeypatch.setenv(cpu_gemm.ENV_OVERRIDE, forced)
    _rig(monkeypatch, {p: (0.0 if p != forced else 9.0) for p in cpu_gemm.PACKINGS}, dense_wins=False)
    choice = cpu_gemm.choose([torch.randn(32, 16)])
    assert choice.packing == forced and choice.reason == cpu_gemm.ENV_OVERRIDE


def test_a_bad_override_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_gemm.ENV_OVERRIDE, "mkl")
    with pytest.raises(ValueError, match="KVSERVE_CPU_GEMM='mkl'"):
        cpu_gemm.choose([torch.randn(32, 16)])


def test_kvserve_forced_without_the_kernels_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_gemm.ENV_OVERRIDE, "kvserve")
    monkeypatch.setattr(cpu_gemm.cpu_backend, "packed_gemm_available", lambda w: False)
    with pytest.raises(ValueError, match="C\\+\\+ kernels are not available"):
        cpu_gemm.choose([torch.randn(32, 16)])


def test_timing_uses_capped_shapes(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[int, int]] = []
    real_pack = cpu_gemm.pack
    monkeypatch.setattr(cpu_gemm, "pack", lambda w, p: seen.append(tuple(w.shape)) or real_pack(w, p))
    monkeypatch.setenv(cpu_gemm.ENV_OVERRIDE, "onednn")
    cpu_gemm.choose([torch.randn(3000, 4096)], repeats=1)
    assert seen and all(s == cpu_gemm.TIMED_MAX_SHAPE for s in seen)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="oneDNN not built in")
def test_bf16_weights_are_timed_with_bf16_inputs(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvserve.workers.models.model import onednn_linear_supported

    if not onednn_linear_supported(torch.device("cpu"), torch.bfloat16):
        pytest.skip("oneDNN bf16 GEMM not available on this CPU")
    monkeypatch.delenv(cpu_gemm.ENV_OVERRIDE, raising=False)
    choice = cpu_gemm.choose([torch.randn(32, 16).bfloat16()], repeats=1)
    assert choice.packing == "onednn"  # the C++ GEMM is fp32 only


# ---- cpu_weights=bf16: the opt-in bf16 weight stream ---------------------------------------------------
@pytest.mark.skipif(not cpu_ext.available(), reason="the bf16 weight stream is the C++ GEMM's")
@pytest.mark.parametrize("rows", [1, 5, 8, 13, 129])
def test_bf16_weights_compute_the_fp32_gemm_of_the_rounded_weight_bit_for_bit(rows: int) -> None:
    """A bf16 weight widens to fp32 exactly and the FMA chain over k is the fp32 kernel's, so the mode's
    only numeric change is the rounding of the weights: the oracle the engine test below relies on."""
    from kvserve.kernels import cpu_backend

    g = torch.Generator().manual_seed(rows)
    w, x = torch.randn(200, 96, generator=g), torch.randn(rows, 96, generator=g)
    rounded = w.bfloat16().float()
    packed = cpu_gemm.pack(w, cpu_gemm.BF16_PACKING)
    assert packed.dtype == torch.bfloat16 and packed.nbytes * 2 == cpu_gemm.pack(w, "kvserve").nbytes
    assert torch.equal(cpu_gemm.unpack(packed, cpu_gemm.BF16_PACKING, 200), rounded)
    exact = cpu_gemm.linear(x, cpu_gemm.pack(rounded, "kvserve"), "kvserve", 200)
    assert torch.equal(cpu_gemm.linear(x, packed, cpu_gemm.BF16_PACKING, 200), exact)
    assert not torch.equal(exact, cpu_gemm.linear(x, cpu_gemm.pack(w, "kvserve"), "kvserve", 200))
    assert torch.equal(cpu_backend.lm_head_argmax(x, packed, 200), exact.argmax(-1))


@pytest.mark.skipif(not cpu_ext.available(), reason="the bf16 weight stream is the C++ GEMM's")
def test_bf16_weights_are_taken_untimed_when_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(cpu_gemm.ENV_OVERRIDE, raising=False)
    _rig(monkeypatch, {"kvserve": 1.0, "onednn": 0.5}, dense_wins=True)
    choice = cpu_gemm.choose([torch.randn(32, 16)], cpu_weights="bf16")
    assert choice.packing == cpu_gemm.BF16_PACKING and choice.dense_from_rows is None
    assert cpu_gemm.choose([torch.randn(32, 16)]).packing == "onednn"  # fp32 stays timed


def test_bf16_weights_without_the_kernels_are_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(cpu_gemm.ENV_OVERRIDE, raising=False)
    monkeypatch.setattr(cpu_gemm.cpu_backend, "packed_gemm_available", lambda w: False)
    with pytest.raises(ValueError, match="cpu_weights=bf16 needs kvserve's C"):
        cpu_gemm.choose([torch.randn(32, 16)], cpu_weights="bf16")
