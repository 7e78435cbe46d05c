"""Choose between equivalent CPU paths by timing them on this machine, not by CPU flags.

A flag says an instruction exists, not that the path using it is faster here: on a 2-core Zen 4 with
AVX512-BF16, the bf16 screen of the greedy LM head (chosen because that flag exists) was slower than
the AVX2 C++ LM head (issue 21). Where two paths give the same result, time both at start-up.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable, Mapping
from typing import Any, TypeVar

T = TypeVar("T")

logger = logging.getLogger(__name__)


def fastest(candidates: Mapping[str, Callable[[], object]], repeats: int = 3) -> tuple[str, dict[str, float]]:
    """The name of the fastest candidate and each one's best time in seconds.

    Each runs once to warm up, then ``repeats`` times interleaved with the others (so a noisy
    neighbour hits them alike); a candidate's figure is its minimum. Ties go to the first listed.

    Raises:
        ValueError: no candidate, or ``repeats < 1``.
    """
    if not candidates or repeats < 1:
        raise ValueError("need at least one candidate and repeats >= 1")
    for run in candidates.values():
        run()
    best = dict.fromkeys(candidates, float("inf"))
    for _ in range(repeats):
        for name, run in candidates.items():
            t0 = time.perf_counter()
            run()
            best[name] = min(best[name], time.perf_counter() - t0)
    return min(best, key=lambda name: best[name]), best


_CHOSEN: dict[Hashable, Any] = {}


def once_per_process(key: Hashable, choose: Callable[[], T]) -> T:
    """``choose()``'s answer for ``key``, measured the first time only.

    Every later engine of this process with the same shapes (and thread count, in ``key``) takes the
    same path: two engines built in one process compute bit-identical results (a second timing on a
    busy machine could pick an equally exact GEMM that rounds differently, ~1e-7 apart in logprobs) and
    the second one starts without timing anything.
    """
    if key not in _CHOSEN:
        _CHOSEN[key] = choose()
    return _CHOSEN[key]


def forget_choices() -> None:
    """Measure every choice again from now on (tests that rig the timings start from a clean slate)."""
    _CHOSEN.clear()
