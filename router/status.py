"""The cluster status a client sees (``GetClusterStatus``, ``WatchBlockPressure``, ``kvserve top``):
built from the router's tables and the workers' last pressure reports, never from a live call."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from protos.kvserve.v1 import serving_pb2 as spb

if TYPE_CHECKING:
    from router.router import Router


def build_cluster_status(router: Router) -> spb.ClusterStatus:
    """A snapshot of every worker (as last reported) and of the router's queue and counters."""
    now = time.monotonic()
    status = spb.ClusterStatus(timestamp_ms=int(time.time() * 1000))
    for entry in router.workers.values():
        r, ident = entry.report, entry.identity
        w = status.workers.add(
            worker_id=entry.worker_id,
            healthy=router.serving(entry),
            state=entry.state,
            restarts_total=entry.restarts_total,
            total_blocks=ident.total_blocks,
            num_migrations_total=entry.migrations_out,
            blocks_in_flight=sum(entry.in_flight.values()),
            model_id=ident.model_id,
            node_id=ident.node_id,
            last_report_age_s=now - entry.report_time if r else -1.0,
        )
        if r is not None:
            w.free_blocks, w.used_blocks = r.free_blocks, r.used_blocks
            w.cached_evictable_blocks = r.cached_evictable_blocks
            w.usage = r.used_blocks / r.total_blocks if r.total_blocks else 0.0
            w.num_running, w.num_waiting, w.num_swapped = r.num_running, r.num_waiting, r.num_swapped
            w.swap_blocks_total, w.swap_blocks_free = r.swap_blocks_total, r.swap_blocks_free
            w.num_preemptions_total = r.num_preemptions_total
            w.decode_steps, w.step_latency_ms = r.decode_steps, r.step_latency_ms
            q = r.prefix_cache_query_tokens_total
            w.prefix_cache_hit_rate = r.prefix_cache_hit_tokens_total / q if q else 0.0
        else:
            w.free_blocks = ident.total_blocks
    q = router.queue
    status.router.queue_requests = q.num_requests
    status.router.queue_blocks = q.num_blocks
    status.router.max_queue_requests = q.max_requests
    status.router.max_queue_blocks = q.max_blocks
    status.router.admission_state = q.state.value
    for reason, n in q.rejections_total.items():
        status.router.rejections_total[reason.value] = n
    status.router.requests_in_flight = sum(1 for r in router.requests.values() if r.worker_id is not None)
    wait = q.projected_wait_s()
    status.router.projected_wait_s = -1.0 if wait is None else wait
    status.router.replays_total = router.replays_total
    return status
