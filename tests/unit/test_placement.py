"""Placement policy on crafted pressure tables."""

from __future__ import annotations

import pytest

from kvserve.router.policy.placement import Placement, PlacementPolicy, PlacementRequest, WorkerView, blocks_for

BS = 16


def view(worker_id: str, free: int, *, total: int = 100, healthy: bool = True, **kw) -> WorkerView:
    return WorkerView(worker_id=worker_id, healthy=healthy, block_size=BS, total_blocks=total, free_blocks=free, **kw)


def no_hits(worker_id, hashes):
    return 0


def hits_table(table: dict[str, int]):
    return lambda worker_id, hashes: table.get(worker_id, 0)


def req(prompt_tokens: int, *, num_hashes: int | None = None, max_tokens: int = 16, reserve: int = 1):
    n = prompt_tokens // BS if num_hashes is None else num_hashes
    return PlacementRequest(
        num_prompt_tokens=prompt_tokens,
        block_hashes=tuple(range(1, n + 1)),
        max_tokens=max_tokens,
        decode_reserve_blocks=reserve,
    )


def test_blocks_for():
    assert [blocks_for(n, 16) for n in (0, 1, 16, 17, 32)] == [0, 1, 1, 2, 2]


def test_prefers_prefix_overlap_on_equal_load():
    workers = [view("a", 50), view("b", 50)]
    r = req(10 * BS + 3)
    assert Placement().choose(r, workers, hits_table({"b": 8})) == "b"
    assert Placement().choose(r, workers, hits_table({"a": 8})) == "a"


def test_longer_overlap_wins():
    workers = [view("a", 50), view("b", 50), view("c", 50)]
    assert Placement().choose(req(10 * BS + 3), workers, hits_table({"a": 3, "b": 9, "c": 5})) == "b"


def test_overlap_weighed_against_load():
    # "a" holds the whole prefix but is nearly full; "b" is empty.
    workers = [view("a", 15, cached_evictable_blocks=0, running=40, waiting=10), view("b", 100)]
    r = req(10 * BS + 3)
    assert Placement().choose(r, workers, hits_table({"a": 10})) == "b"
    # With a lighter load on "a" the overlap wins again.
    workers = [view("a", 60, running=4), view("b", 100)]
    assert Placement().choose(r, workers, hits_table({"a": 10})) == "a"


def test_overlap_weight_zero_ignores_cache():
    workers = [view("a", 40), view("b", 60)]
    p = Placement(overlap_weight=0.0)
    assert p.choose(req(10 * BS + 3), workers, hits_table({"a": 10})) == "b"


def test_refuses_infeasible_returns_none():
    workers = [view("a", 5), view("b", 8, cached_evictable_blocks=2)]
    # 11 prompt blocks + 1 reserve = 12 > 10 available anywhere.
    assert Placement().choose(req(10 * BS + 3), workers, no_hits) is None
    # Evictable blocks count: b has 8 free + 4 evictable = 12.
    workers = [view("a", 5), view("b", 8, cached_evictable_blocks=4)]
    assert Placement().choose(req(10 * BS + 3), workers, no_hits) == "b"


def test_cached_blocks_reduce_need():
    # 11 prompt blocks + 1 reserve = 12; a has 6 available but 8 blocks cached -> needs 4.
    workers = [view("a", 6)]
    assert Placement().choose(req(10 * BS + 3), workers, no_hits) is None
    assert Placement().choose(req(10 * BS + 3), workers, hits_table({"a": 8})) == "a"


def test_fully_cached_block_aligned_prompt_still_computes_last_block():
    # 4 full blocks, all cached: the last one is recomputed (1) + reserve (1) = 2 blocks.
    r = req(4 * BS, reserve=1)
    cands = Placement().candidates(r, [view("a", 2)], hits_table({"a": 4}))
    assert cands[0].cached_blocks == 3 and cands[0].promised_blocks == 2
    assert Placement().choose(r, [view("a", 1)], hits_table({"a": 4})) is None


def test_prefix_hits_clamped_to_hash_count():
    r = req(4 * BS + 5)  # 4 hashes, 5 prompt blocks
    cands = Placement().candidates(r, [view("a", 10)], hits_table({"a": 99}))
    assert cands[0].cached_blocks == 4


def test_in_flight_blocks_reduce_availability():
    r = req(10 * BS + 3)  # needs 12
    assert Placement().choose(r, [view("a", 20, blocks_in_flight=9)], no_hits) is None
    assert Placement().choose(r, [view("a", 20, blocks_in_flight=8)], no_hits) == "a"


