"""The liveness rule's shared parts (worker and router): the stall threshold and the errors a
worker's health check raises (README "Failure behaviour", docs/architecture.md section 5).

A worker that does not step for ``stall_threshold_s`` while it has work is stalled. The threshold
is the configured ``stall_timeout_s`` (``--worker-stall-timeout-s``), raised to
``STALL_STEP_FACTOR`` times the slowest step seen from that worker, so a deployment whose steps
are slow (a big model on CPU, a long prefill chunk) is never declared stalled by a step that is
merely slow, while a hang on a fast deployment is caught in about ``stall_timeout_s``.

A step that is *computing* is slow, not hung, however long it takes under a noisy neighbour: while a
step runs, the worker's heartbeat thread checks every ``HEARTBEAT_S`` (or a quarter of the stall
threshold if shorter) that the process used at least
``MIN_COMPUTING_CPU_SHARE`` of a core since its last check, and if so counts it as progress (worker
side) and says so to the router (a ``StepHeartbeat``). NOTE: measured on a 2-core box at load ~10, a
first 2,048-token prefill step of SmolLM2 took over 5 s and both workers were killed as hung, again
and again, while they computed. A SIGSTOPped process sends nothing; a deadlocked or sleeping engine
thread uses no CPU; a GIL-holding loop starves the heartbeat thread: all three still stall. A step
that computes past ``step_ceiling_s`` (a spinning kernel) is hung too: the heartbeats stop (vLLM's
engine iteration timeout, ``VLLM_ENGINE_ITERATION_TIMEOUT_S``, is 60 s by default likewise).
"""

from __future__ import annotations

STALL_STEP_FACTOR = 4.0
HEARTBEAT_S = 1.0  # how often a running step's CPU progress is checked (at most a quarter stall threshold)
MIN_COMPUTING_CPU_SHARE = 0.05  # of one core, over a heartbeat interval: below it a step is not computing
STEP_CEILING_S = 60.0  # a step computing longer than this (or 12 stall thresholds) is hung anyway


def stall_threshold_s(stall_timeout_s: float, slowest_step_s: float) -> float:
    """Seconds without a step (with work pending) after which a worker is stalled."""
    return max(stall_timeout_s, STALL_STEP_FACTOR * slowest_step_s)


def step_ceiling_s(stall_timeout_s: float, slowest_step_s: float) -> float:
    """Seconds one step may keep computing (heartbeats) before it counts as hung all the same."""
    return max(STEP_CEILING_S, 12 * stall_threshold_s(stall_timeout_s, slowest_step_s))


def computing(cpu_s: float, wall_s: float) -> bool:
    """Whether a process that used ``cpu_s`` CPU seconds over ``wall_s`` seconds was computing."""
    return wall_s > 0 and cpu_s >= MIN_COMPUTING_CPU_SHARE * wall_s


class WorkerError(RuntimeError):
    """The worker cannot serve (its health check or a call says so)."""


class EngineDeadError(WorkerError):
    """The worker's engine thread died: the process lives but will never step again."""


class EngineStalledError(WorkerError):
    """The worker's engine made no step for its stall threshold while work was pending."""
