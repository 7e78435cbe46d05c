"""Prefix affinity: the prompt blocks a worker would still prefill (those not cached or pending there)."""

from __future__ import annotations

from router.placement.fit import Fit
from router.placement.views import PlacementRequest, WorkerView


class PrefixAffinity:
    def score(self, request: PlacementRequest, worker: WorkerView, fit: Fit) -> float:
        return fit.prompt_blocks - fit.cached
