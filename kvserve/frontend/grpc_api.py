"""A frontend's ``kvserve.v1.KVServe`` (register with kvserve/router/api/grpc_surface.py's ``add_kvserve_servicer``,
which adds the lenient deserializers and the INTERNAL guard; ``kvserve/router/gate/auth.py`` ``CallerAuthInterceptor``
checks the caller's token or key first, and refuses a worker credential).

* ``Generate`` and ``GenerateStream``: relayed over the frontend's one stream to the router
  (``kvserve/frontend/link.py``); statuses, ordering, cancel and slow-consumer outcomes are the router's.
  A ``Generate`` with ``resume`` continues a stream whose frontend died, from the client's cursor
  (``RouterLink.take_over``, docs/architecture.md section 2a); ``GenerateStream`` takes no resumes.
  Every call's initial metadata names the frontend serving it (``kvserve-frontend``), so an
  operator (or a test) can tell which process a connection landed on behind the shared port.
* ``Abort``, ``GetClusterStatus``, ``WatchBlockPressure``: passed through to the router with the
  caller's own credential (the router decides what it may see and abort).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import grpc

from kvserve.frontend.link import RelayedRequest
from kvserve.frontend.relay import Relay
from kvserve.protos.kvserve.v1 import serving_pb2 as spb
from kvserve.protos.kvserve.v1 import serving_pb2_grpc
from kvserve.router.api.grpc_surface import abort_call, read_generate_stream
from kvserve.router.gate.limits import client_of_peer
from kvserve.router.requests.mux import StreamMux, stream_batches
from kvserve.router.requests.request import RouterError

FRONTEND_ID_HEADER = "kvserve-frontend"


def _authorization(context: grpc.aio.ServicerContext) -> str | None:
    got = dict(context.invocation_metadata() or ()).get("authorization")
    return got.decode("latin-1") if isinstance(got, bytes) else got


async def _abort(context: grpc.aio.ServicerContext, e: RouterError) -> None:
    await abort_call(context, e)  # NOTE: quiet for a call its deadline already ended


class FrontendServicer(serving_pb2_grpc.KVServeServicer):
    """The client API of one frontend (see the module docstring)."""

    def __init__(self, relay: Relay, frontend_id: str) -> None:
        self.relay = relay
        self.frontend_id = frontend_id
        self._stub = relay.link.stub

    async def Generate(  # noqa: N802 - gRPC method name
        self, request: spb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[spb.GenerateResponse]:
        await context.send_initial_metadata(((FRONTEND_ID_HEADER, self.frontend_id),))
        client = client_of_peer(context.peer())
        try:
            if request.HasField("resume"):  # NOTE: its frontend died; the client goes on from its cursor here
                rr = self.relay.link.take_over(_authorization(context), request, client)
            else:
                (rr,) = await self.relay.submit(client, [request], _authorization(context), context.time_remaining())
        except RouterError as e:
            await _abort(context, e)
            return
        try:
            async for response in rr.responses():
                yield response
        except RouterError as e:
            await _abort(context, e)
        finally:
            rr.cancel()  # NOTE: cancelled by the client or past its deadline: the router frees its blocks now

    async def GenerateStream(  # noqa: N802 - gRPC method name
        self, requests: AsyncIterator[Any], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[spb.GenerateBatch]:
        """The router's GenerateStream contract (``kvserve/router/api/server.py``), each request relayed on its own."""
        await context.send_initial_metadata(((FRONTEND_ID_HEADER, self.frontend_id),))
        mux = StreamMux()
        live: dict[str, RelayedRequest] = {}
        pumps: dict[str, asyncio.Task] = {}
        caller = (client_of_peer(context.peer()), _authorization(context))
        reader = asyncio.get_running_loop().create_task(self._read_requests(requests, mux, live, pumps, caller))
        try:
            async for batch in stream_batches(mux, live, reader):
                yield batch
        except RouterError as e:
            await _abort(context, e)
        finally:
            reader.cancel()
            for task in pumps.values():
                task.cancel()
            for rr in live.values():
                rr.cancel()

    async def _read_requests(self, requests: AsyncIterator[Any], mux: StreamMux, live: dict[str, RelayedRequest],
                             pumps: dict[str, asyncio.Task], caller: tuple[str, str | None]) -> None:  # fmt: skip
        client, authorization = caller

        async def submit(rid: str, msg: spb.GenerateStreamRequest) -> None:
            try:
                timeout_s = msg.timeout_ms / 1000 if msg.timeout_ms else None
                (rr,) = await self.relay.submit(client, [msg.generate], authorization, timeout_s)
            except RouterError as e:
                mux.put(rid, e)
                return
            live[rid] = rr
            pumps[rid] = asyncio.get_running_loop().create_task(_pump(rr, mux, self.relay.link.max_buffered))

        def cancel(rr: RelayedRequest) -> None:
            rr.cancel()
            pumps.pop(rr.request_id).cancel()

        await read_generate_stream(requests, mux, live, submit, cancel, columns=False)

    async def Abort(self, request: spb.AbortRequest, context: grpc.aio.ServicerContext) -> spb.AbortResponse:  # noqa: N802
        # NOTE: an owned request is the frontend's to end (the router knows it by its owner key only).
        found = self.relay.link.abort(_authorization(context), request.request_id)
        if found is not None:
            return spb.AbortResponse(found=found)
        return await self._pass(context, self._stub.Abort, request)

    async def GetClusterStatus(  # noqa: N802
        self, request: spb.ClusterStatusRequest, context: grpc.aio.ServicerContext
    ) -> spb.ClusterStatus:
        return await self._pass(context, self._stub.GetClusterStatus, request)

    async def WatchBlockPressure(  # noqa: N802
        self, request: spb.WatchRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[spb.ClusterStatus]:
        call = self._stub.WatchBlockPressure(request, metadata=self.relay.link.metadata(_authorization(context)),
                                             timeout=context.time_remaining())  # fmt: skip
        try:
            async for status in call:
                yield status
        except grpc.aio.AioRpcError as e:
            await context.abort(e.code(), e.details() or "")
        finally:
            call.cancel()

    async def _pass(self, context: grpc.aio.ServicerContext, method: Any, request: Any) -> Any:
        try:
            return await method(request, metadata=self.relay.link.metadata(_authorization(context)),
                                timeout=context.time_remaining())  # fmt: skip
        except grpc.aio.AioRpcError as e:
            await context.abort(e.code(), e.details() or "")


async def _pump(rr: RelayedRequest, mux: StreamMux, max_buffered: int) -> None:
    """One relayed request's responses into the caller's stream; a caller that leaves more than
    ``max_buffered`` of them unsent gets the router's slow-consumer outcome (cancelled, RESOURCE_EXHAUSTED)."""
    with contextlib.suppress(asyncio.CancelledError):
        try:
            async for resp in rr.responses():
                if mux.unsent(rr.request_id) >= max_buffered:
                    rr.cancel()
                    mux.drop(rr.request_id)
                    mux.put(rr.request_id, RouterError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                                       f"client too slow: over {max_buffered} responses unsent "
                                                       "(limit max_buffered_responses)"))  # fmt: skip
                    return
                mux.put(rr.request_id, resp)
        except RouterError as e:
            mux.put(rr.request_id, e)
