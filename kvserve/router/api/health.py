"""Health that tells the truth: one readiness verdict for gRPC health and HTTP ``/health``.

Two questions, two answers (Kubernetes asks both):

* **Liveness**: is the router process answering? Yes whenever its event loop serves a call at all:
  gRPC health service ``LIVENESS_SERVICE`` is SERVING from ``start`` on, HTTP ``/health/live``
  answers 200. A liveness failure should restart the router (its pod), nothing else.
* **Readiness**: can the cluster serve a request now? Yes iff at least one worker is *serving*
  (``WorkerTable.serving``: up, healthy, WorkerLink connected; a retired or down worker never counts).
  gRPC health services ``""`` and ``kvserve.v1.KVServe`` and HTTP ``/health`` and
  ``/health/ready`` all give this one verdict (``cluster_ready``), and it flips back to
  NOT_SERVING / 503 as soon as no worker can serve, and to SERVING / 200 when one can again.

``HealthPublisher`` keeps the gRPC health service in step with ``cluster_ready``: it re-reads the
verdict every ``interval_s`` (and at once when the first worker says Hello) and writes only
changes, so a ``Health.Watch`` streams one message per change. NOTE: polling (a few dict reads per
interval) rather than a hook in every place a worker's state changes: the verdict is derived from
the router's tables, so it cannot drift from them, and HTTP (which computes it per request) and
gRPC agree within one interval.
"""

from __future__ import annotations

import asyncio
import logging

from grpc_health.v1 import health, health_pb2

from kvserve.router.api.readiness import ReadinessSource

logger = logging.getLogger(__name__)

# The gRPC health service names that answer readiness (the default "" included, as Kubernetes'
# grpc probe and grpc-health-probe ask "" unless told otherwise).
READINESS_SERVICES = ("", "kvserve.v1.KVServe")
# The gRPC health service name that answers liveness (a Kubernetes livenessProbe names it).
LIVENESS_SERVICE = "kvserve.v1.Liveness"
DEFAULT_INTERVAL_S = 0.2


def cluster_ready(router: ReadinessSource) -> bool:
    """Whether some worker can take a request now (the readiness verdict, gRPC and HTTP alike)."""
    return router.table.any_serving()


def serving_workers(router: ReadinessSource) -> int:
    """How many workers can take a request now (for the readiness answer's text)."""
    return sum(1 for w in router.table.entries.values() if router.table.serving(w))


class HealthPublisher:
    """Keeps a ``grpc.aio`` health servicer in step with ``cluster_ready`` (see the module doc).

    Args:
        router: the router whose tables give the verdict.
        servicer: the health servicer registered on the router's gRPC server.
        interval_s: how often the verdict is re-read (the most it lags a state change).
    """

    def __init__(
        self, router: ReadinessSource, servicer: health.aio.HealthServicer, interval_s: float = DEFAULT_INTERVAL_S
    ):
        if not interval_s > 0:
            raise ValueError(f"interval_s must be positive, got {interval_s}")
        self.router = router
        self.servicer = servicer
        self.interval_s = interval_s
        self.ready: bool | None = None  # the verdict last published (None: nothing yet)

    async def start(self) -> None:
        """Publish the initial verdict (liveness SERVING, readiness as it is now)."""
        await self.servicer.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)
        await self.publish()

    async def publish(self) -> bool:
        """Write the current readiness verdict if it changed; returns it."""
        ready = cluster_ready(self.router)
        if ready != self.ready:
            status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
            for name in READINESS_SERVICES:
                await self.servicer.set(name, status)
            if self.ready is not None or ready:
                logger.warning("router %s: %d worker(s) can serve", "ready" if ready else "NOT ready",
                               serving_workers(self.router))  # fmt: skip
            self.ready = ready
        return ready

    async def run(self) -> None:
        """Publish changes until cancelled. A failure to publish is logged and retried next
        interval: health checking must never stop silently."""
        ready_event = self.router.ready_event()
        while True:
            try:
                await self.publish()
            except Exception:  # noqa: BLE001 - keep publishing; the next interval retries
                logger.exception("publishing router health failed")
            if not ready_event.is_set():
                # NOTE: wake at the first Hello, so readiness flips without waiting an interval.
                try:
                    await asyncio.wait_for(ready_event.wait(), self.interval_s)
                except TimeoutError:
                    pass
            else:
                await asyncio.sleep(self.interval_s)
