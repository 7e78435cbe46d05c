"""PEM files for the router's, the frontends' and the workers' TLS (the one reader of them)."""

from __future__ import annotations

from pathlib import Path

import grpc


def read_pem(path: str | None) -> bytes | None:
    """The bytes of a PEM file, or None for no path (the one PEM reader: router and worker TLS)."""
    return Path(path).read_bytes() if path else None


def server_credentials(cert: str, key: str | None, client_ca: str | None = None) -> grpc.ServerCredentials:
    """A gRPC server's TLS credentials: its key pair, and with ``client_ca`` client certificates
    signed by it required (mTLS). The router's and the frontends' client ports alike."""
    return grpc.ssl_server_credentials(
        [(read_pem(key), read_pem(cert))], root_certificates=read_pem(client_ca), require_client_auth=bool(client_ca)
    )


def add_port(server: grpc.aio.Server, address: str, cert: str | None, key: str | None,
             client_ca: str | None = None) -> int:  # fmt: skip
    """Bind ``address`` on a gRPC server: TLS with ``cert`` (``server_credentials``), plaintext
    without; the bound port (0: it could not be bound). The router's and the frontends' ports alike."""
    if cert:
        return server.add_secure_port(address, server_credentials(cert, key, client_ca))
    return server.add_insecure_port(address)


def channel_credentials(
    tls_ca: str | None = None, tls_cert: str | None = None, tls_key: str | None = None
) -> grpc.ChannelCredentials | None:
    """TLS credentials from PEM files, or None (plaintext) when none is given.

    ``tls_ca`` is the CA that signed the router's certificate (None: the system roots);
    ``tls_cert`` + ``tls_key`` are this side's certificate for mTLS.

    Raises:
        ValueError: only one of ``tls_cert`` / ``tls_key``.
    """
    if not (tls_ca or tls_cert or tls_key):
        return None
    if bool(tls_cert) != bool(tls_key):
        raise ValueError("tls_cert and tls_key go together")
    return grpc.ssl_channel_credentials(
        root_certificates=read_pem(tls_ca), private_key=read_pem(tls_key), certificate_chain=read_pem(tls_cert)
    )
