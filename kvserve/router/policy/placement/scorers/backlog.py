"""Backlog: the queueing delay a worker's work ahead implies, in prefill blocks.

``blocks_in_flight`` is prefill the router placed there that has not started; a request waiting
inside the worker delays a newcomer by about one request's turn (``waiting_blocks``); a running
request slows every engine step by one decode token (``running_blocks``). NOTE: every worker is
charged in the same unit, so no throughput figure is needed (heterogeneous workers would divide by
their prefill rate).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.router.policy.placement.fit import Fit
from kvserve.router.policy.placement.views import PlacementRequest, WorkerView


@dataclass(frozen=True)
class Backlog:
    waiting_blocks: float = 8.0
    running_blocks: float = 1.0

    def score(self, request: PlacementRequest, worker: WorkerView, fit: Fit) -> float:
        return worker.blocks_in_flight + self.waiting_blocks * worker.waiting + self.running_blocks * worker.running
