"""BlockPool: a model-based state machine (exact block ids, LRU order, events) plus plain contracts."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvserve.workers.core.block_hash import ROOT_HASH, hash_block
from kvserve.workers.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from kvserve.workers.engine.block_pool import BlockPool, PoolStats

NUM_BLOCKS = 6


@dataclass
class Seq:
    """A sequence as the scheduler sees it: its block table and the content hash of each block."""

    table: list[int]
    hashes: list[int]  # hashes[i] = chain hash of block i's content (once full)
    num_cached: int = 0  # leading blocks already offered to cache_block


@dataclass
class Model:
    """The reference: ref counts, hashes and the exact LRU free queue."""

    ref: list[int] = field(default_factory=lambda: [0] * NUM_BLOCKS)
    block_hash: list[int | None] = field(default_factory=lambda: [None] * NUM_BLOCKS)
    cached: dict[int, int] = field(default_factory=dict)
    free_queue: list[int] = field(default_factory=lambda: list(range(NUM_BLOCKS)))
    events: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)

    def allocate(self, n: int) -> list[int] | None:
        if n > len(self.free_queue):
            return None
        out, evicted = self.free_queue[:n], []
        del self.free_queue[:n]
        for b in out:
            h = self.block_hash[b]
            if h is not None:
                evicted.append(h)
                del self.cached[h]
                self.block_hash[b] = None
            self.ref[b] = 1
        if evicted:
            self.events.append(("removed", tuple(evicted)))
        return out

    def touch(self, blocks: list[int]) -> None:
        for b in blocks:
            if self.ref[b] == 0:
                self.free_queue.remove(b)
            self.ref[b] += 1

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free_queue.append(b)

    def stats(self) -> PoolStats:
        evictable = sum(1 for b in self.free_queue if self.block_hash[b] is not None)
        return PoolStats(
            total=NUM_BLOCKS,
            free=len(self.free_queue) - evictable,
            used=sum(1 for r in self.ref if r > 0),
            cached_evictable=evictable,
        )


class BlockPoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(NUM_BLOCKS)
        self.model = Model()
        self.seqs: list[Seq] = []
        self.chains: list[list[int]] = []  # every hash chain ever used: later prompts re-use them
        self.next_content = 0
        self.last_seq = 0

    # ---- helpers --------------------------------------------------------------------------
    def _fresh_chain(self, parent: int, n: int) -> list[int]:
        chain = []
        for _ in range(n):
            self.next_content += 1
            parent = hash_block(parent, [self.next_content])
            chain.append(parent)
        return chain

    def _pick(self, i: int) -> Seq:
        return self.seqs[i % len(self.seqs)]

    def _allocate(self, n: int) -> list[int] | None:
        got = self.pool.allocate(n)
        want = self.model.allocate(n)
        assert got == want  # exact ids: LRU head first, evicting cached blocks on the way
        return got

    def _cache_next(self, seq: Seq) -> None:
        b, h = seq.table[seq.num_cached], seq.hashes[seq.num_cached]
        expected = self.model.block_hash[b] is None and h not in self.model.cached
        assert self.pool.cache_block(b, h) == expected
        if expected:
            self.model.block_hash[b] = h
            self.model.cached[h] = b
            self.model.events.append(("stored", (h,)))
        seq.num_cached += 1

    def _free(self, i: int) -> None:
        seq = self.seqs.pop(i % len(self.seqs))
        self.pool.free(reversed(seq.table))
        self.model.free(list(reversed(seq.table)))

    # ---- rules ----------------------------------------------------------------------------
    @rule(n=st.integers(0, 3))
    def allocate_new(self, n: int) -> None:
        blocks = self._allocate(n)
        if blocks is not None:
            chain = self._fresh_chain(ROOT_HASH, n)
            self.chains.append(chain)
            self.seqs.append(Seq(blocks, chain))

    @rule(over=st.integers(1, 3))
    def allocate_too_many(self, over: int) -> None:
        before = self.pool.stats()
        assert self._allocate(len(self.model.free_queue) + over) is None
        assert self.pool.stats() == before

    @rule(src=st.integers(0, 10**6), n=st.integers(0, 3))
    @precondition(lambda self: self.chains)
    def share_prefix(self, src: int, n: int) -> None:
        """Admission with the prefix cache: hit the longest cached prefix of a known chain, touch
        it, and allocate ``n`` more blocks (or, with ``n == 0``, a full hit)."""
        # Prefer a chain with something cached: those are the interesting admissions.
        candidates = [c for c in self.chains if c and c[0] in self.model.cached] or self.chains
        chain = candidates[src % len(candidates)]
        hits = self.pool.find_prefix(chain)
        want: list[int] = []
        for h in chain:
            if h not in self.model.cached:
                break
            want.append(self.model.cached[h])
        assert hits == want
        if len(self.model.free_queue) - sum(1 for b in hits if self.model.ref[b] == 0) < n:
            return  # would not fit after reviving the hits: the scheduler would not admit
        self.pool.touch(hits)
        self.model.touch(hits)
        extra = self._allocate(n)
        assert extra is not None
        rest = chain[len(hits) : len(hits) + n]
        tail = self._fresh_chain(rest[-1] if rest else (chain[len(hits) - 1] if hits else ROOT_HASH), n - len(rest))
        seq = Seq(hits + extra, chain[: len(hits)] + rest + tail, num_cached=len(hits))
        self.chains.append(seq.hashes)
        self.seqs.append(seq)

    @rule(i=st.integers(0, 10**6), n=st.integers(1, 3))
    @precondition(lambda self: self.seqs)
    def grow(self, i: int, n: int) -> None:
        seq = self._pick(i)
        blocks = self._allocate(n)
        if blocks is not None:
            seq.table += blocks
            seq.hashes += self._fresh_chain(seq.hashes[-1] if seq.hashes else ROOT_HASH, n)

    @rule(i=st.integers(0, 10**6))
    @precondition(lambda self: any(s.num_cached < len(s.table) for s in self.seqs))
    def cache_next_block(self, i: int) -> None:
        """Register the next full block of a sequence (a duplicate of cached content stays private)."""
        pending = [s for s in self.seqs if s.num_cached < len(s.table)]
        self._cache_next(pending[i % len(pending)])

    @rule(i=st.integers(0, 10**6))
    @precondition(lambda self: self.seqs)
    def finish_sequence(self, i: int) -> None:
        """A request completes: its remaining full blocks are cached, then all freed tail first."""
        seq = self.seqs[i % len(self.seqs)]
        while seq.num_cached < len(seq.table):
            self._cache_next(seq)
        self._free(i)

    @rule(i=st.integers(0, 10**6))
    @precondition(lambda self: self.seqs)
    def preempt_sequence(self, i: int) -> None:
        """Preempt (recompute) or abort: drop every block of one sequence, tail first."""
        self._free(i)

    @rule(b=st.integers(0, NUM_BLOCKS - 1))
    def free_unreferenced_raises(self, b: int) -> None:
        if self.model.ref[b] == 0:
            with pytest.raises(ValueError, match="double free"):
                self.pool.free([b])

    @rule()
    @precondition(lambda self: self.model.cached)
    def reset_prefix_cache(self) -> None:
        idle = all(r == 0 for r in self.model.ref)
        assert self.pool.reset_prefix_cache() == idle
        if idle:
            self.model.cached.clear()
            self.model.block_hash = [None] * NUM_BLOCKS
            self.model.events.append(("cleared", ()))

    # ---- invariants -----------------------------------------------------------------------
    @invariant()
    def integrity(self) -> None:
        self.pool.check_integrity([s.table for s in self.seqs])
        assert self.pool.ref_cnt == self.model.ref
        assert self.pool.block_hash == self.model.block_hash
        assert self.pool.stats() == self.model.stats()
        assert self.pool.num_free_blocks == len(self.model.free_queue)
        assert sorted(self.pool.cached_hashes()) == sorted(self.model.cached)

    @invariant()
    def events_match(self) -> None:
        events = self.pool.drain_events()
        got = []
        for e in events:
            assert e.seq == self.last_seq + 1, f"event seq gap: {e.seq} after {self.last_seq}"
            self.last_seq = e.seq
            if isinstance(e, AllBlocksCleared):
                got.append(("cleared", ()))
            else:
                got.append(("stored" if isinstance(e, BlockStored) else "removed", e.hashes))
        assert got == self.model.events
        assert self.pool.event_seq == self.last_seq
        self.model.events.clear()


BlockPoolMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestBlockPoolMachine = BlockPoolMachine.TestCase


# ---- plain contracts ------------------------------------------------------------------------


def _hashes(n: int) -> list[int]:
    out, parent = [], ROOT_HASH
    for i in range(n):
        parent = hash_block(parent, [i, i + 1])
        out.append(parent)
    return out


def test_fresh_pool_allocates_in_id_order() -> None:
    pool = BlockPool(6)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(3) == [2, 3, 4]
    assert pool.allocate(0) == []
    pool.check_integrity([[0, 1], [2, 3, 4]])


def test_lru_eviction_takes_free_blocks_first_then_tail_first() -> None:
    pool = BlockPool(6)
    seq = pool.allocate(4)
    assert seq == [0, 1, 2, 3]
    hs = _hashes(4)
    for b, h in zip(seq, hs, strict=True):
        assert pool.cache_block(b, h)
    pool.drain_events()
    pool.free(reversed(seq))  # tail first: the end of the sequence is evicted before its prefix
    assert pool.stats() == PoolStats(total=6, free=2, used=0, cached_evictable=4)
    assert pool.find_prefix(hs) == [0, 1, 2, 3]

    assert pool.allocate(2) == [4, 5]  # never-hashed blocks first: nothing evicted
    assert pool.drain_events() == []
    assert pool.allocate(1) == [3]  # then the least recently freed: the tail block
    assert [(type(e), e.hashes) for e in pool.drain_events()] == [(BlockRemoved, (hs[3],))]
    assert pool.find_prefix(hs) == [0, 1, 2]
    assert pool.allocate(2) == [2, 1]
    assert [(type(e), e.hashes) for e in pool.drain_events()] == [(BlockRemoved, (hs[2], hs[1]))]
    assert pool.find_prefix(hs) == [0]
    assert pool.cached_block(hs[0]) == 0 and pool.cached_block(hs[1]) is None
    pool.check_integrity([[4, 5], [3], [2, 1]])


def test_touch_revives_cached_block_and_refreshes_its_lru_position() -> None:
    pool = BlockPool(3)
    a = pool.allocate(3)
    hs = _hashes(3)
    for b, h in zip(a, hs, strict=True):
        pool.cache_block(b, h)
    pool.free(reversed(a))  # queue: 2, 1, 0
    pool.touch([0])  # a prefix hit revives block 0
    assert pool.stats() == PoolStats(total=3, free=0, used=1, cached_evictable=2)
    pool.free([0])  # queue: 2, 1, 0 (0 freed last again)
    pool.touch(pool.find_prefix(hs[:1]))
    assert pool.allocate(2) == [2, 1]
    assert pool.allocate(1) is None
    pool.check_integrity([[0], [2, 1]])


def test_shared_block_freed_only_at_last_reference() -> None:
    pool = BlockPool(4)
    a = pool.allocate(2)
    h = _hashes(1)[0]
    assert pool.cache_block(a[0], h)
    pool.touch(pool.find_prefix([h]))
    assert pool.ref_cnt[a[0]] == 2
    pool.free(reversed(a))
    assert pool.ref_cnt[a[0]] == 1 and pool.stats().used == 1
    pool.check_integrity([[a[0]]])
    pool.free([a[0]])
    assert pool.stats() == PoolStats(total=4, free=3, used=0, cached_evictable=1)
    pool.check_integrity([])


def test_events_have_consecutive_seq_numbers_and_exact_hashes() -> None:
    pool = BlockPool(2)
    assert pool.event_seq == 0 and pool.drain_events() == []
    hs = _hashes(3)
    a = pool.allocate(2)
    assert pool.cache_block(a[0], hs[0])
    assert pool.cache_block(a[1], hs[1])
    assert not pool.cache_block(a[1], hs[2])  # already hashed: no event
    pool.free(reversed(a))
    pool.allocate(2)  # evicts the tail (hs[1]) then the head (hs[0])
    events = pool.drain_events()
    assert events == [
        BlockStored(1, (hs[0],)),
        BlockStored(2, (hs[1],)),
        BlockRemoved(3, (hs[1], hs[0])),
    ]
    pool.free([1, 0])
    assert pool.reset_prefix_cache()
    assert pool.drain_events() == [AllBlocksCleared(4)]
    assert pool.event_seq == 4
    assert pool.drain_events() == []


def test_duplicate_content_stays_private() -> None:
    pool = BlockPool(4)
    h = _hashes(1)[0]
    a, b = pool.allocate(1), pool.allocate(1)
    assert pool.cache_block(a[0], h)
    assert not pool.cache_block(b[0], h)  # same content computed twice: one copy is cached
    assert pool.cached_block(h) == a[0]
    pool.free(b)
    assert pool.stats() == PoolStats(total=4, free=3, used=1, cached_evictable=0)
    pool.check_integrity([a])


def test_double_free_raises() -> None:
    pool = BlockPool(3)
    a = pool.allocate(1)
    pool.free(a)
    with pytest.raises(ValueError, match="double free"):
        pool.free(a)
    with pytest.raises(ValueError):
        pool.free([2])  # never allocated
    pool.check_integrity([])


def test_allocate_returns_none_when_short_and_changes_nothing() -> None:
    pool = BlockPool(4)
    a = pool.allocate(3)
    before = (pool.stats(), list(pool.ref_cnt), pool.event_seq)
    assert pool.allocate(2) is None  # None, not -1 and not a partial list
    assert (pool.stats(), list(pool.ref_cnt), pool.event_seq) == before
    assert pool.allocate(1) == [3]
    with pytest.raises(ValueError):
        pool.allocate(-1)
    pool.check_integrity([a, [3]])


def test_cache_block_rejects_unreferenced_block() -> None:
    pool = BlockPool(2)
    with pytest.raises(ValueError):
        pool.cache_block(0, 123)


def test_reset_prefix_cache_only_when_idle() -> None:
    pool = BlockPool(3)
    a = pool.allocate(2)
    hs = _hashes(2)
    pool.cache_block(a[0], hs[0])
    assert not pool.reset_prefix_cache()  # a block is in use
    assert pool.find_prefix(hs) == [a[0]]
    pool.free(reversed(a))
    assert pool.reset_prefix_cache()
    assert pool.find_prefix(hs) == [] and pool.cached_hashes() == []
    assert pool.stats() == PoolStats(total=3, free=3, used=0, cached_evictable=0)
    pool.check_integrity([])


def test_caching_disabled() -> None:
    pool = BlockPool(2, enable_caching=False)
    a = pool.allocate(1)
    assert not pool.cache_block(a[0], 5)
    assert pool.find_prefix([5]) == []
    assert pool.drain_events() == []


def test_stats_fields() -> None:
    pool = BlockPool(8)
    assert pool.stats() == PoolStats(total=8, free=8, used=0, cached_evictable=0)
    assert pool.stats().usage == 0.0
    a = pool.allocate(4)
    hs = _hashes(2)
    pool.cache_block(a[0], hs[0])
    pool.cache_block(a[1], hs[1])
    s = pool.stats()
    assert s == PoolStats(total=8, free=4, used=4, cached_evictable=0)
    assert s.usage == 0.5
    pool.free(reversed(a))
    assert pool.stats() == PoolStats(total=8, free=6, used=0, cached_evictable=2)
    assert pool.num_free_blocks == 8  # cached-evictable blocks are allocatable


def test_invalid_size() -> None:
    with pytest.raises(ValueError):
        BlockPool(0)


def test_check_integrity_catches_a_table_mismatch() -> None:
    pool = BlockPool(3)
    a = pool.allocate(2)
    with pytest.raises(AssertionError):
        pool.check_integrity([a[:1]])  # a reference the tables do not account for
    with pytest.raises(AssertionError):
        pool.check_integrity([a, a])
