"""Who may call what on the router's gRPC port.

- ``grpc.health.v1.Health`` and reflection: anyone (probes and grpcurl discovery need no secret;
  they reveal nothing about requests).
- ``kvserve.v1.WorkerLink``: only a worker, with its own worker credential
  (``kvserve/workers/core/worker_credential.py``); ``kvserve/router/gate/worker_auth.py`` checks it and binds it to the
  ``Hello``. A client token does not open it.
- ``kvserve.v1.KVServe`` (the client API): the bearer token or an API key when either is
  configured (UNAUTHENTICATED otherwise); never a worker credential (PERMISSION_DENIED), so a
  worker's credential leaks no client access.
- ``kvserve.v1.Admin`` (operator actions: drain, rollout): an *admin* credential when client auth
  is configured: the bearer token (the operator's one secret in the simple mode) or an API key
  flagged ``admin: true`` in the key file; any other key is PERMISSION_DENIED (a tenant cannot
  restart the cluster's workers), a worker credential too, no credential UNAUTHENTICATED. Without
  any client auth the port is open to whoever reaches it (loopback by default), Admin included.
"""

from __future__ import annotations

import hmac

import grpc

from kvserve.router.gate.tenancy import KeyRing
from kvserve.workers.core.worker_credential import WORKER_CREDENTIAL_HEADER

FRONTEND_CREDENTIAL_HEADER = "kvserve-frontend-credential"
_OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
WORKER_LINK_PREFIX = "/kvserve.v1.WorkerLink/"
ADMIN_PREFIX = "/kvserve.v1.Admin/"


def denied(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    """A handler of ``handler``'s shape that only answers ``code`` (the call's body is never read)."""

    async def unary(request, context):  # noqa: ANN001 - gRPC handler signature
        await context.abort(code, message)

    async def streaming(request, context):  # noqa: ANN001
        await context.abort(code, message)
        yield  # pragma: no cover - makes this an async generator

    kw = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(streaming, **kw)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(unary, **kw)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(streaming, **kw)
    return grpc.unary_unary_rpc_method_handler(unary, **kw)


class CallerAuthInterceptor(grpc.aio.ServerInterceptor):
    """Client-API authentication (see the module docstring); installed whether or not a token is set.

    Args:
        token: the client bearer token (None: the client API is open to whoever reaches the port,
            unless ``keys`` are given).
        keys: API keys (``--auth-keys``): each also opens the client API, as its tenant
            (kvserve/router/gate/tenancy.py).
    """

    def __init__(self, token: str | None, keys: KeyRing | None = None) -> None:
        if token is not None and not token:
            raise ValueError("auth token must be non-empty")
        self._expected = f"Bearer {token}".encode() if token else None
        self._keys = keys

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):  # noqa: ANN001
        handler = await continuation(details)
        method = details.method
        if handler is None or method.startswith(_OPEN_PREFIXES) or method.startswith(WORKER_LINK_PREFIX):
            return handler  # NOTE: WorkerLink authenticates in kvserve/router/gate/worker_auth.py (it needs the Hello)
        metadata = dict(details.invocation_metadata or ())
        if WORKER_CREDENTIAL_HEADER in metadata:
            return denied(handler, grpc.StatusCode.PERMISSION_DENIED, "a worker credential cannot call the client API")
        if self._expected is None and self._keys is None:
            return handler
        got = metadata.get("authorization", "")
        if isinstance(got, str):
            got = got.encode()
        # NOTE: constant-time compare, so the token cannot be guessed byte by byte from timings.
        if self._expected is not None and hmac.compare_digest(got, self._expected):
            return handler
        found = self._keys.lookup(got) if self._keys is not None else None
        if found is not None:
            if method.startswith(ADMIN_PREFIX) and not found[1].admin:
                return denied(handler, grpc.StatusCode.PERMISSION_DENIED,
                              "operator actions need an admin key (admin: true in the key file)")  # fmt: skip
            return handler
        return denied(
            handler,
            grpc.StatusCode.UNAUTHENTICATED,
            "missing or wrong bearer token (send 'authorization: Bearer <token>')",
        )


def frontend_trusted(metadata: object, frontend_key: str | None) -> bool:
    """Whether a call carries the cluster's frontend credential (``FRONTEND_CREDENTIAL_HEADER``).

    NOTE: it grants one thing only: the router counts each request a frontend relays on its
    GenerateStream against the end client the frontend names (``max_streams_per_client``), not
    against the frontend. It opens no API (the client's own token or key still has to) and is not a
    worker credential (a separate secret, checked nowhere on WorkerLink), so a frontend can neither
    widen what a key may do nor pose as a worker.
    """
    if not frontend_key:
        return False
    got = dict(metadata or ()).get(FRONTEND_CREDENTIAL_HEADER, "")  # type: ignore[call-overload]
    if isinstance(got, bytes):
        got = got.decode("latin-1")
    return hmac.compare_digest(got.encode(), frontend_key.encode())
