"""API keys that carry a principal (``--auth-keys FILE``; README "Security").

The key file (YAML or JSON) lists keys by their SHA-256, never in the clear::

    keys:
      - sha256: 9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08
        tenant: team-a            # [A-Za-z0-9._-]{1,64}
        max_priority: 5           # optional, default 0
        requests_per_minute: 600  # optional, default unlimited
        tokens_per_minute: 200000 # optional: prompt + max_tokens of the requests admitted
        admin: true               # optional, default false: may call the Admin service (drain, rollout)

A caller presents its key as ``authorization: Bearer <key>`` (gRPC and HTTP alike). Its key's
tenant then decides, whatever the request says:

- the prefix-cache salt (the request's own ``tenant``/``user`` is replaced), so ``cached_tokens``
  and time-to-first-token only ever reflect the caller's own tenant's prefixes;
- the request-id namespace: ids are scoped to the tenant (``<tenant>:<id>`` inside the router,
  given back unscoped), so ``ALREADY_EXISTS`` and ``Abort`` reach only the tenant's own requests;
- the highest ``priority`` it may ask for: more is INVALID_ARGUMENT (refused, not clamped: a
  client that asks for more than it may has a bug or an intent it should hear about);
- its rate: beyond ``requests_per_minute`` or ``tokens_per_minute`` (token buckets refilled
  continuously) RESOURCE_EXHAUSTED with a ``retry-after-ms`` trailer (HTTP 429 + Retry-After).

Without a key file the single ``--auth-token`` (or none) is the simple mode: no tenancy.

With both, the ``--auth-token`` bearer is the operator's credential, with a defined scope (issue 42):
the Admin service (drain, rollout) as an admin key, and on the client API a tenant of its own,
``OPERATOR_TENANT`` (no key file can name it: ``:`` is not a tenant character), so it can neither
abort, probe (ALREADY_EXISTS) nor share the prefix cache of any key's requests. It has no rate
limits and any priority.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import re
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from kvserve.protos.kvserve.v1 import serving_pb2 as spb
from kvserve.router.requests.request import RouterError

_TENANT = re.compile(r"[A-Za-z0-9._-]{1,64}")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_KEY_FIELDS = {"sha256", "tenant", "max_priority", "requests_per_minute", "tokens_per_minute", "admin"}
SCOPE_SEPARATOR = ":"
OPERATOR_TENANT = "kvserve:operator"  # NOTE: ":" keeps it out of every key file's tenants
_OPERATOR_KEY_ID = "operator"


@dataclass(frozen=True)
class ApiKey:
    """What one key allows (see the module docstring)."""

    tenant: str
    max_priority: int = 0
    requests_per_minute: float | None = None
    tokens_per_minute: float | None = None
    admin: bool = False  # may call the operator actions (kvserve.v1.Admin: drain, rollout)


def hash_key(key: str) -> str:
    """The SHA-256 (hex) a key file lists for ``key``."""
    return hashlib.sha256(key.encode()).hexdigest()


class KeyRing:
    """The keys of a key file, by SHA-256."""

    def __init__(self, keys: dict[str, ApiKey]) -> None:
        self._keys = dict(keys)

    @classmethod
    def load(cls, path: str | Path) -> KeyRing:
        """Raises ValueError naming the entry and field at fault (or the file)."""
        import yaml

        text = Path(path).read_text()
        try:
            data = yaml.safe_load(text) if not str(path).endswith(".json") else json.loads(text)
        except (yaml.YAMLError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: not YAML/JSON: {e}") from e
        entries = data.get("keys") if isinstance(data, dict) else None
        if not isinstance(entries, list) or not entries:
            raise ValueError(f"{path}: expected 'keys:' with at least one entry")
        keys: dict[str, ApiKey] = {}
        for i, e in enumerate(entries):
            where = f"{path}: keys[{i}]"
            if not isinstance(e, dict) or set(e) - _KEY_FIELDS:
                raise ValueError(f"{where}: a mapping of {sorted(_KEY_FIELDS)}")
            digest = str(e.get("sha256", "")).lower()
            if not _SHA256.fullmatch(digest):
                raise ValueError(f"{where}.sha256: 64 hex digits (sha256 of the key), got {e.get('sha256')!r}")
            if digest in keys:
                raise ValueError(f"{where}.sha256: listed twice")
            tenant = e.get("tenant")
            if not isinstance(tenant, str) or not _TENANT.fullmatch(tenant):
                raise ValueError(f"{where}.tenant: 1..64 characters of [A-Za-z0-9._-], got {tenant!r}")
            limits = {}
            for name in ("requests_per_minute", "tokens_per_minute"):
                v = e.get(name)
                if v is not None and (isinstance(v, bool) or not isinstance(v, int | float) or not v > 0):
                    raise ValueError(f"{where}.{name}: a positive number, got {v!r}")
                limits[name] = None if v is None else float(v)
            max_priority = e.get("max_priority", 0)
            if isinstance(max_priority, bool) or not isinstance(max_priority, int):
                raise ValueError(f"{where}.max_priority: an integer, got {max_priority!r}")
            admin = e.get("admin", False)
            if not isinstance(admin, bool):
                raise ValueError(f"{where}.admin: true or false, got {admin!r}")
            keys[digest] = ApiKey(tenant, max_priority, **limits, admin=admin)
        return cls(keys)

    def lookup(self, authorization: str | bytes | None) -> tuple[str, ApiKey] | None:
        """``(key id, ApiKey)`` for an ``authorization: Bearer <key>`` value, or None.

        NOTE: looked up by the presented key's SHA-256, so timing reveals nothing of a listed key.
        """
        if isinstance(authorization, bytes):
            authorization = authorization.decode("latin-1")
        if not authorization or not authorization.startswith("Bearer "):
            return None
        digest = hash_key(authorization.removeprefix("Bearer "))
        key = self._keys.get(digest)
        return None if key is None else (digest, key)


@dataclass
class _Bucket:
    capacity: float
    level: float
    at: float

    def take(self, amount: float, now: float) -> float:
        """Take ``amount`` and return 0.0, or take nothing and return the seconds until it fits."""
        rate = self.capacity / 60.0
        self.level = min(self.capacity, self.level + (now - self.at) * rate)
        self.at = now
        if amount <= self.level:
            self.level -= amount
            return 0.0
        if amount > self.capacity:
            return math.inf
        return (amount - self.level) / rate


@dataclass(frozen=True)
class Principal:
    """Who is calling: its key id (the key's SHA-256) and what the key allows."""

    key_id: str
    key: ApiKey

    @property
    def tenant(self) -> str:
        return self.key.tenant


OPERATOR = Principal(_OPERATOR_KEY_ID, ApiKey(OPERATOR_TENANT, max_priority=(1 << 31) - 1, admin=True))


@dataclass
class Tenancy:
    """The router-side half of API keys: who is calling, what it may do, and its ids' scope."""

    keys: KeyRing
    clock: Callable[[], float] = time.monotonic
    _requests: dict[str, _Bucket] = field(default_factory=dict)
    _tokens: dict[str, _Bucket] = field(default_factory=dict)
    operator_token: str | None = None  # ``--auth-token``: the operator's principal (module docstring)

    def principal(self, authorization: str | bytes | None) -> Principal | None:
        """The caller's principal: an API key's, the operator's (the ``--auth-token`` bearer), or None."""
        if self.operator_token and authorization:
            got = authorization.encode("latin-1", "replace") if isinstance(authorization, str) else authorization
            # NOTE: constant-time, as every token compare (kvserve/router/gate/auth.py)
            if hmac.compare_digest(got, f"Bearer {self.operator_token}".encode()):
                return OPERATOR
        found = self.keys.lookup(authorization)
        return None if found is None else Principal(*found)

    def scope(self, who: Principal, request: spb.GenerateRequest) -> spb.GenerateRequest:
        """The request as the router sees it: the key's tenant, an id in the tenant's namespace.

        Raises:
            RouterError: INVALID_ARGUMENT, a priority above the key's ``max_priority``.
        """
        if request.priority > who.key.max_priority:
            raise RouterError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"priority: {request.priority} is above this key's max_priority {who.key.max_priority}",
            )
        out = spb.GenerateRequest()
        out.CopyFrom(request)
        out.tenant = who.tenant
        # NOTE: an id the router would assign is assigned here, so that it is scoped too (the
        # tenant can Abort it by the unscoped id its stream reports).
        out.request_id = self.scoped_id(who, out.request_id or f"req-{uuid.uuid4().hex[:12]}")
        return out

    def scoped_id(self, who: Principal, request_id: str) -> str:
        return f"{who.tenant}{SCOPE_SEPARATOR}{request_id}"

    def unscoped_id(self, who: Principal, request_id: str) -> str:
        """The id as its tenant knows it (router-assigned ids carry no scope)."""
        return request_id.removeprefix(f"{who.tenant}{SCOPE_SEPARATOR}")

    def charge(
        self,
        who: Principal,
        requests: Sequence[spb.GenerateRequest],
        default_max_tokens: int,
        budgets: Sequence[str] = ("requests_per_minute", "tokens_per_minute"),
    ) -> Callable[[], None]:
        """Take the requests (and their prompt + max_tokens) from the key's per-minute budgets;
        returns what gives them back (for requests the router then refused).

        ``budgets`` picks which: ``requests_per_minute`` needs no prompt ids, so it is charged
        before any work on the requests (kvserve/router/gate/bounds.py: a key's rate bounds how
        many of its prompts get tokenized, issue 42); ``tokens_per_minute`` once they are ids.

        Raises:
            RouterError: RESOURCE_EXHAUSTED with ``retry-after-ms`` when a budget is short (then
                nothing is taken).
        """
        k, now = who.key, self.clock()
        waits = []
        if k.requests_per_minute is not None and "requests_per_minute" in budgets:
            bucket = self._requests.setdefault(who.key_id, _Bucket(k.requests_per_minute, k.requests_per_minute, now))
            waits.append(("requests_per_minute", bucket, len(requests)))
        if k.tokens_per_minute is not None and "tokens_per_minute" in budgets:
            tokens = sum(
                len(r.token_ids.ids) + (r.sampling.max_tokens or default_max_tokens) for r in requests
            )  # NOTE: prompts are token ids by now (kvserve/router/gate/bounds.py had them tokenized)
            bucket = self._tokens.setdefault(who.key_id, _Bucket(k.tokens_per_minute, k.tokens_per_minute, now))
            waits.append(("tokens_per_minute", bucket, tokens))
        for i, (name, bucket, amount) in enumerate(waits):
            wait = bucket.take(amount, now)
            if wait:
                for _, taken, back in waits[:i]:  # NOTE: all or nothing
                    taken.level += back
                if math.isinf(wait):  # NOTE: no wait makes it fit: the caller must ask for less
                    raise RouterError(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        f"{amount} is more than this key's {name} ({bucket.capacity:g}) allows at once",
                    )
                retry_ms = max(1, math.ceil(wait * 1000))
                raise RouterError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"rate limit: this key's {name} ({bucket.capacity:g}) is spent; retry in {retry_ms} ms",
                    (("retry-after-ms", str(retry_ms)),),
                )

        def refund() -> None:
            for _, bucket, amount in waits:
                bucket.level = min(bucket.capacity, bucket.level + amount)

        return refund
