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
