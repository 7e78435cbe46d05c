"""Placement scorers, registered by name: each scores one feasible worker for a request.

A scorer's ``score(request, worker, fit)`` is a cost in *prefill blocks* (the time one block of
prompt takes), lower is better; a policy sums its scorers' costs by weight.
NOTE: one shared unit rather than llm-d's [0, 1] normalisation: a cached prefix saves a number of
prefill blocks and a backlog delays by a number of them, so affinity and load trade exactly, and a
weight has a meaning (kvserve/router/policy/placement/cost.py).
"""

from __future__ import annotations

from typing import Protocol

from kvserve.router.policy.placement.fit import Fit
from kvserve.router.policy.placement.scorers.backlog import Backlog
from kvserve.router.policy.placement.scorers.pool_usage import PoolUsage
from kvserve.router.policy.placement.scorers.prefix_affinity import PrefixAffinity
from kvserve.router.policy.placement.views import PlacementRequest, WorkerView


class Scorer(Protocol):
    def score(self, request: PlacementRequest, worker: WorkerView, fit: Fit) -> float: ...


SCORERS: dict[str, type] = {"prefix_affinity": PrefixAffinity, "backlog": Backlog, "pool_usage": PoolUsage}

__all__ = ["SCORERS", "Backlog", "PoolUsage", "PrefixAffinity", "Scorer"]
