"""Pickers: turn the scored feasible workers into a ranking (the first is the choice)."""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.router.policy.placement.cost import CostModel


@dataclass(frozen=True)
class Candidate:
    """A feasible worker and how placement scored it (lower ``cost`` is better).

    Attributes:
        worker_id: the worker.
        cached_blocks: leading prompt blocks cached or pending there (capped, kvserve/router/policy/placement/fit.py).
        promised_blocks: blocks placing the request there takes (``Fit.promised_blocks``).
        usage_after: fraction of the pool committed after placing it there, 0..1.
        requests: running + waiting requests on the worker.
        cost: the weighted sum of the policy's scorers (0 for a policy without scorers).
        tie: ``-tie_rank``: lower sorts first.
    """

    worker_id: str
    cached_blocks: int
    promised_blocks: int
    usage_after: float
    requests: int
    cost: float
    tie: int = 0

    @property
    def load_key(self) -> tuple[float, int, int, str]:
        """Order by load: pool usage after placement, then requests, then the tie rank, then id."""
        return (self.usage_after, self.requests, self.tie, self.worker_id)


class LowestCost:
    """Lowest cost first, ties by load (``load_key``). With a ``balance`` guard (after SGLang's
    cache-aware router), a worker with far more requests than the least-loaded one ranks after
    the others whatever its cost (``CostModel.overloaded``): reports lag, and this bounds the pile-up."""

    def __init__(self, balance: CostModel | None = None) -> None:
        self.balance = balance

    def rank(self, found: list[Candidate]) -> list[Candidate]:
        if self.balance is None:
            return sorted(found, key=lambda c: (c.cost, *c.load_key))
        least = min((c.requests for c in found), default=0)
        overloaded = self.balance.overloaded
        return sorted(found, key=lambda c: (overloaded(c.requests, least), c.cost, *c.load_key))

    def chose(self, worker_id: str) -> None:
        """Stateless."""


class RoundRobin:
    """The next feasible worker after the last choice, in id order."""

    def __init__(self) -> None:
        self.last: str | None = None

    def rank(self, found: list[Candidate]) -> list[Candidate]:
        found = sorted(found, key=lambda c: c.worker_id)
        if self.last is None:
            return found
        return [c for c in found if c.worker_id > self.last] + [c for c in found if c.worker_id <= self.last]

    def chose(self, worker_id: str) -> None:
        self.last = worker_id
