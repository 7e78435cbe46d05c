"""``fastest``: the path that is faster here wins, whatever the CPU flags say."""

from __future__ import annotations

import time

import pytest

from kvserve.workers.host.path_choice import fastest


def test_the_faster_candidate_wins_and_each_is_timed() -> None:
    calls = {"slow": 0, "fast": 0}

    def slow() -> None:
        calls["slow"] += 1
        time.sleep(0.004)

    def fast() -> None:
        calls["fast"] += 1

    winner, times = fastest({"slow": slow, "fast": fast}, repeats=3)
    assert winner == "fast" and times["fast"] < times["slow"]
    assert calls == {"slow": 4, "fast": 4}  # one warm-up + 3 timed runs each


def test_no_candidates_is_an_error() -> None:
    with pytest.raises(ValueError):
        fastest({})


def test_a_choice_is_measured_once_per_process_and_reused() -> None:
    """Two engines of one process with the same shapes take the same path (and the second times nothing)."""
    from kvserve.workers.host.path_choice import once_per_process

    calls = []
    key = ("test-choice", id(calls))
    assert once_per_process(key, lambda: calls.append(1) or "kvserve") == "kvserve"
    assert once_per_process(key, lambda: calls.append(1) or "onednn") == "kvserve"
    assert calls == [1]


def test_the_projection_gemm_choice_is_not_timed_again(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from kvserve.workers.models import cpu_gemm

    monkeypatch.delenv(cpu_gemm.ENV_OVERRIDE, raising=False)
    weights = [torch.randn(48, 40), torch.randn(40, 48)]  # shapes no other test uses
    first = cpu_gemm.choose(weights, repeats=1)

    def no_timing(*args: object, **kwargs: object) -> None:
        raise AssertionError("timed again")

    monkeypatch.setattr(cpu_gemm, "fastest", no_timing)
    monkeypatch.setattr(cpu_gemm, "_dense_from_rows", no_timing)
    assert cpu_gemm.choose([w.clone() for w in weights], repeats=1) == first
