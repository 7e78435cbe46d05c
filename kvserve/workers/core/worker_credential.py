"""Worker credentials: how a worker proves to the router which worker it is (WorkerLink only).

The launcher makes one random *worker key* per cluster and keeps it (with the router, never with a
worker). Each worker it starts gets only its own credential, ``HMAC-SHA256(key, worker_id)``, sent
as the ``kvserve-worker-credential`` metadata of its WorkerLink stream. The router recomputes the
MAC from the id the credential names, and the ``Hello`` must name the same id. So:

- a client token (or nothing) cannot open a WorkerLink;
- a credential speaks for exactly one worker id: a worker cannot pose as another, and an id the
  launcher never issued has no valid credential;
- the key never leaves the launcher and the router, so a worker's credential leaks only itself.

NOTE: a leaf module (stdlib only), shared by the router (verifies) and the workers (send).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

WORKER_CREDENTIAL_HEADER = "kvserve-worker-credential"
_DOMAIN = b"kvserve WorkerLink v1\0"  # NOTE: binds the MAC to this use, should the key be reused
_MAC_HEX_LEN = 64
MAX_WORKER_ID_LEN = 128


def new_worker_key() -> str:
    """A fresh random per-cluster worker key (256 bits, hex)."""
    return secrets.token_hex(32)


def _mac(key: str, worker_id: str) -> str:
    return hmac.new(bytes.fromhex(key), _DOMAIN + worker_id.encode(), hashlib.sha256).hexdigest()


def issue_worker_credential(key: str, worker_id: str) -> str:
    """The credential (metadata value) of ``worker_id`` under ``key``: ``"<worker_id>:<mac hex>"``.

    Raises:
        ValueError: an empty or over-long id, or one with a character metadata cannot carry.
    """
    if not worker_id or len(worker_id) > MAX_WORKER_ID_LEN or not worker_id.isprintable() or not worker_id.isascii():
        raise ValueError(f"worker id must be 1..{MAX_WORKER_ID_LEN} printable ASCII characters, got {worker_id!r}")
    return f"{worker_id}:{_mac(key, worker_id)}"


def verify_worker_credential(key: str, credential: str | bytes | None) -> str | None:
    """The worker id a credential proves, or None when it is missing, malformed or forged.

    The comparison is constant-time, so a MAC cannot be guessed byte by byte from timings.
    """
    if isinstance(credential, bytes):
        try:
            credential = credential.decode("ascii")
        except UnicodeDecodeError:
            return None
    if not credential:
        return None
    worker_id, sep, mac = credential.rpartition(":")
    if not sep or not worker_id or len(worker_id) > MAX_WORKER_ID_LEN or len(mac) != _MAC_HEX_LEN:
        return None
    if hmac.compare_digest(mac.encode(), _mac(key, worker_id).encode()):
        return worker_id
    return None
