"""The router's gRPC server keepalive: how a peer that vanished without closing its TCP
connection (power loss, a partition, a NAT that dropped it) is noticed.

Without it, such a connection looks open until the kernel gives up on unacknowledged data
(minutes to hours, never for a peer we only read from): a worker's WorkerLink would never break
(the liveness rule's link-grace clause could not fire; only the stall clause would, and only while
the worker had work), and a vanished client would hold its request's blocks until its tokens ran
out. With it, the server pings a connection silent for ``keepalive_s`` and closes it when no answer
comes within ``keepalive_timeout_s``: the stream on it ends as if the peer had hung up.
"""

from __future__ import annotations

from kvserve.router.config import RouterConfig

# The most frequent client ping the server accepts without data: the workers ping every 10 s
# (kvserve/workers/transport/worker_link.py); a client pinging more often than this gets a GOAWAY.
MIN_CLIENT_PING_INTERVAL_MS = 5_000


def server_keepalive_options(config: RouterConfig) -> list[tuple[str, int]]:
    """gRPC server channel arguments for ``config``'s keepalive (see the module doc)."""
    return [
        ("grpc.keepalive_time_ms", round(config.keepalive_s * 1000)),
        ("grpc.keepalive_timeout_ms", round(config.keepalive_timeout_s * 1000)),
        # NOTE: gRPC >= 1.5x times out an unanswered ping by this (default 60 s), not only by the above.
        ("grpc.http2.ping_timeout_ms", round(config.keepalive_timeout_s * 1000)),
        # NOTE: ping idle connections too: a client waiting in the queue, or between calls, has
        # no call sending data, and it is exactly such a peer that may vanish unnoticed.
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),  # keep pinging a quiet connection (default: 2 pings)
        ("grpc.http2.min_recv_ping_interval_without_data_ms", MIN_CLIENT_PING_INTERVAL_MS),
    ]
