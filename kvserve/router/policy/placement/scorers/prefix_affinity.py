"""Prefix affinity: the prompt blocks a worker would still prefill (those not cached or pending there),
less what its node's host/disk tiers save (a loaded block costs its measured load/recompute ratio)."""

from __future__ import annotations

from kvserve.router.policy.placement.fit import Fit
from kvserve.router.policy.placement.views import PlacementRequest, WorkerView


class PrefixAffinity:
    def score(self, request: PlacementRequest, worker: WorkerView, fit: Fit) -> float:
        return fit.prompt_blocks - fit.cached - fit.tier_saved
