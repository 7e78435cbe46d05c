"""How long admitted requests take once they run: the other half of "will it finish in time".

Admission projects when a queued request could *start* (kvserve/router/policy/admission.py); a client's deadline
covers its whole generation, so a request projected to start just before its deadline would be
admitted only to fail DEADLINE_EXCEEDED mid-stream. ``ServiceTimes`` keeps the recent completions
(dispatch to last token) and estimates a newcomer's service time from them:

    expected = min(median seconds per output token x its max_tokens, median service time)

NOTE: the cap: clients often ask for far more tokens than they get (EOS, stop strings), so
max_tokens alone would refuse ordinary chat requests under any deadline; the typical recent
completion is the honest guess for those. Both medians are robust to the odd straggler.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable

# Fewer completions than this in the window: no estimate (admission then ignores service time).
MIN_SAMPLES = 4


class ServiceTimes:
    """The last ``max_samples`` completions within ``window_s``: (when, seconds, output tokens,
    blocks held, whether it stopped before its max_tokens)."""

    def __init__(self, window_s: float = 60.0, max_samples: int = 256, clock: Callable[[], float] = time.monotonic):
        self._window_s = window_s
        self._clock = clock
        self._samples: deque[tuple[float, float, int, int, bool]] = deque(maxlen=max_samples)

    def observe(self, seconds: float, output_tokens: int, blocks: int = 1, stopped: bool = False) -> None:
        """A request finished (length or stop) ``seconds`` after its dispatch, with ``output_tokens``,
        holding ``blocks`` KV blocks at its end; ``stopped``: it ended by a stop condition (EOS, a
        stop string), not by reaching its max_tokens."""
        if seconds >= 0 and output_tokens > 0:
            self._samples.append((self._clock(), seconds, output_tokens, max(blocks, 1), stopped))

    def _recent(self) -> list[tuple[float, float, int, int, bool]]:
        horizon = self._clock() - self._window_s
        while self._samples and self._samples[0][0] < horizon:
            self._samples.popleft()
        return list(self._samples)

    def typical_s(self) -> float | None:
        """The median recent service time; None with fewer than ``MIN_SAMPLES``."""
        recent = self._recent()
        if len(recent) < MIN_SAMPLES:
            return None
        return statistics.median(s for _, s, _, _, _ in recent)

    def typical_blocks(self) -> int:
        """The median KV blocks a recent request held at its end (1 with no samples)."""
        recent = self._recent()
        return max(1, int(statistics.median(b for _, _, _, b, _ in recent))) if recent else 1

    def typical_tokens(self) -> int | None:
        """Where requests typically stop: the median output tokens of the recent completions that
        ended by a stop condition, when most recent ones did; None otherwise (fewer than
        ``MIN_SAMPLES``, or most ran to their max_tokens: then a request is expected to use its own).

        NOTE: a completion that reached its max_tokens says nothing of where a longer one would stop
        (short probes would otherwise cap the estimate of every long generation).
        """
        recent = self._recent()
        stops = [n for _, _, n, _, stopped in recent if stopped]
        if len(recent) < MIN_SAMPLES or 2 * len(stops) <= len(recent):
            return None
        return max(1, int(statistics.median(stops)))

    def per_token_s(self) -> float | None:
        """The median seconds per output token of a recent completion (what a running request
        takes per token under the load it ran in); None with fewer than ``MIN_SAMPLES``."""
        recent = self._recent()
        if len(recent) < MIN_SAMPLES:
            return None
        return statistics.median(s / n for _, s, n, _, _ in recent)

    def expected_s(self, max_tokens: int) -> float:
        """A newcomer's expected service time (module doc); 0.0 when there is no estimate."""
        typical = self.typical_s()
        if typical is None:
            return 0.0
        per_token = statistics.median(s / n for _, s, n, _, _ in self._samples)
        return min(per_token * max(max_tokens, 1), typical)
