"""The router's view of which block hashes each worker holds, fed by the workers' block events.

Pure Python: the router translates WorkerLink ``BlockEvent`` / ``BlockSnapshot`` protos into the
dataclasses of ``workers.kv_events`` (the
same ones the worker's BlockPool emits).

Per worker, events carry a sequence number that starts at 1 (0 = "no event yet", an empty pool)
and grows by one per event. ``apply`` folds events in order:

* ``seq <= last applied``: a resend; ignored.
* ``seq == last applied + 1``: applied.
* ``seq > last applied + 1``: a gap. The index can no longer trust its entries for that worker,
  so it drops them (``overlap`` answers 0) and marks the worker ``needs_resync`` until
  ``load_snapshot`` brings the full hash set and the seq it reflects; events before that are
  ignored. A worker seen for the first time starts empty at seq 0, so a router that joins a
  worker mid-life sees a gap at once and resyncs.

Set semantics (the emitters' contract): after ``stored(h)`` hash h is in the worker's pool,
after ``removed(h)`` it is not; storing a present hash or removing an absent one is a no-op.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from workers.kv_events import AllBlocksCleared, BlockEvent, BlockRemoved, BlockStored

__all__ = ["AllBlocksCleared", "BlockEvent", "BlockRemoved", "BlockStored", "PrefixIndex"]




@dataclass
class _WorkerIndex:
    last_seq: int = 0
    needs_resync: bool = False
    hashes: set[int] = field(default_factory=set)


class PrefixIndex:
    """Per-worker sets of cached block hashes, kept in step with each worker's event stream."""

    def __init__(self) -> None:
        self._workers: dict[str, _WorkerIndex] = {}

    def apply(self, worker_id: str, events: Iterable[BlockEvent]) -> bool:
        """Fold a batch of ``worker_id``'s events, in order (see the module doc for seq rules).

        Returns:
            True if this call found a gap, i.e. the worker just entered ``needs_resync``: ask it
            for a snapshot (once; while it stays in resync later calls return False).

        Raises:
            TypeError: an event of an unknown type.
        """
        index = self._workers.setdefault(worker_id, _WorkerIndex())
        found_gap = False
        for event in events:
            if not isinstance(event, BlockStored | BlockRemoved | AllBlocksCleared):
                raise TypeError(f"not a block event: {event!r}")
            if index.needs_resync or event.seq <= index.last_seq:
                continue
            if event.seq > index.last_seq + 1:
                index.needs_resync = True
                index.hashes.clear()
                found_gap = True
                continue
            index.last_seq = event.seq
            if isinstance(event, BlockStored):
                index.hashes.update(event.hashes)
            elif isinstance(event, BlockRemoved):
                index.hashes.difference_update(event.hashes)
            else:
                index.hashes.clear()
        return found_gap

    def load_snapshot(self, worker_id: str, seq: int, hashes: Iterable[int]) -> bool:
        """Replace ``worker_id``'s hash set with a snapshot taken as of event ``seq``.

        Later events continue from ``seq + 1``. While the worker is in sync, a snapshot older
        than the last applied event is stale and ignored; in resync any snapshot is taken (a
        later gap would trigger another resync).

        Returns:
            True if the snapshot was loaded.
        """
        index = self._workers.setdefault(worker_id, _WorkerIndex())
        if not index.needs_resync and seq < index.last_seq:
            return False
        index.last_seq = seq
        index.needs_resync = False
        index.hashes = set(hashes)
        return True

    def needs_resync(self, worker_id: str) -> bool:
        """Whether ``worker_id``'s entries were dropped after a gap and await a snapshot."""
        index = self._workers.get(worker_id)
        return index is not None and index.needs_resync

    def mark_resync(self, worker_id: str) -> None:
        """Drop ``worker_id``'s entries and await a snapshot (e.g. after its stream reconnects)."""
        index = self._workers.setdefault(worker_id, _WorkerIndex())
        index.needs_resync = True
        index.hashes.clear()

    def overlap(self, worker_id: str, hashes: Sequence[int]) -> int:
        """Number of leading ``hashes`` (consecutive from the first) present on ``worker_id``.

        0 for an unknown worker or one awaiting resync.
        """
        index = self._workers.get(worker_id)
        if index is None:
            return 0
        present = index.hashes
        count = 0
        for h in hashes:
            if h not in present:
                break
            count += 1
        return count

    def overlaps(self, hashes: Sequence[int]) -> dict[str, int]:
        """``overlap`` for every known worker."""
        return {worker_id: self.overlap(worker_id, hashes) for worker_id in self._workers}

    def last_seq(self, worker_id: str) -> int:
        """Seq of the last event (or snapshot) applied for ``worker_id``; 0 if unknown."""
        index = self._workers.get(worker_id)
        return 0 if index is None else index.last_seq

    def num_hashes(self, worker_id: str) -> int:
        """How many hashes the index holds for ``worker_id``."""
        index = self._workers.get(worker_id)
        return 0 if index is None else len(index.hashes)

    def hashes(self, worker_id: str) -> frozenset[int]:
        """A copy of ``worker_id``'s hash set (empty if unknown)."""
        index = self._workers.get(worker_id)
        return frozenset() if index is None else frozenset(index.hashes)

    def workers(self) -> list[str]:
        """Known worker ids, sorted."""
        return sorted(self._workers)

    def remove_worker(self, worker_id: str) -> None:
        """Forget ``worker_id`` entirely (a no-op if unknown); it restarts at seq 0 if seen again."""
        self._workers.pop(worker_id, None)
