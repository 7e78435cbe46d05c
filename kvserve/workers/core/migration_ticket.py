"""What the router holds of a request a worker exported for a live migration (docs/architecture.md section 2).

The exported ``MigrationState`` (kvserve/workers/engine/migration.py) carries the request's KV blocks as torch
tensors: megabytes to hundreds of megabytes. The source worker puts it into Ray's object store and hands the
router only a ``MigrationTicket``: its size and the object's reference. The router passes that reference to the
destination's ``import_request`` as the call's argument, so Ray moves the state from the source's store to the
destination and the router never holds, deserializes or re-serializes the KV. Before, it did both on its event
loop, and the first migration imported torch into the router (~180 MB of RSS and seconds of a stalled loop on a
busy 2-core box).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class MigrationTicket:
    """An exported request, as the router sees it.

    Attributes:
        num_tokens: the tokens the exported state covers (prompt + output): what its KV blocks hold.
        state: the ``ray.ObjectRef`` of the ``MigrationState``, owned by the source worker (its death before
            the destination fetched it fails the import with one of Ray's ``ObjectLostError``s).
    """

    num_tokens: int
    state: Any


def object_lost(e: BaseException) -> bool:
    """The Ray error says an object an actor call needed is gone (its owner died, it was freed): for a
    migration, the source's failure, never the destination's (Ray's classes by name, as ``actor_dead``)."""
    return any(c.__name__ == "ObjectLostError" for c in type(e).__mro__)
