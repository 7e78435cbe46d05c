"""``Placement``: filter -> scorers -> picker, composed per policy (after llm-d's inference scheduler).

* filter (kvserve/router/policy/placement/fit.py): healthy workers the request fits now, with the one computation of
  its hits, room and need (``Fit``);
* scorers (kvserve/router/policy/placement/scorers/): each a cost in prefill blocks, summed by the policy's weights;
* picker (kvserve/router/policy/placement/pickers.py): lowest cost with the balance guard, or round robin.

Policies are scorer sets, not branches (``POLICIES``):

* ``kv_aware`` (default): a weighted set of registered scorers (``scorers.SCORERS``), by default
  prefix affinity x ``overlap_weight`` + backlog + pool usage x ``usage_weight`` (``CostModel``),
  or the set ``RouterConfig.placement_scorers`` names; lowest first under the balance guard; ties by
  load, then ``tie_rank``, then id.
* ``least_loaded``: no scorer; lowest ``(usage_after, running + waiting, -tie_rank, worker_id)``.
* ``round_robin``: no scorer; the next feasible worker after the last choice, in id order.

Ties (equal cost and load) go to the worker that ranks highest for the request's first block hash
under rendezvous hashing (``tie_rank``), not to the lowest id: on an idle cluster every new prefix
would otherwise land on the same worker, filling its cache while the others stay empty.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from kvserve.router.policy.placement.cost import CostModel
from kvserve.router.policy.placement.fit import fit, fits_anywhere_ever
from kvserve.router.policy.placement.pickers import Candidate, LowestCost, RoundRobin
from kvserve.router.policy.placement.scorers import SCORERS, Scorer, default_weights
from kvserve.router.policy.placement.views import PlacementRequest, PrefixHits, WorkerView, tie_rank


class PlacementPolicy(str, enum.Enum):
    KV_AWARE = "kv_aware"
    LEAST_LOADED = "least_loaded"
    ROUND_ROBIN = "round_robin"


Weighted = list[tuple[Scorer, float]]


def _kv_aware(cost: CostModel, weights: Mapping[str, float] | None) -> tuple[Weighted, LowestCost | RoundRobin]:
    chosen = default_weights(cost) if weights is None else weights
    scorers: Weighted = [(SCORERS[name](cost), w) for name, w in chosen.items() if w]
    return scorers, LowestCost(balance=cost)


POLICIES: dict[PlacementPolicy, Callable[..., tuple[Weighted, LowestCost | RoundRobin]]] = {
    PlacementPolicy.KV_AWARE: _kv_aware,
    PlacementPolicy.LEAST_LOADED: lambda cost, weights: ([], LowestCost()),
    PlacementPolicy.ROUND_ROBIN: lambda cost, weights: ([], RoundRobin()),
}


@dataclass(frozen=True)
class Decision:
    """Where a request goes and what that placement promises (the router records it as is).

    Attributes:
        worker_id: the chosen worker.
        cached_blocks: leading prompt blocks cached or pending there.
        promised_blocks: blocks the placement takes there until the worker's report shows them
            (``Fit.promised_blocks``).
    """

    worker_id: str
    cached_blocks: int
    promised_blocks: int


class Placement:
    """Chooses a worker for a request (module doc).

    Args:
        policy: a ``PlacementPolicy`` or its string value.
        cost: the ``kv_aware`` weights; ``overlap_weight`` / ``running_weight`` / ``waiting_weight``
            override its ``overlap_weight`` / ``running_blocks`` / ``waiting_blocks``.
        weights: ``kv_aware``'s scorers by registered name and their weights (``scorers.parse_weights``);
            None: ``scorers.default_weights(cost)``.

    Raises:
        ValueError: unknown policy, a negative weight, an unknown scorer, or weights for another policy.
    """

    def __init__(
        self,
        policy: PlacementPolicy | str = PlacementPolicy.KV_AWARE,
        *,
        cost: CostModel | None = None,
        overlap_weight: float | None = None,
        running_weight: float | None = None,
        waiting_weight: float | None = None,
        weights: Mapping[str, float] | None = None,
    ) -> None:
        self.policy = PlacementPolicy(policy)
        overrides = {
            name: value
            for name, value in (
                ("overlap_weight", overlap_weight),
                ("running_blocks", running_weight),
                ("waiting_blocks", waiting_weight),
            )
            if value is not None
        }
        self.cost = dataclasses.replace(cost or CostModel(), **overrides)
        unknown = set(weights or ()) - set(SCORERS)
        if unknown:
            raise ValueError(f"unknown placement scorers {sorted(unknown)}; registered: {sorted(SCORERS)}")
        if weights is not None and self.policy != PlacementPolicy.KV_AWARE:
            raise ValueError("placement scorers are weighted by the kv_aware policy only")
        self.scorers, self.picker = POLICIES[self.policy](self.cost, weights)

    fits_anywhere_ever = staticmethod(fits_anywhere_ever)

    def candidates(
        self, request: PlacementRequest, workers: Sequence[WorkerView], prefix_hits: PrefixHits
    ) -> list[Candidate]:
        """Every healthy worker the request fits now, scored, best first for the policy (this call
        does not advance a round-robin rotation; ``decide`` does).

        Raises:
            ValueError: two views share a worker_id.
        """
        _check_unique(workers)
        found = []
        for w in workers:
            f = fit(request, w, prefix_hits)
            if f is None:
                continue
            cost = sum(weight * scorer.score(request, w, f) for scorer, weight in self.scorers)
            tie = -tie_rank(request.block_hashes, w.worker_id)
            load = w.running + w.waiting
            found.append(Candidate(w.worker_id, f.cached, f.promised_blocks, f.usage_after, load, cost, tie))
        return self.picker.rank(found)

    def decide(
        self, request: PlacementRequest, workers: Sequence[WorkerView], prefix_hits: PrefixHits
    ) -> Decision | None:
        """Where to place ``request``, or None if it fits no healthy worker now ("not now": queue it
        and retry when pressure changes).

        Args:
            request: the request's shape.
            workers: current views (the caller adds each placement to ``blocks_in_flight``).
            prefix_hits: leading-hash lookup, e.g. ``PrefixIndex.affinity``.

        Raises:
            ValueError: two views share a worker_id.
        """
        ranked = self.candidates(request, workers, prefix_hits)
        if not ranked:
            return None
        best = ranked[0]
        self.picker.chose(best.worker_id)
        return Decision(best.worker_id, best.cached_blocks, best.promised_blocks)

    def choose(self, request: PlacementRequest, workers: Sequence[WorkerView], prefix_hits: PrefixHits) -> str | None:
        """``decide``'s worker id (None: fits nowhere now)."""
        decision = self.decide(request, workers, prefix_hits)
        return None if decision is None else decision.worker_id


def _check_unique(workers: Sequence[WorkerView]) -> None:
    if len({w.worker_id for w in workers}) == len(workers):
        return
    ids = sorted(w.worker_id for w in workers)
    for a, b in itertools.pairwise(ids):
        if a == b:
            raise ValueError(f"duplicate worker_id {a!r} in placement views")
