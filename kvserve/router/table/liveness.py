"""The liveness rule (pure: no Ray, no gRPC): when a worker that is up is *down*.

A worker is down when (first that holds):

1. **it stalls**: it has work (requests the router placed there, dispatches in flight, or
   running/waiting/swapped ones in its last report) and the router has seen no engine step from it
   (``decode_steps`` or ``prefill_tokens_total`` of its reports unchanged, or no report at all) for
   its stall threshold (``kvserve/workers/core/liveness.py``: ``stall_timeout_s``, raised for slow
   deployments). This catches a hung process (SIGSTOP, a stuck kernel, a GIL-holding bug): alive to
   the OS and to Ray, silent to us;
2. **its engine thread died** (``check_health`` raises ``EngineDeadError``);
3. **its WorkerLink stays down** longer than ``link_grace_s`` (a shorter blip resumes: the worker's
   outbox resends, the router drops duplicates by seq, no request is replayed), or the link broke
   and Ray says the process is gone or is another incarnation (a SIGKILL: no grace needed).

What "down" does is the same for every cause (``WorkerTable.give_up``): the requests it held are
replayed elsewhere, token-identically; for causes 1-3 the actor is also killed so that Ray starts a
fresh process (whose restart counts toward retirement, README "Failure behaviour").
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.workers.core.liveness import stall_threshold_s


@dataclass(frozen=True)
class LivenessInputs:
    """What the rule looks at for one worker that is up.

    Attributes:
        now: monotonic seconds.
        busy: it has work (see the module doc).
        progress_time: when the router last saw it step (or be idle), monotonic.
        slowest_step_s: the slowest step it reported (raises the stall threshold).
        stall_timeout_s: the configured stall timeout.
        link_lost_at: when its WorkerLink broke, monotonic; None while connected.
        link_grace_s: how long a broken link may stay down before the worker is down.
    """

    now: float
    busy: bool
    progress_time: float
    slowest_step_s: float
    stall_timeout_s: float
    link_lost_at: float | None
    link_grace_s: float


def down_reason(w: LivenessInputs) -> str | None:
    """Why the worker is down now, or None while it is live."""
    if w.link_lost_at is not None and w.now - w.link_lost_at > w.link_grace_s:
        return f"its WorkerLink has been down for {w.now - w.link_lost_at:.1f}s (grace {w.link_grace_s:.1f}s)"
    threshold = stall_threshold_s(w.stall_timeout_s, w.slowest_step_s)
    if w.busy and w.now - w.progress_time > threshold:
        return f"no engine step for {w.now - w.progress_time:.1f}s with work pending (stall threshold {threshold:.1f}s)"
    return None
