"""``kvserve.v1.Admin``: operator actions on the router's gRPC port (``kvserve drain``, ``kvserve
rollout``). Who may call them is decided before a call gets here (kvserve/router/gate/auth.py: an admin
credential when client auth is on)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from kvserve.protos.kvserve.v1 import serving_pb2 as spb
from kvserve.protos.kvserve.v1 import serving_pb2_grpc
from kvserve.router.requests.request import RouterError
from kvserve.router.requests.router import Router


class AdminServicer(serving_pb2_grpc.AdminServicer):
    """The Admin service over one router (registered with kvserve/router/api/grpc_surface.py ``add_kvserve_servicer``,
    which adds the same guards as the client API's: undecodable bytes INVALID_ARGUMENT, a bug INTERNAL)."""

    def __init__(self, router: Router) -> None:
        self.router = router

    async def DrainWorker(  # noqa: N802 - gRPC method name
        self, request: spb.DrainRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[spb.DrainProgress]:
        """Start (or follow) the drain of ``request.worker_id`` and stream its progress
        (kvserve/router/requests/drain.py). Leaving early does not stop the drain."""
        if not request.deadline_s >= 0:  # NOTE: also NaN
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"deadline_s must be >= 0, got {request.deadline_s}")
        try:
            drain = self.router.drainer.start(request.worker_id, request.deadline_s or None)
        except RouterError as e:
            await context.abort(e.code, e.message)
            return
        async for progress in self.router.drainer.follow(drain):
            yield progress
