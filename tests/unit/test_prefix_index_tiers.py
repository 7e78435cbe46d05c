"""The prefix index per tier (device per worker, host/disk per node) and placement credit by tier."""

from __future__ import annotations

import pytest

from kvserve.protos.kvserve.v1 import worker_pb2 as pb
from kvserve.router.policy.placement import Placement, PlacementRequest, WorkerView
from kvserve.router.policy.prefix_index import BlockRemoved, BlockStored, PrefixIndex
from kvserve.router.table.worker_link import block_event
from kvserve.router.table.workers import _credit

BS = 4
CHAIN = tuple(range(1000, 1012))  # 12 blocks


def _index() -> PrefixIndex:
    idx = PrefixIndex()
    for w, node in (("a", "n1"), ("b", "n1"), ("c", "n2")):
        idx.set_node(w, node)
    return idx


def test_a_host_block_stored_by_one_worker_is_a_hit_for_every_worker_of_its_node() -> None:
    idx = _index()
    # A loaded 0-3 back from the host tier (they stay there too); 4-7 are in the host tier only.
    idx.apply("a", [BlockStored(1, CHAIN[:4]), BlockStored(2, CHAIN[:8], "host")])
    a, b, c = (idx.affinity(w, CHAIN) for w in "abc")
    assert (int(a), a.cached, a.host, a.disk) == (4, 4, 4, 0)  # device 0-3, then host 4-7
    assert (int(b), b.cached, b.host) == (0, 0, 8)  # same node, nothing in its own pool: host 0-7
    assert (int(c), c.host) == (0, 0)  # another node


def test_tier_runs_follow_the_device_match_host_then_disk() -> None:
    idx = _index()
    idx.apply("a", [BlockStored(1, CHAIN[:2]), BlockStored(2, CHAIN[2:5], "host"), BlockStored(3, CHAIN[5:9], "disk")])
    m = idx.affinity("a", CHAIN)
    assert (int(m), m.host, m.disk) == (2, 3, 4)
    # B (same node, empty pool) starts at block 0, which is on A's device only: no tier run.
    m = idx.affinity("b", CHAIN)
    assert (int(m), m.host, m.disk) == (0, 0, 0)


def test_removal_by_another_worker_of_the_node_applies_to_the_node() -> None:
    idx = _index()
    idx.apply("a", [BlockStored(1, CHAIN[:6], "host")])
    idx.apply("b", [BlockRemoved(1, CHAIN[3:6], "host"), BlockStored(2, CHAIN[3:6], "disk")])
    m = idx.affinity("a", CHAIN)
    assert (m.host, m.disk) == (3, 3)
    assert idx.tier_hashes("b", "host") == frozenset(CHAIN[:3])


def test_a_gap_drops_device_hashes_and_a_snapshot_replaces_the_node_tiers() -> None:
    idx = _index()
    idx.apply("a", [BlockStored(1, CHAIN[:2]), BlockStored(2, CHAIN[2:6], "host")])
    assert idx.apply("a", [BlockStored(5, CHAIN[6:7])])  # gap
    assert idx.hashes("a") == frozenset() and idx.tier_hashes("a", "host") == frozenset(CHAIN[2:6])
    idx.load_snapshot("a", 5, CHAIN[:1], {"host": CHAIN[1:3], "disk": CHAIN[3:4]})
    m = idx.affinity("b", CHAIN)  # b shares the node's tiers
    assert idx.tier_hashes("b", "host") == frozenset(CHAIN[1:3]) and m.host == 0  # block 0 is a's only
    m = idx.affinity("a", CHAIN)
    assert (int(m), m.host, m.disk) == (1, 2, 1)


def test_a_worker_without_node_is_a_node_of_its_own() -> None:
    idx = PrefixIndex()
    idx.apply("x", [BlockStored(1, CHAIN[:3], "host")])
    idx.apply("y", [])
    assert idx.affinity("x", CHAIN).host == 3 and idx.affinity("y", CHAIN).host == 0


def test_node_tiers_go_when_the_last_worker_of_the_node_goes() -> None:
    idx = _index()
    idx.apply("a", [BlockStored(1, CHAIN[:3], "host")])
    idx.apply("b", [])
    idx.remove_worker("a")
    assert idx.tier_hashes("b", "host") == frozenset(CHAIN[:3])  # b still on n1
    idx.remove_worker("b")
    assert idx.tier_hashes("b", "host") == frozenset()


def test_wire_events_keep_their_tier() -> None:
    e = pb.BlockEvent(seq=3, stored=pb.BlockStored(hashes=[7, 8], tier=pb.TIER_DISK))
    assert block_event(e) == BlockStored(3, (7, 8), "disk")
    e = pb.BlockEvent(seq=4, removed=pb.BlockRemoved(hashes=[7]))
    assert block_event(e) == BlockRemoved(4, (7,), "device")


@pytest.mark.parametrize(("ratio", "credit"), [(0.0, 0.0), (0.25, 0.75), (1.0, 0.0), (3.0, 0.0)])
def test_credit_is_one_minus_the_measured_ratio(ratio: float, credit: float) -> None:
    assert _credit(ratio) == pytest.approx(credit)


def _view(worker_id: str, **kw: object) -> WorkerView:
    return WorkerView(worker_id=worker_id, healthy=True, block_size=BS, total_blocks=512, free_blocks=500, **kw)  # type: ignore[arg-type]


def test_placement_prefers_the_node_whose_tier_holds_the_prefix_by_its_measured_credit() -> None:
    """Same load: the worker on the node holding the prefix in its host tier wins if loading pays
    there, and the tie-break decides (as with no tiers) when the measured credit is 0."""
    idx = PrefixIndex()
    idx.set_node("a", "n1")
    idx.set_node("c", "n2")
    idx.apply("a", [BlockStored(1, CHAIN, "host")])
    idx.apply("c", [])
    request = PlacementRequest(len(CHAIN) * BS + 1, CHAIN, 8)
    paying = [_view("a", host_credit=0.8), _view("c", host_credit=0.8)]
    assert Placement().choose(request, paying, idx.affinity) == "a"
    decision = Placement().decide(request, paying, idx.affinity)
    losing = [_view("a", host_credit=0.0), _view("c", host_credit=0.0)]
    assert decision is not None
    tie = Placement().choose(request, losing, lambda w, h: 0)
    assert Placement().choose(request, losing, idx.affinity) == tie
    # Credit trades against load in prefill blocks: 12 blocks x 0.8 = 9.6 blocks of backlog.
    assert Placement().choose(request, [_view("a", host_credit=0.8, blocks_in_flight=9), _view("c")],
                              idx.affinity) == "a"  # fmt: skip
    assert Placement().choose(request, [_view("a", host_credit=0.8, blocks_in_flight=30), _view("c")],
                              idx.affinity) == "c"  # fmt: skip
