"""The liveness rule's shared parts (worker and router): the stall threshold and the errors a
worker's health check raises (README "Failure behaviour", docs/architecture.md section 5).

A worker that does not step for ``stall_threshold_s`` while it has work is stalled. The threshold
is the configured ``stall_timeout_s`` (``--worker-stall-timeout-s``), raised to
``STALL_STEP_FACTOR`` times the slowest step seen from that worker, so a deployment whose steps
are slow (a big model on CPU, a long prefill chunk) is never declared stalled by a step that is
merely slow, while a hang on a fast deployment is caught in about ``stall_timeout_s``.
"""

from __future__ import annotations

STALL_STEP_FACTOR = 4.0


def stall_threshold_s(stall_timeout_s: float, slowest_step_s: float) -> float:
    """Seconds without a step (with work pending) after which a worker is stalled."""
    return max(stall_timeout_s, STALL_STEP_FACTOR * slowest_step_s)


class WorkerError(RuntimeError):
    """The worker cannot serve (its health check or a call says so)."""


class EngineDeadError(WorkerError):
    """The worker's engine thread died: the process lives but will never step again."""


class EngineStalledError(WorkerError):
    """The worker's engine made no step for its stall threshold while work was pending."""
