"""Bearer-token authentication for every RPC except the standard health and reflection services
(probes and grpcurl discovery need no secret; they reveal nothing about requests)."""

from __future__ import annotations

import hmac

import grpc

_OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


def _denied(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    message = "missing or wrong bearer token (send 'authorization: Bearer <token>')"

    async def unary(request, context):  # noqa: ANN001 - gRPC handler signature
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def streaming(request, context):  # noqa: ANN001
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover - makes this an async generator

    kw = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(streaming, **kw)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(unary, **kw)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(streaming, **kw)
    return grpc.unary_unary_rpc_method_handler(unary, **kw)


class BearerAuthInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("auth token must be non-empty")
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):  # noqa: ANN001
        handler = await continuation(details)
        if handler is None or details.method.startswith(_OPEN_PREFIXES):
            return handler
        got = dict(details.invocation_metadata or ()).get("authorization", "")
        if isinstance(got, str):
            got = got.encode()
        # NOTE: constant-time compare, so the token cannot be guessed byte by byte from timings.
        if hmac.compare_digest(got, self._expected):
            return handler
        return _denied(handler)
