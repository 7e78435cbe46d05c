"""The router's view of which block hashes each worker holds, fed by the workers' block events.

Pure Python: the router translates WorkerLink ``BlockEvent`` / ``BlockSnapshot`` protos into the
dataclasses of ``workers.core.kv_events`` (the
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

Pending prefixes: a worker announces a block only after computing it, so same-prefix requests that
arrive while the first is still in prefill would be placed by load alone and the prefix would be
computed (and cached) on several workers. The router records each placement with
``add_pending(worker, request_id, hashes)`` and forgets it with ``drop_pending(request_id)`` when
the request ends or moves; ``affinity`` counts leading hashes that are cached *or* pending on a
worker (placement's prefix lookup), while ``overlap`` stays "cached now" (what the worker can hit
at once, e.g. for the blocks a placement promises). Pending entries survive gaps and resyncs (the
router knows them itself) and go with ``remove_worker``.

Tiers (docs/architecture.md §3a): events and snapshots name a tier. Device events describe the
worker's own pool (the sets above). Host and disk tiers belong to the worker's *node* (``set_node``;
a worker with no node id is a node of its own), shared by every worker there: any of them may
report a block another one stored, and a hit there is available to all of them. ``affinity``
reports, after a worker's own match, the run of following blocks its node's host tier holds, then
the disk tier (``PrefixMatch.host`` / ``.disk``). A gap drops the worker's device set only; the
node's tier sets are replaced by the next snapshot that carries them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from kvserve.router.policy.placement.views import PrefixMatch
from kvserve.workers.core.kv_events import AllBlocksCleared, BlockEvent, BlockRemoved, BlockStored

__all__ = ["AllBlocksCleared", "BlockEvent", "BlockRemoved", "BlockStored", "PrefixIndex", "PrefixMatch"]


@dataclass
class _WorkerIndex:
    last_seq: int = 0
    needs_resync: bool = False
    hashes: set[int] = field(default_factory=set)
    pending: Counter[int] = field(default_factory=Counter)  # hash -> placed requests whose prompt has it


class PrefixIndex:
    """Per-worker sets of cached block hashes, kept in step with each worker's event stream."""

    def __init__(self) -> None:
        self._workers: dict[str, _WorkerIndex] = {}
        self._pending: dict[str, tuple[str, tuple[int, ...]]] = {}  # request_id -> (worker_id, hashes)
        self._tiers: dict[tuple[str, str], set[int]] = {}  # (node, "host" | "disk") -> hashes there
        # NOTE: kept across remove_worker: a worker that comes back runs on the same node.
        self._nodes: dict[str, str] = {}  # worker_id -> node_id

    def set_node(self, worker_id: str, node_id: str) -> None:
        """Say which node ``worker_id`` runs on ("" = unknown: the worker is a node of its own)."""
        self._nodes[worker_id] = node_id

    def _node(self, worker_id: str) -> str:
        return self._nodes.get(worker_id) or f"worker:{worker_id}"

    def apply(self, worker_id: str, events: Iterable[BlockEvent]) -> bool:
        """Fold a batch of ``worker_id``'s events, in order (see the module doc for seq rules).

        Returns:
            True if this call found a gap, i.e. the worker just entered ``needs_resync``: ask it
            for a snapshot (once; while it stays in resync later calls return False).

        Raises:
            TypeError: an event of an unknown type.
        """
        index = self._index(worker_id)
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
            if isinstance(event, BlockStored | BlockRemoved) and event.tier != "device":
                held = self._tiers.setdefault((self._node(worker_id), event.tier), set())
                if isinstance(event, BlockStored):
                    held.update(event.hashes)
                else:
                    held.difference_update(event.hashes)
            elif isinstance(event, BlockStored):
                index.hashes.update(event.hashes)
            elif isinstance(event, BlockRemoved):
                index.hashes.difference_update(event.hashes)
            else:
                index.hashes.clear()
        return found_gap

    def load_snapshot(
        self, worker_id: str, seq: int, hashes: Iterable[int], tiers: Mapping[str, Iterable[int]] | None = None
    ) -> bool:
        """Replace ``worker_id``'s hash set with a snapshot taken as of event ``seq``; ``tiers`` (tier ->
        hashes) replace its node's host/disk sets (a tier left out keeps its set).

        Later events continue from ``seq + 1``. While the worker is in sync, a snapshot older
        than the last applied event is stale and ignored; in resync any snapshot is taken (a
        later gap would trigger another resync).

        Returns:
            True if the snapshot was loaded.
        """
        index = self._index(worker_id)
        if not index.needs_resync and seq < index.last_seq:
            return False
        index.last_seq = seq
        index.needs_resync = False
        index.hashes = set(hashes)
        for tier, held in (tiers or {}).items():
            self._tiers[(self._node(worker_id), tier)] = set(held)
        return True

    def tier_hashes(self, worker_id: str, tier: str) -> frozenset[int]:
        """A copy of the ``tier`` set of ``worker_id``'s node (empty if unknown)."""
        return frozenset(self._tiers.get((self._node(worker_id), tier), ()))

    def _tier_runs(self, worker_id: str, hashes: Sequence[int]) -> tuple[int, int]:
        """Leading blocks of ``hashes`` in the node's host tier, then the following ones in its disk tier."""
        node = self._node(worker_id)
        runs = []
        start = 0
        for tier in ("host", "disk"):
            held = self._tiers.get((node, tier), ())
            n = 0
            while start + n < len(hashes) and hashes[start + n] in held:
                n += 1
            runs.append(n)
            start += n
        return runs[0], runs[1]

    def needs_resync(self, worker_id: str) -> bool:
        """Whether ``worker_id``'s entries were dropped after a gap and await a snapshot."""
        index = self._workers.get(worker_id)
        return index is not None and index.needs_resync

    def mark_resync(self, worker_id: str) -> None:
        """Drop ``worker_id``'s entries and await a snapshot (e.g. after its stream reconnects)."""
        index = self._index(worker_id)
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

    def _index(self, worker_id: str) -> _WorkerIndex:
        """``worker_id``'s index, made on first use (NOTE: not ``setdefault``, which would build a throwaway
        index with its counters on every call: per placed request, on the router's loop)."""
        index = self._workers.get(worker_id)
        if index is None:
            index = self._workers[worker_id] = _WorkerIndex()
        return index

    def add_pending(self, worker_id: str, request_id: str, hashes: Sequence[int]) -> None:
        """Record that ``request_id``, whose prompt has block ``hashes``, was placed on ``worker_id``.

        Raises:
            ValueError: ``request_id`` is already pending (drop it first when it moves).
        """
        if request_id in self._pending:
            raise ValueError(f"request {request_id!r} is already pending on {self._pending[request_id][0]}")
        chain = tuple(hashes)
        self._pending[request_id] = (worker_id, chain)
        self._index(worker_id).pending.update(chain)

    def drop_pending(self, request_id: str) -> bool:
        """Forget ``request_id``'s pending placement (it ended, failed or moves). False if unknown."""
        entry = self._pending.pop(request_id, None)
        if entry is None:
            return False
        worker_id, chain = entry
        index = self._workers.get(worker_id)
        if index is not None:
            index.pending.subtract(chain)
            for h in chain:
                if index.pending[h] <= 0:
                    del index.pending[h]
        return True

    def num_pending(self, worker_id: str | None = None) -> int:
        """Pending requests on ``worker_id`` (all workers if None)."""
        return sum(1 for w, _ in self._pending.values() if worker_id is None or w == worker_id)

    def affinity(self, worker_id: str, hashes: Sequence[int]) -> PrefixMatch:
        """Number of leading ``hashes`` cached on ``worker_id`` or pending there (see the module doc).

        Placement's prefix lookup: where a prefix is, or is about to be. 0 for an unknown worker.
        The answer's ``cached`` counts the leading blocks cached now, its ``idle`` those of them with no
        pending placement on that worker holding them (a request placed there would reuse them out of
        the evictable pool).
        NOTE: "idle" is the router's view: a pending request still queued inside the worker holds no
        ref yet, so its blocks are counted busy (the room estimate errs towards the worker's own
        queueing, as before this rule).
        """
        index = self._workers.get(worker_id)
        if index is None:
            host, disk = self._tier_runs(worker_id, hashes) if self._tiers else (0, 0)
            return PrefixMatch(0, 0, 0, host, disk)
        present, pending = index.hashes, index.pending
        count = cached = idle = 0
        for h in hashes:
            is_cached = h in present
            held = h in pending
            if not is_cached and not held:
                break
            if is_cached and cached == count:  # still in the leading run of cached blocks
                cached += 1
                idle += not held
            count += 1
        host, disk = self._tier_runs(worker_id, hashes[count:]) if self._tiers else (0, 0)
        return PrefixMatch(count, cached, idle, host, disk)

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
        """Forget ``worker_id`` entirely, its pending placements too (a no-op if unknown); it restarts at
        seq 0 if seen again."""
        self._workers.pop(worker_id, None)
        nodes = {self._node(w) for w in self._workers}
        for key in [k for k in self._tiers if k[0] not in nodes]:  # no worker left on that node
            del self._tiers[key]
        for request_id in [r for r, (w, _) in self._pending.items() if w == worker_id]:
            del self._pending[request_id]
