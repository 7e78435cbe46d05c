"""Copies paused for a migration that a restarted router finds in the workers' ``RequestTable``s.

A migration exports a request from its source (paused there, its blocks kept), imports it into the
destination, then frees the source's copy (``finish_export``). A router that dies between the import and
that last call leaves two copies: the destination's running, the source's paused for ever, its blocks held.
The next router sees the paused one flagged ``exporting`` in the source's table and:

* frees it (``finish_export(migrated=True)``) once a running copy of the same dispatch is adopted elsewhere,
  whichever table came first, and at once when it has no owner (a router-owned request: its client's stream
  ended with the router that paused it);
* adopts it and resumes it where it is (``finish_export(migrated=False)``) when no running copy turned up
  within ``settle_s`` (the router died before the import landed), so the request goes on; one that cannot
  be adopted (its request known otherwise by now) is freed instead.

A copy of an export this router started itself is not its business (``kvserve/router/requests/migrations.py``
ends it).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from kvserve.protos.kvserve.v1 import worker_pb2 as pb

logger = logging.getLogger(__name__)

# NOTE: workers reconnect within ~2 s of a router restart (issue 41); a destination's table comes by then
SETTLE_S = 5.0


class ExportedCopies:
    """Paused copies waiting for their destination's table, by dispatch id.

    Args:
        finish_export: ``(worker_id, dispatch id, migrated)``: free (True) or resume (False) that copy.
        adopt: ``(worker_id, entry)``: take over a copy about to be resumed as any adopted request; False: not
            taken (then the copy is freed).
        settle_s: how long a paused copy waits for a running one before it resumes where it is.
    """

    def __init__(self, finish_export: Callable[[str, str, bool], None], adopt: Callable[[str, pb.OwnedRequest], bool],
                 settle_s: float = SETTLE_S) -> None:  # fmt: skip
        self._finish_export = finish_export
        self._adopt = adopt
        self.settle_s = settle_s
        self._pending: dict[str, tuple[str, pb.OwnedRequest, asyncio.TimerHandle | None]] = {}

    def paused(self, worker_id: str, entry: pb.OwnedRequest, running_elsewhere: bool) -> None:
        """``worker_id``'s table lists ``entry`` paused; ``running_elsewhere``: this router already has the
        same dispatch running on another worker."""
        rid = entry.request_id
        if running_elsewhere or not entry.owner_key:
            # NOTE: no owner: a router-owned request; its client's stream ended with the router that paused it,
            # so nobody reads any copy of it (a running one is stopped as a stray)
            why = "a migration that landed elsewhere" if running_elsewhere else "a previous router, no owner"
            logger.info("freeing %s on %s: paused by %s", rid, worker_id, why)
            self._finish_export(worker_id, rid, True)
            return
        if rid in self._pending:  # NOTE: the same table again (a reconnect): its timer runs already
            return
        try:
            timer = asyncio.get_running_loop().call_later(self.settle_s, self.settle, rid)
        except RuntimeError:  # NOTE: no loop (a unit test driving the router by hand): ``settle`` by hand
            timer = None
        self._pending[rid] = (worker_id, entry, timer)

    def running(self, worker_id: str, rid: str) -> None:
        """A running copy of dispatch ``rid`` was adopted on ``worker_id``: a paused one elsewhere is freed."""
        pending = self._pending.pop(rid, None)
        if pending is None:
            return
        source, _, timer = pending
        if timer is not None:
            timer.cancel()
        if source != worker_id:
            logger.info("freeing %s on %s: its migration landed on %s", rid, source, worker_id)
            self._finish_export(source, rid, True)

    def settle(self, rid: str) -> None:
        """No running copy of ``rid`` came: resume the paused one where it is and adopt it."""
        pending = self._pending.pop(rid, None)
        if pending is None:
            return
        source, entry, _ = pending
        adopted = self._adopt(source, entry)
        logger.info("%s %s on %s: its migration never landed", "resuming" if adopted else "freeing (not adoptable)",
                    rid, source)  # fmt: skip
        self._finish_export(source, rid, not adopted)

    def __len__(self) -> int:
        return len(self._pending)
