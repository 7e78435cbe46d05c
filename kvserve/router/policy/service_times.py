"""How long admitted requests take once they run: the other half of "will it finish in time".

Admission projects when a queued request could *start* (kvserve/router/policy/admission.py); a client's deadline
covers its whole generation, so a request projected to start just before its deadline would be
admitted only to fail DEADLINE_EXCEEDED mid-stream. ``ServiceTimes`` keeps the recent completions
(dispatch to last token) and estimates a newcomer's service time from them:

    expected = min(median seconds per output token x its max_tokens, median service time)

NOTE: the cap: clients often ask for far more tokens than they get (EOS, stop strings), so
max_tokens alone would refuse ordinary chat requests under any deadline; the typical recent
completion is the honest guess for those. Both medians are robust to the odd straggler.

At the machine's current speed: every sample also records the serving workers' engine step time
current when it completed (``step_now``: the mean of their last pressure reports), and each
sample's seconds count at today's step, ``seconds x step_now / step_at_sample``, before the medians
are taken. A running request gets one token per engine step (continuous batching), so its time per
token *is* the step time (vLLM's and SGLang's ITL / TPOT), and a completion measured in steps
(prefill, decode and the queueing inside the worker, divided by the step time) carries over to
another speed. NOTE: why: completions describe the past; the step time moves first. A machine that
slows down (another process takes the CPU, a longer batch, preemptions) makes every request in
flight slower at once, while the completions that would show it arrive a whole service time
later: a burst judged by the fast completions was admitted and missed its deadline (issue 41, a
shared 2-core CI runner: 12 late vs 41 ok). When the machine speeds up again, the estimate falls
with the step and admission takes more at once. A sample or a moment without a step time (none
reported yet, no serving worker) counts unscaled. The step of an idle cluster is the last one it
ran: the speed it had then is the best guess until it steps again.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable
from typing import NamedTuple

# Fewer completions than this in the window: no estimate (admission then ignores service time).
MIN_SAMPLES = 4


class _Sample(NamedTuple):
    when: float  # clock time of the completion
    seconds: float  # dispatch to last token
    tokens: int  # output tokens
    blocks: int  # KV blocks held at its end
    stopped: bool  # ended by a stop condition, not its max_tokens
    step_s: float  # the engine step time current at its completion (0 = none known)


class ServiceTimes:
    """The last ``max_samples`` completions within ``window_s``, each with the step time current when it
    completed; ``step_now`` (seconds, 0 = unknown) gives that step time, none: estimates are unscaled."""

    def __init__(
        self, window_s: float = 60.0, max_samples: int = 256, clock: Callable[[], float] = time.monotonic,
        step_now: Callable[[], float] | None = None,
    ) -> None:  # fmt: skip
        self._window_s = window_s
        self._clock = clock
        self._step_now = step_now
        self._samples: deque[_Sample] = deque(maxlen=max_samples)

    def observe(self, seconds: float, output_tokens: int, blocks: int = 1, stopped: bool = False) -> None:
        """A request finished (length or stop) ``seconds`` after its dispatch, with ``output_tokens``,
        holding ``blocks`` KV blocks at its end; ``stopped``: it ended by a stop condition (EOS, a
        stop string), not by reaching its max_tokens. The current step time is recorded with it."""
        if seconds >= 0 and output_tokens > 0:
            self._samples.append(_Sample(self._clock(), seconds, output_tokens, max(blocks, 1), stopped, self.step_s()))

    def step_s(self) -> float:
        """The serving workers' engine step time now (``step_now``), seconds; 0.0 when unknown."""
        step = self._step_now() if self._step_now is not None else 0.0
        return step if step > 0 else 0.0

    def _recent(self) -> list[_Sample]:
        horizon = self._clock() - self._window_s
        while self._samples and self._samples[0].when < horizon:
            self._samples.popleft()
        return list(self._samples)

    def _at_current_speed(self, step_s: float | None) -> list[tuple[float, int]] | None:
        """(seconds, tokens) of each recent completion at the step time ``step_s`` (None: ``step_s()``),
        module doc; None with fewer than ``MIN_SAMPLES``."""
        recent = self._recent()
        if len(recent) < MIN_SAMPLES:
            return None
        now = self.step_s() if step_s is None else step_s
        return [(s.seconds * now / s.step_s if now > 0 and s.step_s > 0 else s.seconds, s.tokens) for s in recent]

    def typical_s(self, step_s: float | None = None) -> float | None:
        """The median recent service time at the current step time (or at ``step_s``, when given);
        None with fewer than ``MIN_SAMPLES``."""
        scaled = self._at_current_speed(step_s)
        return None if scaled is None else statistics.median(s for s, _ in scaled)

    def typical_blocks(self) -> int:
        """The median KV blocks a recent request held at its end (1 with no samples)."""
        recent = self._recent()
        return max(1, int(statistics.median(s.blocks for s in recent))) if recent else 1

    def typical_tokens(self) -> int | None:
        """Where requests typically stop: the median output tokens of the recent completions that
        ended by a stop condition, when most recent ones did; None otherwise (fewer than
        ``MIN_SAMPLES``, or most ran to their max_tokens: then a request is expected to use its own).

        NOTE: a completion that reached its max_tokens says nothing of where a longer one would stop
        (short probes would otherwise cap the estimate of every long generation).
        """
        recent = self._recent()
        stops = [s.tokens for s in recent if s.stopped]
        if len(recent) < MIN_SAMPLES or 2 * len(stops) <= len(recent):
            return None
        return max(1, int(statistics.median(stops)))

    def per_token_s(self, step_s: float | None = None) -> float | None:
        """The median seconds per output token of a recent completion (what a running request
        takes per token under the load it ran in) at the current step time (or at ``step_s``);
        None with fewer than ``MIN_SAMPLES``."""
        scaled = self._at_current_speed(step_s)
        return None if scaled is None else statistics.median(s / n for s, n in scaled)

    def expected_s(self, max_tokens: int, step_s: float | None = None) -> float:
        """A newcomer's expected service time at the current step time (or at ``step_s``), module doc;
        0.0 when there is no estimate."""
        scaled = self._at_current_speed(step_s)
        if scaled is None:
            return 0.0
        per_token = statistics.median(s / n for s, n in scaled)
        return min(per_token * max(max_tokens, 1), statistics.median(s for s, _ in scaled))
