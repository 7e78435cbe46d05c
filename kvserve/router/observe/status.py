"""The cluster status a client sees (``GetClusterStatus``, ``WatchBlockPressure``, ``kvserve top``):
built from the router's tables and the workers' last pressure reports, never from a live call."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from kvserve.protos.kvserve.v1 import serving_pb2 as spb
from kvserve.router.policy.admission import AdmissionQueue
from kvserve.router.policy.rebalance import Watermarks


def build_cluster_status(
    workers: Iterable[spb.WorkerStatus],
    q: AdmissionQueue[Any],
    requests_in_flight: int,
    replays: int,
    watermarks: Watermarks,
) -> spb.ClusterStatus:
    """A snapshot of every worker (its row as last reported, ``WorkerState.status_row``) and of the
    router's queue and counters."""
    status = spb.ClusterStatus(timestamp_ms=int(time.time() * 1000))
    status.workers.extend(workers)
    status.router.queue_requests = q.num_requests
    status.router.queue_blocks = q.num_blocks
    status.router.max_queue_requests = q.max_requests
    status.router.max_queue_blocks = q.max_blocks
    status.router.admission_state = q.state.value
    for reason, n in q.rejections_total.items():
        status.router.rejections_total[reason.value] = n
    status.router.requests_in_flight = requests_in_flight
    wait = q.projected_wait_s()
    status.router.projected_wait_s = -1.0 if wait is None else wait
    status.router.replays_total = replays
    status.router.high_watermark, status.router.low_watermark = watermarks.high, watermarks.low
    return status
