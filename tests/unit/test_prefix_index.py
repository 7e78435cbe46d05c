"""PrefixIndex: event folding, gap detection, resync by snapshot."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.router.policy.prefix_index import AllBlocksCleared, BlockRemoved, BlockStored, PrefixIndex


def test_stored_removed_cleared():
    idx = PrefixIndex()
    assert not idx.apply("w", [BlockStored(1, (10, 11, 12)), BlockStored(2, (13,))])
    assert idx.overlap("w", [10, 11, 12, 13, 14]) == 4
    idx.apply("w", [BlockRemoved(3, (12,))])
    assert idx.overlap("w", [10, 11, 12, 13]) == 2  # leading blocks only: 13 is after a miss
    assert idx.overlap("w", [11, 10]) == 2
    assert idx.overlap("w", [99, 10]) == 0
    idx.apply("w", [AllBlocksCleared(4)])
    assert idx.overlap("w", [10]) == 0 and idx.num_hashes("w") == 0
    assert idx.last_seq("w") == 4


def test_unknown_worker():
    idx = PrefixIndex()
    assert idx.overlap("nobody", [1, 2]) == 0
    assert not idx.needs_resync("nobody")
    assert idx.last_seq("nobody") == 0
    idx.remove_worker("nobody")


def test_workers_are_independent():
    idx = PrefixIndex()
    idx.apply("a", [BlockStored(1, (1, 2))])
    idx.apply("b", [BlockStored(1, (1,)), BlockStored(2, (5,))])
    assert idx.overlaps([1, 2]) == {"a": 2, "b": 1}
    assert idx.workers() == ["a", "b"]
    idx.remove_worker("a")
    assert idx.workers() == ["b"] and idx.overlap("a", [1]) == 0


def test_resent_events_are_ignored():
    idx = PrefixIndex()
    idx.apply("w", [BlockStored(1, (1,)), BlockRemoved(2, (1,))])
    assert not idx.apply("w", [BlockStored(1, (1,)), BlockRemoved(2, (1,)), BlockStored(3, (2,))])
    assert idx.hashes("w") == {2}


def test_gap_marks_resync_and_drops_entries():
    idx = PrefixIndex()
    idx.apply("w", [BlockStored(1, (1, 2))])
    assert idx.apply("w", [BlockStored(3, (3,))]) is True  # seq 2 missing
    assert idx.needs_resync("w")
    assert idx.overlap("w", [1]) == 0
    # Further events are ignored until the snapshot, and the gap is reported only once.
    assert idx.apply("w", [BlockStored(4, (4,))]) is False
    assert idx.num_hashes("w") == 0
    assert idx.load_snapshot("w", 4, [1, 2, 3, 4])
    assert not idx.needs_resync("w")
    assert idx.overlap("w", [1, 2, 3, 4]) == 4
    idx.apply("w", [BlockStored(4, (99,)), BlockRemoved(5, (4,))])  # 4 already in the snapshot
    assert idx.hashes("w") == {1, 2, 3}
    assert idx.last_seq("w") == 5


def test_first_contact_mid_stream_needs_resync():
    idx = PrefixIndex()
    assert idx.apply("w", [BlockStored(500, (1,))])
    assert idx.needs_resync("w")


def test_stale_snapshot_ignored_when_in_sync():
    idx = PrefixIndex()
    idx.apply("w", [BlockStored(1, (1,)), BlockStored(2, (2,))])
    assert not idx.load_snapshot("w", 1, [1])
    assert idx.hashes("w") == {1, 2}
    assert idx.load_snapshot("w", 2, [2, 7])  # same seq: authoritative
    assert idx.hashes("w") == {2, 7}


def test_mark_resync():
    idx = PrefixIndex()
    idx.apply("w", [BlockStored(1, (1,))])
    idx.mark_resync("w")
    assert idx.needs_resync("w") and idx.overlap("w", [1]) == 0
    assert idx.load_snapshot("w", 0, [])  # e.g. a restarted worker with an empty pool
    idx.apply("w", [BlockStored(1, (8,))])
    assert idx.hashes("w") == {8}


def test_rejects_non_events():
    with pytest.raises(TypeError):
        PrefixIndex().apply("w", [("stored", 1)])


# ---------------------------------------------------------------- model-based


class Model:
    """The worker's true hash set, and the events it emitted."""

    def __init__(self) -> None:
        self.hashes: set[int] = set()
        self.seq = 0


hash_st = st.integers(min_value=0, max_value=12)
op_st = st.one_of(
    st.tuples(st.just("store"), st.lists(hash_st, max_size=4)),
    st.tuples(st.just("remove"), st.lists(hash_st, max_size=4)),
    st.tuples(st.just("clear"), st.none()),
    st.tuples(st.just("drop"), st.none()),  # the next event is lost in transit
    st.tuples(st.just("resend"), st.none()),  # the last few events arrive again
    st.tuples(st.just("snapshot"), st.none()),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(op_st, max_size=40), st.lists(st.lists(hash_st, max_size=5), min_size=1, max_size=5))
def test_matches_model(ops, queries):
    truth = Model()
    idx = PrefixIndex()
    sent = []
    drop_next = False
    for kind, arg in ops:
        if kind in ("store", "remove", "clear"):
            truth.seq += 1
            if kind == "store":
                truth.hashes.update(arg)
                event = BlockStored(truth.seq, tuple(arg))
            elif kind == "remove":
                truth.hashes.difference_update(arg)
                event = BlockRemoved(truth.seq, tuple(arg))
            else:
                truth.hashes.clear()
                event = AllBlocksCleared(truth.seq)
            sent.append(event)
            if drop_next:
                drop_next = False
                continue
            idx.apply("w", [event])
        elif kind == "drop":
            drop_next = True
        elif kind == "resend":
            idx.apply("w", sent[-3:])
        elif kind == "snapshot" and idx.needs_resync("w"):
            assert idx.load_snapshot("w", truth.seq, truth.hashes)

        # Invariant: in sync -> exactly the truth; out of sync -> nothing claimed.
        if idx.needs_resync("w"):
            assert idx.num_hashes("w") == 0
        elif idx.last_seq("w") == truth.seq:
            assert idx.hashes("w") == truth.hashes

    for q in queries:
        got = idx.overlap("w", q)
        expected = 0
        if not idx.needs_resync("w") and idx.last_seq("w") == truth.seq:
            while expected < len(q) and q[expected] in truth.hashes:
                expected += 1
            assert got == expected
        elif idx.needs_resync("w"):
            assert got == 0
