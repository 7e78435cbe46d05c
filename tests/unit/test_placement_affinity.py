"""Placement's tie-breaking by prefix (rendezvous), its fast ``choose`` path, and pending prefixes in the index."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.router.policy.placement import Placement, PlacementRequest, WorkerView, tie_rank
from kvserve.router.policy.prefix_index import BlockStored, PrefixIndex

BS = 4


def view(worker_id: str, free: int = 100, **kw) -> WorkerView:
    return WorkerView(worker_id=worker_id, healthy=True, block_size=BS, total_blocks=100, free_blocks=free, **kw)


def req(first_hash: int, blocks: int = 4) -> PlacementRequest:
    return PlacementRequest(blocks * BS + 1, tuple(range(first_hash, first_hash + blocks)), 4)


def no_hits(worker_id: str, hashes) -> int:
    return 0


def test_ties_spread_prefixes_and_stay_put() -> None:
    workers = [view(f"worker-{i}") for i in range(4)]
    p = Placement()
    chosen = {h: p.choose(req(h * 1000), workers, no_hits) for h in range(1, 41)}
    # Different prefixes on an idle cluster spread over the workers (not all on the lowest id)...
    assert len(set(chosen.values())) == 4
    # ... and a prefix's tie always goes to the same worker, whatever the views' order.
    for h, w in chosen.items():
        assert p.choose(req(h * 1000), list(reversed(workers)), no_hits) == w
        assert Placement("least_loaded").choose(req(h * 1000), workers, no_hits) == w
    assert tie_rank((), "worker-0") == 0 and tie_rank((5,), "a") == tie_rank((5,), "a")


def test_load_still_beats_the_tie_rank() -> None:
    for h in range(1, 20):
        assert Placement().choose(req(h), [view("a", 90), view("b", 100)], no_hits) == "b"


views_strategy = st.lists(
    st.tuples(st.integers(0, 120), st.integers(0, 30), st.integers(0, 8), st.integers(0, 4), st.integers(0, 20),
              st.integers(0, 6)),
    min_size=1, max_size=6,
)  # fmt: skip


@settings(max_examples=200, deadline=None)
@given(views_strategy, st.integers(1, 40), st.sampled_from(["kv_aware", "least_loaded"]))
def test_choose_is_the_first_candidate(rows, prompt_tokens, policy) -> None:
    workers = [
        WorkerView(f"w{i}", True, BS, 100, min(free, 100), evictable, running, waiting, in_flight)
        for i, (free, evictable, running, waiting, in_flight, _) in enumerate(rows)
    ]
    hits = {f"w{i}": row[5] for i, row in enumerate(rows)}
    r = PlacementRequest(prompt_tokens, tuple(range(7, 7 + prompt_tokens // BS)), 3)
    p = Placement(policy)
    ranked = p.candidates(r, workers, lambda w, h: hits[w])
    assert p.choose(r, workers, lambda w, h: hits[w]) == (ranked[0].worker_id if ranked else None)


def test_duplicate_ids_still_rejected() -> None:
    with pytest.raises(ValueError, match="duplicate"):
        Placement().choose(req(1), [view("a"), view("a")], no_hits)


# ---- pending prefixes (PrefixIndex.add_pending / affinity) ----------------------------------------------
def test_pending_prefix_attracts_the_next_same_prefix_request() -> None:
    index = PrefixIndex()
    chain = (11, 12, 13, 14)
    workers = [view("a", 100), view("b", 100)]
    first = Placement().choose(req(11), workers, index.affinity)
    index.add_pending(first, "r1", chain)
    assert index.affinity(first, chain) == 4 and index.overlap(first, chain) == 0
    other = "b" if first == "a" else "a"
    # The first request's blocks are promised on its worker (less free there), yet the prefix wins.
    loaded = [view(first, 90, blocks_in_flight=6), view(other, 100)]
    assert Placement().choose(req(11), loaded, index.affinity) == first
    assert Placement().choose(req(11), loaded, index.overlap) == other  # what the router does without it


def test_pending_counts_refs_and_is_dropped() -> None:
    index = PrefixIndex()
    index.add_pending("a", "r1", (1, 2, 3))
    index.add_pending("a", "r2", (1, 2, 9))
    assert index.affinity("a", (1, 2, 3)) == 3 and index.num_pending("a") == 2
    with pytest.raises(ValueError):
        index.add_pending("b", "r1", (1,))
    assert index.drop_pending("r1") and not index.drop_pending("r1")
    assert index.affinity("a", (1, 2, 3)) == 2
    index.drop_pending("r2")
    assert index.affinity("a", (1, 2, 3)) == 0 and index.num_pending() == 0
    # Cached and pending combine; a gap drops the cached part only.
    index.apply("a", [BlockStored(1, (1, 2))])
    index.add_pending("a", "r3", (1, 2, 3, 4))
    assert index.affinity("a", (1, 2, 3, 4, 5)) == 4
    index.apply("a", [BlockStored(5, (7,))])  # gap
    assert index.overlap("a", (1, 2)) == 0 and index.affinity("a", (1, 2, 3)) == 3
    index.remove_worker("a")
    assert index.num_pending() == 0 and index.affinity("a", (1,)) == 0
