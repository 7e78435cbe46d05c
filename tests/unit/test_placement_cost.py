"""kv_aware's cost model (kvserve/router/policy/placement.py ``CostModel``): cache affinity yields to load, a hot
prefix spills to a second worker, the balance guard, and the room check that does not count the
request's own idle hits as free. Property: no decision targets an unhealthy worker or one without room."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.router.policy.placement import CostModel, Placement, PlacementRequest, WorkerView, room_for
from kvserve.router.policy.prefix_index import BlockStored, PrefixIndex, PrefixMatch

BS = 4
PREFIX = tuple(range(100, 151))  # 51 blocks: the bench's 204-token system prompt


def view(worker_id: str, free: int = 500, *, total: int = 512, **kw) -> WorkerView:
    return WorkerView(worker_id=worker_id, healthy=True, block_size=BS, total_blocks=total, free_blocks=free, **kw)


def group_req(question: int) -> PlacementRequest:
    """A shared-prefix request: 51 prefix blocks + a 4-block question of its own, 16 output tokens."""
    hashes = PREFIX + tuple(range(question * 10, question * 10 + 4))
    return PlacementRequest(len(hashes) * BS + 1, hashes, 16)


def hits(table: dict[str, int]):
    return lambda worker_id, hashes: table.get(worker_id, 0)


# ---- affinity yields to load ---------------------------------------------------------------------------
def test_a_cached_prefix_wins_while_its_worker_backlog_is_small():
    workers = [view("a", blocks_in_flight=40, running=4), view("b")]
    assert Placement().choose(group_req(1), workers, hits({"a": 51})) == "a"


def test_a_hot_prefix_spills_to_a_second_worker_past_the_saving():
    """The saving is overlap_weight x 51 = 102 blocks; once "a"'s backlog passes "b"'s by more, the
    next request computes the prefix on "b" (deliberate replication)."""
    p = Placement()
    r = group_req(1)
    # backlog a = 40 in flight + 8 x 4 waiting + 10 running = 82 < 102 + b's: stays.
    assert p.choose(r, [view("a", blocks_in_flight=40, waiting=4, running=10), view("b")], hits({"a": 51})) == "a"
    # 8 waiting: 40 + 64 + 10 = 114 > 102 + the usage difference: spills.
    assert p.choose(r, [view("a", blocks_in_flight=40, waiting=8, running=10), view("b")], hits({"a": 51})) == "b"


def test_once_replicated_the_prefix_is_split_by_load():
    """Both workers hold (or are about to hold) the prefix: the load terms alone decide."""
    r = group_req(2)
    both = hits({"a": 51, "b": 51})
    assert Placement().choose(r, [view("a", running=6), view("b", running=2)], both) == "b"
    assert Placement().choose(r, [view("a", running=2), view("b", blocks_in_flight=30)], both) == "a"


def test_the_second_request_of_a_new_prefix_follows_the_first():
    """The first request's whole prompt is in flight on "a" (pending, not cached yet): with
    overlap_weight 1 its own TTFT would be a few blocks shorter on the idle "b" and every group would be
    split; at 2 the compute it would spend there outweighs that."""
    r = group_req(3)
    workers = [view("a", blocks_in_flight=57), view("b")]
    assert Placement().choose(r, workers, hits({"a": 51})) == "a"
    assert Placement(overlap_weight=1.0).choose(r, workers, hits({"a": 51})) == "b"


def test_balance_guard_sends_to_the_least_loaded_worker():
    model = CostModel(waiting_blocks=0.0, running_blocks=0.0, balance_abs=4, balance_rel=2.0)
    r = group_req(4)
    # The cost alone (no load terms) keeps "a"; 9 vs 2 requests is > 4 more and > 2x: the guard moves it.
    assert Placement(cost=model).choose(r, [view("a", running=9), view("b", running=2)], hits({"a": 51})) == "b"
    # 6 vs 2: > 4 more is false, "a" keeps it.
    assert Placement(cost=model).choose(r, [view("a", running=6), view("b", running=2)], hits({"a": 51})) == "a"
    # The guard ranks in candidates as in choose.
    p = Placement(cost=model)
    ranked = p.candidates(r, [view("a", running=9), view("b", running=2)], hits({"a": 51}))
    assert [c.worker_id for c in ranked] == ["b", "a"]


def test_cost_model_validates():
    for bad in ({"overlap_weight": -1}, {"waiting_blocks": -1}, {"running_blocks": -1}, {"usage_weight": -1},
                {"balance_abs": -1}, {"balance_rel": 0.5}):  # fmt: skip
        with pytest.raises(ValueError):
            CostModel(**bad)
    with pytest.raises(ValueError):
        Placement(running_weight=-1.0)


# ---- the room check ----------------------------------------------------------------------------------
def test_idle_hits_are_not_counted_as_free_room():
    """8 free + 51 evictable = 59 looks like room for 56 blocks, but the 51 evictable blocks are the
    very blocks the request hits: it needs 4 + 1 new blocks and has 8 (fits), not 59."""
    r = group_req(5)  # 56 prompt blocks: cached 51 -> need 4 + 1
    w = view("a", free=8, total=64, cached_evictable_blocks=51)
    assert room_for(w, 51) == 8 and room_for(w, 0) == 59
    assert Placement().choose(r, [w], lambda w_, h: PrefixMatch(51, 51, 51)) == "a"
    # A request that hits none of them still has the 59.
    other = PlacementRequest(57 * BS, tuple(range(9000, 9057)), 1)  # 57 blocks + reserve = 58 <= 59
    assert Placement().choose(other, [w], lambda w_, h: PrefixMatch(0, 0, 0)) == "a"
    # Only 4 free: 4 + 1 new blocks do not fit once the 51 idle hits are not counted as free.
    tight = view("a", free=4, total=64, cached_evictable_blocks=51)
    assert Placement().choose(r, [tight], lambda w_, h: PrefixMatch(51, 51, 51)) is None


def test_hits_held_by_running_requests_leave_the_evictable_pool_alone():
    """A running request holds the prefix (ref count > 0: not evictable), so the 20 evictable
    blocks are other content and all of them can be evicted for this request."""
    r = group_req(6)
    w = view("a", free=0, total=128, cached_evictable_blocks=20, used_blocks=108)
    assert Placement().choose(r, [w], lambda w_, h: PrefixMatch(51, 51, 0)) == "a"
    # A plain int (no idle count) is taken as all hits possibly idle: the conservative bound.
    assert Placement().choose(r, [w], lambda w_, h: 51) is None


def test_a_pending_prefix_attracts_but_is_not_counted_as_room():
    """The prefix is pending on "a" (a request placed there is computing it): the next request of the
    group still prefers "a" (cost), but it will compute its own copy, so the room check counts all 56
    prompt blocks + 1 reserve as needed there, not 5 + 1."""
    r = group_req(7)

    def pending(worker_id, hashes):
        return PrefixMatch(51, 0, 0) if worker_id == "a" else PrefixMatch(0, 0, 0)

    assert Placement().choose(r, [view("a", free=100, total=128), view("b")], pending) == "a"
    assert Placement().choose(r, [view("a", free=56, total=128)], pending) is None
    assert Placement().choose(r, [view("a", free=57, total=128)], pending) == "a"
    # Cached now: 5 + 1 are enough.
    assert Placement().choose(r, [view("a", free=6, total=128)], lambda w_, h: PrefixMatch(51, 51, 0)) == "a"


def test_affinity_reports_cached_and_idle_hits():
    index = PrefixIndex()
    index.apply("a", [BlockStored(1, (1, 2, 3))])
    match = index.affinity("a", (1, 2, 3, 4))
    assert (match, match.cached, match.idle) == (3, 3, 3)
    index.add_pending("a", "r1", (1, 2, 3, 4))  # a live placement holds them now, and computes 4
    match = index.affinity("a", (1, 2, 3, 4))
    assert (match, match.cached, match.idle) == (4, 3, 0)
    index.drop_pending("r1")
    index.add_pending("a", "r2", (1, 5, 2, 3))  # pending 5 breaks the cached run of (1, 5, 2)
    match = index.affinity("a", (1, 5, 2))
    assert (match, match.cached, match.idle) == (3, 1, 0)
    index.drop_pending("r2")
    assert index.affinity("a", (1, 2, 9)).idle == 2
    assert index.affinity("zz", (1,)) == 0 and index.affinity("zz", (1,)).cached == 0
    for bad in ((2, 3, 0), (3, 1, 2), (2, 1, -1)):
        with pytest.raises(ValueError):
            PrefixMatch(*bad)


# ---- properties ----------------------------------------------------------------------------------------
@st.composite
def worlds(draw):
    views, table = [], {}
    for i in range(draw(st.integers(1, 5))):
        total = draw(st.integers(1, 80))
        used = draw(st.integers(0, total))
        evictable = draw(st.integers(0, total - used))
        views.append(
            WorkerView(
                worker_id=f"w{i}",
                healthy=draw(st.booleans()),
                block_size=BS,
                total_blocks=total,
                free_blocks=total - used - evictable,
                cached_evictable_blocks=evictable,
                used_blocks=used,
                running=draw(st.integers(0, 40)),
                waiting=draw(st.integers(0, 40)),
                blocks_in_flight=draw(st.integers(0, 30)),
                blocks_migrating_in=draw(st.integers(0, 5)),
            )
        )
        matched = draw(st.integers(0, 20))
        ready = draw(st.integers(0, matched))
        table[f"w{i}"] = PrefixMatch(matched, ready, draw(st.integers(0, ready)))
    prompt = draw(st.integers(1, 80))
    request = PlacementRequest(prompt, tuple(range(prompt // BS)), draw(st.integers(1, 40)), draw(st.integers(0, 2)))
    return views, table, request


@given(worlds(), st.sampled_from(["kv_aware", "least_loaded", "round_robin"]), st.integers(0, 20), st.floats(1, 4))
@settings(max_examples=400, deadline=None)
def test_no_decision_targets_an_unhealthy_worker_or_one_without_room(world, policy, balance_abs, balance_rel):
    views, table, request = world
    by_id = {v.worker_id: v for v in views}
    p = Placement(policy, cost=CostModel(balance_abs=balance_abs, balance_rel=balance_rel))
    got = p.choose(request, views, lambda w, h: table[w])
    ranked = p.candidates(request, views, lambda w, h: table[w])
    if policy != "round_robin":
        assert got == (ranked[0].worker_id if ranked else None)
    for c in ranked:
        w, hit = by_id[c.worker_id], table[c.worker_id]
        ready = min(hit.cached, len(request.block_hashes), (request.num_prompt_tokens - 1) // BS)
        assert w.healthy
        assert request.blocks_needed_ever(BS) <= w.total_blocks
        assert c.promised_blocks == -(-request.num_prompt_tokens // BS) - ready + request.decode_reserve_blocks
        assert c.promised_blocks <= room_for(w, min(ready, hit.idle))
    if got is None:
        # Nothing fit: every healthy worker lacks room for the request now.
        assert not ranked
    else:
        assert got in {c.worker_id for c in ranked}
