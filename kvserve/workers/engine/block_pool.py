"""BlockPool: the only owner of the KV block free list, ref counts and prefix-cache hashes.

Mechanism only: the pool allocates, frees, counts and remembers hashes; the scheduler decides who
gets blocks. Contracts, as in vLLM v1's block_pool.py:

Invariants (``check_integrity``):
  * every block is in exactly one state: used (ref_cnt > 0), cached-evictable (ref_cnt == 0 and
    hashed) or free (ref_cnt == 0, no hash); free + used + cached_evictable == total;
  * the free queue holds exactly the blocks with ref_cnt == 0, each once, least recently freed first;
  * ``_cached[h] == b`` iff block b carries hash h;
  * ref counts equal the number of block tables referencing each block (when tables are given).

Eviction is LRU over ref_cnt == 0 blocks: ``allocate`` takes from the head of the free queue and a
cached block taken there loses its hash (a ``BlockRemoved`` event). ``free`` appends to the tail, so
callers pass a request's blocks tail-first: the end of a sequence is evicted before its prefix,
which more requests share.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvserve.workers.core.kv_events import AllBlocksCleared, BlockEvent, BlockRemoved, BlockStored
from kvserve.workers.core.sizes import pool_usage


@dataclass(frozen=True)
class PoolStats:
    total: int
    free: int
    used: int
    cached_evictable: int

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (cached-evictable blocks count as available)."""
        return pool_usage(self.used, self.total)


