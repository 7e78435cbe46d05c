"""Worker credentials: how a worker proves to the router which worker it is (WorkerLink only).

The launcher makes one random *worker key* per cluster and keeps it (with the router, never with a
worker). Each worker it starts gets only its own credential, ``HMAC-SHA256(key, worker_id)``, sent
as the ``kvserve-worker-credential`` metadata of its WorkerLink stream. The router recomputes the
MAC from the id the credential names, and the ``Hello`` must name the same id. So:

- a client token (or nothing) cannot open a WorkerLink;
- a credential speaks for exactly one worker id: a worker cannot pose as another, and an id the
  launcher never issued has no valid credential;
- the key never leaves the launcher and the router, so a worker's credential leaks only itself.

A credential alone is not enough (issue 42: a copied one, replayed from outside Ray with a fresh
incarnation, was taken for a restart of its worker). The link is also bound to the *process*:
the router hands each incarnation of a worker's actor a one-time random nonce through Ray (the
actor's ``bind_link`` method, which only a process inside the Ray cluster holding the actor's
handle can call, and which reaches only the live process), and a WorkerLink must carry
``link_proof`` = ``HMAC-SHA256(credential, incarnation, nonce)`` as the
``kvserve-worker-link-proof`` metadata beside its ``Hello`` (whose ``incarnation`` it covers).
The router accepts a Hello only for the incarnation its last nonce went to, with that proof
(``kvserve/router/gate/worker_auth.py``): a copied credential from another process, or an old
incarnation's proof, is refused before any session (and never counts as a restart).

NOTE: a leaf module (stdlib only), shared by the router (verifies) and the workers (send).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

WORKER_CREDENTIAL_HEADER = "kvserve-worker-credential"
LINK_PROOF_HEADER = "kvserve-worker-link-proof"
# NOTE: the link's server sends this header once it has accepted the Hello; only then does the worker count
# the link as up (a refused connect opens a call too, and must not reset its owner's orphan clock)
LINK_ACCEPTED_HEADER = "kvserve-link-accepted"
_LINK_DOMAIN = b"kvserve WorkerLink incarnation v1\0"
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


def new_link_nonce() -> str:
    """A fresh one-time nonce for one incarnation of a worker (128 bits, hex)."""
    return secrets.token_hex(16)


def link_proof(credential: str, incarnation: str, nonce: str) -> str:
    """The proof a worker process sends beside its Hello: its credential's MAC over its incarnation
    and the nonce the router gave that incarnation (hex)."""
    msg = _LINK_DOMAIN + incarnation.encode() + b"\0" + nonce.encode()
    return hmac.new(credential.encode(), msg, hashlib.sha256).hexdigest()


def verify_link_proof(credential: str, incarnation: str, nonce: str, proof: str | bytes | None) -> bool:
    """Whether ``proof`` is ``link_proof(credential, incarnation, nonce)`` (constant-time)."""
    if isinstance(proof, str):
        proof = proof.encode("latin-1", "replace")
    if not proof:
        return False
    return hmac.compare_digest(proof, link_proof(credential, incarnation, nonce).encode())


# ---- data links (docs/architecture.md section 2a) --------------------------------------------------
# A worker streams an owned request's outputs to its owner (a frontend) over a data link: the WorkerLink
# service, served by the frontend. The worker proves it is one of this cluster's workers with a *data
# credential*, ``issue_data_credential(frontend key, worker_id)``, which the launcher issues (the worker
# never holds the frontend key) and the frontend verifies with the key it has. A different key from the
# router's worker key: a data credential opens no WorkerLink at the router, and a frontend cannot pose as
# a worker there.
DATA_LINK_PREFIX = "data:"


def _data_key(frontend_key: str) -> str:
    # NOTE: the frontend key may be any string (``$KVSERVE_FRONTEND_KEY``); the MAC takes a hex key.
    return hashlib.sha256(b"kvserve data link v1\0" + frontend_key.encode()).hexdigest()


def issue_data_credential(frontend_key: str, worker_id: str) -> str:
    """The credential ``worker_id`` dials its owners' data links with."""
    return issue_worker_credential(_data_key(frontend_key), DATA_LINK_PREFIX + worker_id)


def verify_data_credential(frontend_key: str, credential: str | bytes | None) -> str | None:
    """The worker id a data credential proves (None: missing, malformed or forged)."""
    proved = verify_worker_credential(_data_key(frontend_key), credential)
    if proved is None or not proved.startswith(DATA_LINK_PREFIX):
        return None
    return proved.removeprefix(DATA_LINK_PREFIX)
