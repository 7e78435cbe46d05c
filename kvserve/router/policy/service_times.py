"""How long admitted requests take once they run: the other half of "will it finish in time".

Admission projects when a queued request could *start* (kvserve/router/policy/admission.py); a client's deadline
covers its whole generation, so a request projected to start just before its deadline would be
admitted only to fail DEADLINE_EXCEEDED mid-stream. ``ServiceTimes`` keeps the recent completions
(dispatch to last token) and estimates a newcomer's service time from them:

    expected = min(median seconds per output token x its max_tokens, median service time)

NOTE: the cap: clients often ask for far more tokens than they get (EOS, stop strings), so
max_tokens alone would refuse ordinary chat requests under any deadline; the typical recent
completion is the honest guess for those. Both medians are robust to the odd straggler.

At the machine's current speed: every sample also records the serving workers' *pace* current when
it completed (``step_now``: their mean seconds per token-producing engine step over their last busy
report interval, ``ColdCapacity.decode_step_s``), and each sample counts at today's pace:

    seconds x max(1, pace now / pace then)

before the medians are taken. A running request gets one token per engine step (continuous batching),
so the pace *is* the time per output token running requests get (vLLM's and SGLang's ITL / TPOT),
and a completion measured in steps (prefill, decode, the queueing inside the worker) carries over to
another pace. NOTE: why: completions describe the past and the pace moves first. A machine that slows
down (another process takes the CPU, bigger batches, preemptions) makes every request in flight
slower at once, while the completions that would show it arrive a whole service time later: a burst
judged by completions measured while steps were fast was admitted and missed its deadline (issue 41,
a shared 2-core CI runner: 12 late vs 41 ok).
NOTE: the pace, not the one step a pressure report carries: reports follow block changes, so they
over-sample prefill steps (a burst on 2 CPU cores: reported steps of 50-230 ms against samples
taken at 5-10 ms scaled every estimate 10-40x and refused queued work that would have finished;
the pace read 7-33 ms).
NOTE: only ever scaled up: a pace faster than a sample's is no evidence that the next request will
be faster, since an idle cluster's last pace is the tail of its last wave (fewer requests in the
batch) and a burst joins a full batch (measured with reported steps: a 5.5 ms last step against
samples at 9.6 ms halved the estimate and admitted 63 calls, 33 of which never started). When the
machine speeds up again the estimate falls back to what the completions measured, and fresh
completions then show the faster machine. A sample or a moment without a pace (none measured yet,
no serving worker) counts as measured. An idle cluster's pace is its last one: a machine that slows
down while idle shows it only once the next work has run a report interval.
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
    step_s: float  # the workers' pace (seconds per engine step) at its completion (0 = none known)


class ServiceTimes:
    """The last ``max_samples`` completions within ``window_s``, each with the workers' pace (seconds per
    engine step) current when it completed; ``step_now`` gives that pace (0 = unknown; None: estimates
    are the completions as measured)."""

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
        stop string), not by reaching its max_tokens. The current pace is recorded with it."""
        if seconds >= 0 and output_tokens > 0:
            self._samples.append(_Sample(self._clock(), seconds, output_tokens, max(blocks, 1), stopped, self.step_s()))

    def step_s(self) -> float:
        """The serving workers' pace now (``step_now``): seconds per engine step; 0.0 when unknown."""
        step = self._step_now() if self._step_now is not None else 0.0
        return step if step > 0 else 0.0

    def _recent(self) -> list[_Sample]:
        horizon = self._clock() - self._window_s
        while self._samples and self._samples[0].when < horizon:
            self._samples.popleft()
        return list(self._samples)

    def _at_current_speed(self, step_s: float | None) -> list[tuple[float, int]] | None:
        """(seconds, tokens) of each recent completion at the pace ``step_s`` (None: ``step_s()``), module
        doc; None with fewer than ``MIN_SAMPLES``."""
        recent = self._recent()
        if len(recent) < MIN_SAMPLES:
            return None
        now = self.step_s() if step_s is None else step_s
        return [(s.seconds * max(1.0, now / s.step_s) if now > 0 and s.step_s > 0 else s.seconds, s.tokens)
                for s in recent]  # fmt: skip

    def typical_s(self, step_s: float | None = None) -> float | None:
        """The median recent service time at the current pace (or at ``step_s``, when given); None with
        fewer than ``MIN_SAMPLES``."""
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
        takes per token under the load it ran in) at the current pace (or at ``step_s``); None with
        fewer than ``MIN_SAMPLES``."""
        scaled = self._at_current_speed(step_s)
        return None if scaled is None else statistics.median(s / n for s, n in scaled)

    def expected_s(self, max_tokens: int, step_s: float | None = None) -> float:
        """A newcomer's expected service time at the current pace (or at ``step_s``), module doc; 0.0
        when there is no estimate."""
        scaled = self._at_current_speed(step_s)
        if scaled is None:
            return 0.0
        per_token = statistics.median(s / n for s, n in scaled)
        return min(per_token * max(max_tokens, 1), statistics.median(s for s, _ in scaled))
