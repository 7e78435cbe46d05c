"""Placement scorers, registered by name: each scores one feasible worker for a request.

A scorer's ``score(request, worker, fit)`` is a cost in *prefill blocks* (the time one block of
prompt takes), lower is better; a policy sums its scorers' costs by weight. The ``kv_aware`` policy's
set and weights are configuration (``RouterConfig.placement_scorers``, ``NAME=WEIGHT,...`` over the
names below), so adding a scorer is its file and one line here.
NOTE: one shared unit rather than llm-d's [0, 1] normalisation: a cached prefix saves a number of
prefill blocks and a backlog delays by a number of them, so affinity and load trade exactly, and a
weight has a meaning (kvserve/router/policy/placement/cost.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from kvserve.router.policy.placement.cost import CostModel
from kvserve.router.policy.placement.fit import Fit
from kvserve.router.policy.placement.scorers.backlog import Backlog
from kvserve.router.policy.placement.scorers.migration_load import MigrationLoad
from kvserve.router.policy.placement.scorers.pool_usage import PoolUsage
from kvserve.router.policy.placement.scorers.prefix_affinity import PrefixAffinity
from kvserve.router.policy.placement.views import PlacementRequest, WorkerView


class Scorer(Protocol):
    def score(self, request: PlacementRequest, worker: WorkerView, fit: Fit) -> float: ...


# name -> the scorer built from the cost model's parameters (its weight comes from the configuration)
SCORERS: dict[str, Callable[[CostModel], Scorer]] = {
    "prefix_affinity": lambda cost: PrefixAffinity(),
    "backlog": lambda cost: Backlog(cost.waiting_blocks, cost.running_blocks),
    "pool_usage": lambda cost: PoolUsage(),
    "migration_load": lambda cost: MigrationLoad(),
}


def default_weights(cost: CostModel) -> dict[str, float]:
    """The ``kv_aware`` set: affinity x ``overlap_weight`` + backlog + pool usage x ``usage_weight``."""
    return {"prefix_affinity": cost.overlap_weight, "backlog": 1.0, "pool_usage": cost.usage_weight}


def parse_weights(spec: str) -> dict[str, float]:
    """``"prefix_affinity=2,backlog=1"`` as a mapping of registered scorer names to weights.

    Raises:
        ValueError: an unknown name, a repeated one, a weight that is not a number >= 0, or no entry.
    """
    weights: dict[str, float] = {}
    for item in (part.strip() for part in spec.split(",")):
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep or name not in SCORERS:
            raise ValueError(f"placement scorer {item!r}: expected NAME=WEIGHT with NAME one of {sorted(SCORERS)}")
        if name in weights:
            raise ValueError(f"placement scorer {name!r} given twice")
        try:
            weight = float(value)
        except ValueError:
            raise ValueError(f"placement scorer {name!r}: weight {value!r} is not a number") from None
        if not weight >= 0:  # NOTE: also refuses NaN
            raise ValueError(f"placement scorer {name!r}: weight must be >= 0, got {value}")
        weights[name] = weight
    return weights


__all__ = ["SCORERS", "Backlog", "MigrationLoad", "PoolUsage", "PrefixAffinity", "Scorer", "default_weights",
           "parse_weights"]