class BlockPool:
    """Fixed-size KV blocks with ref counts, prefix-cache hashes and LRU eviction.

    Args:
        num_blocks: blocks in the device pool (ids ``0 .. num_blocks-1``).
        enable_caching: keep hashes of freed full blocks for prefix hits.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        # NOTE: OrderedDict gives O(1) removal from the middle (a cached block revived by a prefix
        # hit) and O(1) pop from the head (LRU eviction).
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._cached: dict[int, int] = {}
        self._num_used = 0
        self._num_evictable = 0  # ref_cnt == 0 and hashed
        self._event_seq = 0
        self._events: list[BlockEvent] = []
        self.record_events = True
        # The tiered cache (docs/architecture.md §3a) copies evicted blocks out before they are reused.
        self.record_evictions = False
        self._evicted: list[tuple[int, int]] = []

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks allocatable now: free plus cached-evictable."""
        return len(self._free)

    def stats(self) -> PoolStats:
        return PoolStats(
            total=self.num_blocks,
            free=len(self._free) - self._num_evictable,
            used=self._num_used,
            cached_evictable=self._num_evictable,
        )

    def cached_block(self, block_hash: int) -> int | None:
        """The block holding ``block_hash``, or None."""
        return self._cached.get(block_hash)

    def find_prefix(self, block_hashes: Sequence[int]) -> list[int]:
        """Block ids of the longest cached prefix of a hash chain (not touched; see ``touch``)."""
        hits: list[int] = []
        if not self.enable_caching:
            return hits
        for h in block_hashes:
            b = self._cached.get(h)
            if b is None:
                break
            hits.append(b)
        return hits

    def cached_hashes(self) -> list[int]:
        """Every hash the pool can serve a hit for: the snapshot a router resyncs from."""
        return list(self._cached)

    # ---- mutation ------------------------------------------------------------------------
    def touch(self, block_ids: Iterable[int]) -> None:
        """Take a reference on blocks found by ``find_prefix`` (revives cached-evictable ones)."""
        for b in block_ids:
            if self.ref_cnt[b] == 0:
                del self._free[b]
                self._num_used += 1
                if self.block_hash[b] is not None:
                    self._num_evictable -= 1
            self.ref_cnt[b] += 1

    def allocate(self, n: int) -> list[int] | None:
        """``n`` fresh blocks with ref_cnt 1, evicting LRU cached blocks; None if fewer are available."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > len(self._free):
            return None
        out: list[int] = []
        evicted: list[int] = []
        for _ in range(n):
            b, _ = self._free.popitem(last=False)
            h = self.block_hash[b]
            if h is not None:
                self.block_hash[b] = None
                del self._cached[h]
                self._num_evictable -= 1
                evicted.append(h)
                if self.record_evictions:
                    self._evicted.append((b, h))
            self.ref_cnt[b] = 1
            out.append(b)
        self._num_used += n
        if evicted:
            self._emit(BlockRemoved, tuple(evicted))
        return out

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference per block; at zero the block joins the free queue's tail, in order."""
        for b in block_ids:
            if self.ref_cnt[b] <= 0:
                raise ValueError(f"double free of block {b}")
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] == 0:
                self._free[b] = None
                self._num_used -= 1
                if self.block_hash[b] is not None:
                    self._num_evictable += 1

    def cache_block(self, block_id: int, block_hash: int) -> bool:
        """Register a used, full block's hash for prefix hits. Returns False if not registered.

        A hash already held by another block (the same content computed twice, e.g. two requests
        admitted before either was cached) is not registered again: the duplicate stays private
        and is plainly freed later.
        """
        if not self.enable_caching:
            return False
        if self.ref_cnt[block_id] <= 0:
            raise ValueError(f"cannot cache unreferenced block {block_id}")
        if self.block_hash[block_id] is not None or block_hash in self._cached:
            return False
        self.block_hash[block_id] = block_hash
        self._cached[block_hash] = block_id
        self._emit(BlockStored, (block_hash,))
        return True

    def reset_prefix_cache(self) -> bool:
        """Forget every hash; only when no block is in use (else False: a hit may be in flight)."""
        if self._num_used:
            return False
        for b in self._cached.values():
            self.block_hash[b] = None
        self._cached.clear()
        self._num_evictable = 0
        self._event_seq += 1
        if self.record_events:
            self._events.append(AllBlocksCleared(self._event_seq))
        return True

    def drain_evicted(self) -> list[tuple[int, int]]:
        """(block id, hash) of every cached block ``allocate`` evicted since the last drain (only while
        ``record_evictions``). The blocks still hold their KV until the caller lets anything write them."""
        evicted, self._evicted = self._evicted, []
        return evicted

    # ---- events --------------------------------------------------------------------------
    def _emit(
        self, kind: type[BlockStored] | type[BlockRemoved], hashes: tuple[int, ...], tier: str = "device"
    ) -> None:
        self._event_seq += 1
        if self.record_events:
            self._events.append(kind(self._event_seq, hashes, tier))

    def emit_tier_event(self, kind: type[BlockStored] | type[BlockRemoved], hashes: tuple[int, ...], tier: str) -> None:
        """An event of a host or disk tier, numbered in this pool's sequence: one ordered stream per worker."""
        if hashes:
            self._emit(kind, hashes, tier)

    @property
    def event_seq(self) -> int:
        """Sequence number of the latest event (0 before any)."""
        return self._event_seq

    def drain_events(self) -> list[BlockEvent]:
        """Events since the last drain, oldest first; consecutive ``seq`` numbers."""
        events, self._events = self._events, []
        return events

    # ---- checks --------------------------------------------------------------------------
    def check_integrity(self, block_tables: Iterable[Sequence[int]] | None = None) -> None:
        """Raise AssertionError if any invariant in the module docstring is broken."""
        assert len(self._free) == sum(1 for r in self.ref_cnt if r == 0), "free queue != ref_cnt==0 blocks"
        assert all(self.ref_cnt[b] == 0 for b in self._free), "referenced block in free queue"
        assert all(r >= 0 for r in self.ref_cnt), "negative ref count"
        assert self._num_used == sum(1 for r in self.ref_cnt if r > 0), "used count drift"
        evictable = sum(1 for b in self._free if self.block_hash[b] is not None)
        assert self._num_evictable == evictable, "evictable count drift"
        for h, b in self._cached.items():
            assert self.block_hash[b] == h, f"hash map disagrees for block {b}"
        assert sum(1 for h in self.block_hash if h is not None) == len(self._cached), "stray block hash"
        s = self.stats()
        assert s.free + s.used + s.cached_evictable == s.total, f"accounting broken: {s}"
        assert min(s.free, s.used, s.cached_evictable) >= 0, f"negative count: {s}"
        if block_tables is not None:
            refs = [0] * self.num_blocks
            for table in block_tables:
                for b in table:
                    refs[b] += 1
            assert refs == self.ref_cnt, "ref counts differ from block-table references"
