"""Migration load: a worker copying a live migration's blocks in or out spends its steps on the copy, so
each block in flight costs one prefill block's time. Off in the default set (weight 0); turn it on with
``--placement-scorers ...,migration_load=W`` where migrations are frequent (high watermarks, drains)."""

from __future__ import annotations

from kvserve.router.policy.placement.fit import Fit
from kvserve.router.policy.placement.views import PlacementRequest, WorkerView


class MigrationLoad:
    def score(self, request: PlacementRequest, worker: WorkerView, fit: Fit) -> float:
        return worker.blocks_migrating_in + worker.blocks_migrating_out