def test_in_flight_blocks_steer_to_other_worker():
    workers = [view("a", 60, blocks_in_flight=30), view("b", 50)]
    assert Placement().choose(req(3 * BS), workers, no_hits) == "b"
    assert Placement("least_loaded").choose(req(3 * BS), workers, no_hits) == "b"


def test_ties_broken_by_load_then_id():
    r = req(2 * BS)
    # Same usage after placement; b has fewer requests -> lower load (kv_aware cost also
    # charges requests, so make the cost equal with zero request weights).
    p = Placement(running_weight=0.0, waiting_weight=0.0)
    assert p.choose(r, [view("a", 50, running=5), view("b", 50, running=1)], no_hits) == "b"
    # Fully equal, no full block to rank by -> lowest id (prefixed prompts: tests/unit/test_placement_affinity.py).
    r = req(2 * BS, num_hashes=0)
    assert p.choose(r, [view("c", 50), view("b", 50), view("d", 50)], no_hits) == "b"
    assert Placement().choose(r, [view("c", 50), view("b", 50)], no_hits) == "b"


def test_unhealthy_excluded():
    workers = [view("a", 100, healthy=False), view("b", 20)]
    assert Placement().choose(req(3 * BS), workers, hits_table({"a": 3})) == "b"
    assert Placement().choose(req(3 * BS), [view("a", 100, healthy=False)], no_hits) is None


def test_whole_sequence_must_fit_total_pool():
    # Prompt fits now, but prompt + max_tokens never fits a 10-block pool.
    r = req(4 * BS, max_tokens=7 * BS)
    assert Placement().choose(r, [view("a", 10, total=10)], no_hits) is None
    assert Placement().choose(r, [view("a", 10, total=10), view("b", 20, total=20)], no_hits) == "b"


def test_fits_anywhere_ever():
    r = req(4 * BS, max_tokens=6 * BS)  # 10 blocks at its longest
    assert Placement.fits_anywhere_ever(r, [view("a", 0, total=10)])
    assert not Placement.fits_anywhere_ever(r, [view("a", 9, total=9)])
    # Health does not matter: the pool may come back.
    assert Placement.fits_anywhere_ever(r, [view("a", 9, total=9), view("b", 0, total=10, healthy=False)])
    assert Placement.fits_anywhere_ever(r, [])


def test_least_loaded_ignores_overlap():
    workers = [view("a", 40, running=1), view("b", 60, running=9)]
    assert Placement("least_loaded").choose(req(3 * BS), workers, hits_table({"a": 3})) == "b"
    # Equal usage -> fewer requests.
    workers = [view("a", 60, running=3), view("b", 60, running=1, waiting=1)]
    assert Placement(PlacementPolicy.LEAST_LOADED).choose(req(3 * BS), workers, no_hits) == "b"


def test_round_robin_cycles_over_feasible_workers():
    p = Placement("round_robin")
    workers = [view("c", 50), view("a", 50), view("b", 50)]
    picks = [p.choose(req(BS), workers, no_hits) for _ in range(5)]
    assert picks == ["a", "b", "c", "a", "b"]
    # b cannot take it: skipped, rotation continues after the last choice.
    workers = [view("a", 50), view("b", 1), view("c", 50)]
    assert p.choose(req(3 * BS), workers, no_hits) == "c"
    assert p.choose(req(3 * BS), workers, no_hits) == "a"
    assert p.choose(req(3 * BS), [view("a", 1)], no_hits) is None


def test_candidates_ranked_best_first():
    workers = [view("a", 30), view("b", 90), view("c", 2)]
    cands = Placement().candidates(req(3 * BS), workers, no_hits)
    assert [c.worker_id for c in cands] == ["b", "a"]
    assert cands[0].cost < cands[1].cost


def test_no_hashes_skips_prefix_lookup():
    def boom(worker_id, hashes):
        raise AssertionError("should not be called")

    assert Placement().choose(PlacementRequest(num_prompt_tokens=5), [view("a", 10)], boom) == "a"


def test_broken_rules_raise():
    with pytest.raises(ValueError):
        Placement("random")
    with pytest.raises(ValueError):
        Placement(overlap_weight=-1)
    with pytest.raises(ValueError):
        view("a", -1)
    with pytest.raises(ValueError):
        WorkerView("a", True, block_size=0, total_blocks=1, free_blocks=1)
    with pytest.raises(ValueError):
        PlacementRequest(num_prompt_tokens=0)
    with pytest.raises(ValueError):
        PlacementRequest(num_prompt_tokens=1, max_tokens=0)
    with pytest.raises(ValueError):
        Placement().choose(req(BS), [view("a", 5), view("a", 6)], no_hits)
