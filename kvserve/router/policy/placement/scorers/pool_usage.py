"""Pool usage: a fuller pool means preemptions, so the pool fraction committed after the placement
costs up to one full prefill of the prompt."""

from __future__ import annotations

from kvserve.router.policy.placement.fit import Fit
from kvserve.router.policy.placement.views import PlacementRequest, WorkerView


class PoolUsage:
    def score(self, request: PlacementRequest, worker: WorkerView, fit: Fit) -> float:
        return fit.usage_after * fit.prompt_blocks
