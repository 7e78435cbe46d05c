"""``kvserve frontend --router HOST:PORT``: one stateless frontend as a plain process (``kvserve/frontend/server.py``).

For frontends deployed apart from the router (a Kubernetes Deployment behind its own Service,
deploy/kuberay/raycluster.yaml): it serves the client gRPC API on ``--grpc-port`` and the OpenAI HTTP
API on ``--http-port`` (both with SO_REUSEPORT, so several on one host may share them) and relays every
request to the router at ``--router`` over one GenerateStream. Whatever runs it restarts it
(Kubernetes); ``kvserve serve --frontends N`` runs the same server as Ray actors instead.

Secrets come from the environment: ``KVSERVE_AUTH_TOKEN`` (the client bearer token, as the router's)
and ``KVSERVE_FRONTEND_KEY`` (the cluster's frontend key: the router trusts the end-client names a
frontend relays only with it; without it every relayed request counts against this frontend's
address for ``max_streams_per_client``). Prints one line per listening API on stdout; SIGINT/SIGTERM
stop it.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys

logger = logging.getLogger(__name__)


def _port_or_off(text: str) -> int | None:
    return None if text == "off" else int(text)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "frontend",
        help="a stateless frontend: the client gRPC and HTTP APIs, relayed to a router",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
    )
    p.add_argument("--router", required=True, help="the router's gRPC HOST:PORT")
    p.add_argument(
        "--model", default=None, help="model directory: tokenizer and chat template (without: token-id prompts only)"
    )
    p.add_argument("--served-model-name", default=None, help="the model name the HTTP API answers to")
    p.add_argument("--host", default="127.0.0.1", help="bind address")
    p.add_argument("--grpc-port", type=int, default=50052, help="client gRPC port (shared with SO_REUSEPORT)")
    p.add_argument("--http-port", type=_port_or_off, default=8000, help="OpenAI HTTP API port, or off")
    p.add_argument("--frontend-id", default=None, help="this frontend's name (default: the host name)")
    p.add_argument("--auth-keys", default=None, help="API keys file (as the router's --auth-keys)")
    p.add_argument("--tls-cert", default=None, help="PEM: serve both client ports over TLS with this certificate")
    p.add_argument("--tls-key", default=None, help="PEM: the key of --tls-cert")
    p.add_argument("--tls-client-ca", default=None, help="PEM: require client certificates signed by this CA (mTLS)")
    p.add_argument("--router-ca", default=None,
                   help="PEM: connect to the router over TLS, trusting this CA for its certificate; under the "
                        "router's mTLS this frontend presents --tls-cert/--tls-key")  # fmt: skip
    p.set_defaults(func=cmd_frontend)


def settings_from_args(args: argparse.Namespace):  # noqa: ANN201 - FrontendSettings (imported lazily)
    from kvserve.frontend.server import FRONTEND_KEY_ENV, FrontendSettings
    from kvserve.router.config import RouterConfig

    router = RouterConfig(
        model=args.model or "",
        host=args.host,
        served_model_name=args.served_model_name,
        auth_token=os.environ.get("KVSERVE_AUTH_TOKEN") or None,
        auth_keys=args.auth_keys,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_client_ca=args.tls_client_ca,
    )
    key = os.environ.get(FRONTEND_KEY_ENV) or None
    link_tls = (args.router_ca, args.tls_cert, args.tls_key) if args.router_ca else (None, None, None)
    return FrontendSettings(
        args.router, router, args.grpc_port, args.http_port, args.frontend_id or socket.gethostname(), key, link_tls
    )


async def _serve(settings) -> None:  # noqa: ANN001 - FrontendSettings
    from kvserve.frontend.server import FrontendServer

    server = FrontendServer(settings)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for s in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(s, stop.set)
    grpc_port, http_port = await server.start()
    host = settings.router.host
    print(f"kvserve: frontend {settings.frontend_id} serving gRPC kvserve.v1.KVServe on {host}:{grpc_port}, "
          f"relaying to {settings.router_address}", flush=True)  # fmt: skip
    if http_port is not None:
        scheme = "https" if settings.router.tls_cert else "http"
        print(f"kvserve: OpenAI-compatible HTTP API on {scheme}://{host}:{http_port}/v1", flush=True)
    try:
        await stop.wait()
    finally:
        await server.stop()


def cmd_frontend(args: argparse.Namespace) -> int:
    try:
        settings = settings_from_args(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        asyncio.run(_serve(settings))
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0
