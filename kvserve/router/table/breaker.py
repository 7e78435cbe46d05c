"""Per-worker circuit breaker (pure: no Ray, no gRPC): a worker whose dispatches keep failing is
taken out of placement for a while instead of flapping healthy/unhealthy with every probe.

A *dispatch* is a Ray call that hands a worker a request: ``add_request``, or a migration's
``import_request``. Failures that already take the worker *down* (a dead actor, a call past the
stall threshold: kvserve/router/table/liveness.py) are not the breaker's business; it counts the others (the
call raised, the worker is alive).

States:

* *closed*: placement may use the worker. ``threshold`` consecutive failures open it.
* *open*: out of placement until ``open_until`` (the backoff: ``base_s`` the first time, doubled
  each time it opens again without a success in between, at most ``max_s``).
* *half-open*: the backoff passed; placement may use the worker again. The next dispatch decides:
  a success closes the breaker (and resets the backoff), a failure opens it again at once, for the
  doubled backoff.
"""

from __future__ import annotations

from dataclasses import dataclass

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half-open"


@dataclass
class CircuitBreaker:
    """One worker's breaker (see the module docstring); times are ``time.monotonic()`` seconds.

    Raises:
        ValueError: ``threshold < 1`` or ``base_s <= 0``. (A ``max_s`` below ``base_s`` caps at ``base_s``.)
    """

    threshold: int = 3
    base_s: float = 1.0
    max_s: float = 30.0
    failures: int = 0  # consecutive failures since the last success
    opened: int = 0  # times opened since the last success (the backoff's exponent)
    open_until: float | None = None  # set while open or half-open (the backoff's end)

    def __post_init__(self) -> None:
        if self.threshold < 1 or not self.base_s > 0:
            raise ValueError(f"need threshold >= 1 and base_s > 0, got {self}")

    def state(self, now: float) -> str:
        if self.open_until is None:
            return CLOSED
        return OPEN if now < self.open_until else HALF_OPEN

    def allows(self, now: float) -> bool:
        """Whether placement may use the worker now (closed or half-open)."""
        return self.state(now) != OPEN

    def success(self) -> bool:
        """A dispatch succeeded: close. True if that changed the state (it was open or half-open)."""
        changed = self.open_until is not None
        self.failures, self.opened, self.open_until = 0, 0, None
        return changed

    def failure(self, now: float) -> float | None:
        """A dispatch failed; returns the backoff (seconds) if this opened the breaker, else None."""
        self.failures += 1
        if self.open_until is None and self.failures < self.threshold:
            return None
        if self.open_until is not None and now < self.open_until:
            return None  # already open: a call placed before it opened failed too
        backoff = min(self.base_s * 2**self.opened, max(self.max_s, self.base_s))
        self.opened += 1
        self.open_until = now + backoff
        return backoff
