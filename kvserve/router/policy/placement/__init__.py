"""Placement: which worker runs a request (pure: no Ray, no gRPC, no torch).

The router keeps one ``WorkerView`` per worker (its last PressureReport plus the blocks the router
promised since) and asks ``Placement.decide`` for a ``Decision``: filter (``fit``), scorers, picker
(kvserve/router/policy/placement/placement.py). ``None`` means "fits nowhere right now" (the router queues the
request); ``fits_anywhere_ever`` says whether waiting can ever help (if not: INVALID_ARGUMENT).
"""

from kvserve.router.policy.placement.cost import CostModel
from kvserve.router.policy.placement.fit import Fit, fit, fits_anywhere_ever, room_for
from kvserve.router.policy.placement.pickers import Candidate
from kvserve.router.policy.placement.placement import POLICIES, Decision, Placement, PlacementPolicy
from kvserve.router.policy.placement.views import PlacementRequest, PrefixHits, PrefixMatch, WorkerView, tie_rank
from kvserve.workers.core.sizes import blocks_for

__all__ = [
    "POLICIES", "Candidate", "CostModel", "Decision", "Fit", "Placement", "PlacementPolicy", "PlacementRequest",
    "PrefixHits", "PrefixMatch", "WorkerView", "blocks_for", "fit", "fits_anywhere_ever", "room_for", "tie_rank",
]  # fmt: skip
