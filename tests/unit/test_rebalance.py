"""Migration and priority-preemption decisions (kvserve/router/policy/rebalance.py) on crafted pressure tables,
plus properties: decisions only target healthy workers with room, and stale or reordered
pressure reports never make a request bounce back."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve.router.policy.placement import WorkerView
from kvserve.router.policy.rebalance import (
    ALWAYS,
    Migration,
    MigrationGate,
    MigrationLedger,
    Preemption,
    RunningRequest,
    WaitingRequest,
    Watermarks,
    plan_migration,
    plan_preemption,
)

BS = 16
TOTAL = 100


def view(worker_id: str, used: int, *, total: int = TOTAL, healthy: bool = True, **kw) -> WorkerView:
    kw.setdefault("free_blocks", total - used)
    return WorkerView(worker_id=worker_id, healthy=healthy, block_size=BS, total_blocks=total, used_blocks=used, **kw)


def running(rid: str, worker: str, blocks: int, *, priority: int = 0, arrival: float = 0.0, tokens: int = 1, **kw):
    return RunningRequest(rid, worker, priority, arrival, blocks * BS, tokens, **kw)


WM = Watermarks(high=0.5, low=0.3)


# ---- migration ---------------------------------------------------------------------------------------
def test_moves_the_least_important_started_request_to_the_least_used_peer():
    views = [view("a", 80), view("b", 20), view("c", 10)]
    reqs = [
        running("old", "a", 30, arrival=1.0),
        running("new", "a", 20, arrival=2.0),
        running("vip", "a", 30, priority=5, arrival=3.0),
        running("other", "b", 20),
    ]
    assert plan_migration("a", views, reqs, WM, gate=ALWAYS) == Migration("new", "a", "c", 20)


def test_no_move_below_high_or_without_a_peer_below_low():
    reqs = [running("x", "a", 10), running("y", "a", 39)]
    assert plan_migration("a", [view("a", 49), view("b", 0)], reqs, WM, gate=ALWAYS) is None  # 0.49 < high
    assert plan_migration("a", [view("a", 60), view("b", 31)], reqs, WM, gate=ALWAYS) is None  # peer above low
    assert plan_migration("a", [view("a", 60), view("b", 30)], reqs, WM, gate=ALWAYS) == Migration("x", "a", "b", 10)


def test_a_lone_request_is_never_moved():
    assert plan_migration("a", [view("a", 90), view("b", 0)], [running("x", "a", 90)], WM, gate=ALWAYS) is None


def test_a_request_that_has_not_streamed_a_token_is_not_moved():
    reqs = [running("x", "a", 40), running("fresh", "a", 40, tokens=0, arrival=9.0)]
    assert plan_migration("a", [view("a", 80), view("b", 0)], reqs, WM, gate=ALWAYS) == Migration("x", "a", "b", 40)


def test_unhealthy_unreported_busy_and_full_peers_are_not_destinations():
    reqs = [running("x", "a", 40), running("y", "a", 40, arrival=1.0)]
    src = view("a", 80)
    assert plan_migration("a", [src, view("b", 0, healthy=False)], reqs, WM, gate=ALWAYS) is None
    assert plan_migration("a", [src, view("b", 0, reported=False)], reqs, WM, gate=ALWAYS) is None
    assert plan_migration("a", [src, view("b", 0)], reqs, WM, busy=frozenset({"b"}), gate=ALWAYS) is None
    assert plan_migration("a", [src, view("b", 0)], reqs, WM, busy=frozenset({"a"}), gate=ALWAYS) is None
    # Low usage but its free blocks are promised to placements in flight: no room for 40 blocks.
    assert plan_migration("a", [src, view("b", 0, blocks_in_flight=70)], reqs, WM, gate=ALWAYS) is None


def test_an_unknown_source_or_duplicate_views_raise():
    with pytest.raises(ValueError, match="no view"):
        plan_migration("zz", [view("a", 1)], [], WM)
    with pytest.raises(ValueError, match="duplicate"):
        plan_migration("a", [view("a", 1), view("a", 2)], [], WM)


def test_watermarks_validate():
    with pytest.raises(ValueError):
        Watermarks(high=0.3, low=0.5)
    with pytest.raises(ValueError):
        Watermarks(high=1.5, low=0.5)


def test_stale_reports_do_not_bounce_with_the_ledger():
    """The CI failure: after moving "b" off worker a, a's and b's next reports were taken before
    the move and still show it on a; without the ledger "a" would follow it (and then bounce)."""
    wm = Watermarks(0.05, 0.05)
    ledger = MigrationLedger()
    stale = [view("w0", 14), view("w1", 0)]  # "a" (8 blocks) and "b" (6 blocks) on w0
    reqs = [running("a", "w0", 8, arrival=1.0), running("b", "w0", 6, arrival=2.0)]
    move = plan_migration("w0", stale, reqs, wm, gate=ALWAYS)
    assert move == Migration("b", "w0", "w1", 6)
    ledger.moved(move)
    after = [dataclasses.replace(r, worker_id="w1") if r.request_id == "b" else r for r in reqs]

    def with_ledger(views):
        return [
            dataclasses.replace(
                v,
                blocks_migrating_in=ledger.blocks_in(v.worker_id),
                blocks_migrating_out=ledger.blocks_out(v.worker_id),
            )
            for v in views
        ]

    # The same (stale) reports arrive again: naively, "a" (8) + 0 < 14 moves too.
    assert plan_migration("w0", stale, after, wm, gate=ALWAYS) == Migration("a", "w0", "w1", 8)
    assert plan_migration("w0", with_ledger(stale), after, wm, gate=ALWAYS) is None
    assert plan_migration("w1", with_ledger(stale), after, wm, gate=ALWAYS) is None
    # w1's report after the import (its counter says 1 import) settles its side only.
    ledger.reported("w1", imports_total=1, exports_total=0)
    fresh_w1 = [view("w0", 14), view("w1", 6)]
    assert (ledger.blocks_in("w1"), ledger.blocks_out("w0")) == (0, 6)
    assert plan_migration("w0", with_ledger(fresh_w1), after, wm, gate=ALWAYS) is None
    assert plan_migration("w1", with_ledger(fresh_w1), after, wm, gate=ALWAYS) is None
    ledger.reported("w0", imports_total=0, exports_total=1)
    assert ledger.blocks_out("w0") == 0


def test_ledger_ignores_a_move_its_report_already_showed():
    ledger = MigrationLedger()
    ledger.reported("d", imports_total=1, exports_total=0)  # the report overtook the Ray call
    ledger.moved(Migration("r", "s", "d", 5))
    assert ledger.blocks_in("d") == 0 and ledger.blocks_out("s") == 5
    ledger.reported("s", imports_total=0, exports_total=0)  # an older report: nothing settles
    assert ledger.blocks_out("s") == 5
    ledger.forget("s")  # restarted
    assert ledger.blocks_out("s") == 0


# ---- priority preemption --------------------------------------------------------------------------------
# ---- the pay-off gate (MigrationGate) ----------------------------------------------------------------
def test_gate_needs_a_source_queue_or_a_compute_imbalance():
    reqs = [running("x", "a", 10), running("y", "a", 20, arrival=1.0)]
    dst = view("b", 0)
    # Above high, peer below low, but nothing waits on "a" and "a" runs 2 vs "b"'s 2 (+1): no move.
    assert plan_migration("a", [view("a", 60, running=2), view("b", 0, running=2)], reqs, WM) is None
    # The same with one request waiting inside "a": the freed blocks admit it.
    got = plan_migration("a", [view("a", 60, running=2, waiting=1), view("b", 0, running=2)], reqs, WM)
    assert got == Migration("y", "a", "b", 20)
    # Or "a" runs twice the destination's requests (+1): the victim decodes in a much smaller batch.
    assert plan_migration("a", [view("a", 60, running=2), dst], reqs, WM) == Migration("y", "a", "b", 20)
    assert plan_migration("a", [view("a", 60, running=2), dst], reqs, WM, gate=MigrationGate(imbalance=0)) is None


def test_gate_needs_real_headroom_and_an_empty_queue_on_the_destination():
    reqs = [running("x", "a", 10), running("y", "a", 20, arrival=1.0)]
    src = view("a", 60, waiting=1)
    # 70 available - 20 moved = 50 >= 25 % of 100: fine; with 40 promised in flight: 30 - 20 = 10 < 25.
    assert plan_migration("a", [src, view("b", 0, blocks_in_flight=30)], reqs, WM) == Migration("y", "a", "b", 20)
    assert plan_migration("a", [src, view("b", 0, blocks_in_flight=70)], reqs, WM) is None
    # A destination with a request waiting inside it is not a place to send more.
    assert plan_migration("a", [src, view("b", 0, waiting=1)], reqs, WM) is None
    assert plan_migration("a", [src, view("b", 0, waiting=1)], reqs, WM, gate=MigrationGate(max_dst_waiting=1))


def test_gate_skips_victims_too_close_to_their_end():
    src, dst = view("a", 60, waiting=1), view("b", 0)
    # "y" (20 blocks) has 5 tokens left: the copy never pays; "x" (10 blocks, 30 left) goes instead.
    reqs = [running("x", "a", 10, remaining_tokens=30), running("y", "a", 20, arrival=1.0, remaining_tokens=5)]
    assert plan_migration("a", [src, dst], reqs, WM) == Migration("x", "a", "b", 10)
    short = [running("x", "a", 10, remaining_tokens=9), running("y", "a", 20, arrival=1.0, remaining_tokens=5)]
    assert plan_migration("a", [src, dst], short, WM) is None
    assert plan_migration("a", [src, dst], short, WM, gate=ALWAYS) == Migration("y", "a", "b", 20)


def test_gate_and_remaining_tokens_validate():
    for bad in ({"imbalance": -1}, {"dst_headroom": 1.5}, {"max_dst_waiting": -1}, {"min_tokens_per_block": -0.5}):
        with pytest.raises(ValueError):
            MigrationGate(**bad)
    with pytest.raises(ValueError, match="remaining_tokens"):
        running("x", "a", 1, remaining_tokens=-1)


def test_preempts_the_least_important_running_request_that_makes_room():
    views = [view("a", 95), view("b", 95, swap_blocks=64)]
    reqs = [
        running("low-old", "a", 3, priority=0, arrival=1.0),
        running("low-new", "b", 20, priority=0, arrival=2.0),
        running("mid", "a", 50, priority=1, arrival=0.5),
    ]
    # The least important is low-new (latest arrival among priority 0); b then has 5 + 20 free.
    got = plan_preemption(WaitingRequest("vip", 5, 10), views, reqs)
    assert got == Preemption("low-new", "b", swap=True, promised_blocks=10)
    # Needing more than low-new frees on b: low-old's 3 blocks on a are not enough either -> mid.
    got = plan_preemption(WaitingRequest("vip", 5, 30), views, reqs)
    assert got == Preemption("mid", "a", swap=False, promised_blocks=30)


def test_never_preempts_equal_or_higher_priority_or_twice():
    views = [view("a", 95)]
    assert plan_preemption(WaitingRequest("w", 1, 10), views, [running("x", "a", 50, priority=1)]) is None
    assert plan_preemption(WaitingRequest("w", 2, 10), views, [running("x", "a", 50, priority=1)]) is not None
    done = running("x", "a", 50, priority=1, preemptible=False)
    assert plan_preemption(WaitingRequest("w", 2, 10), views, [done]) is None


def test_preemption_skips_unhealthy_workers_and_workers_without_room():
    reqs = [running("x", "a", 5, arrival=2.0), running("y", "b", 5, arrival=1.0)]
    views = [view("a", 95, healthy=False), view("b", 95)]
    assert plan_preemption(WaitingRequest("w", 1, 10), views, reqs) == Preemption("y", "b", False, 10)
    assert plan_preemption(WaitingRequest("w", 1, 11), views, reqs) is None  # 5 free + 5 freed < 11


# ---- properties -----------------------------------------------------------------------------------------
@st.composite
def tables(draw):
    n = draw(st.integers(1, 4))
    views = []
    for i in range(n):
        total = draw(st.integers(1, 64))
        used = draw(st.integers(0, total))
        cached = draw(st.integers(0, total - used))
        views.append(
            WorkerView(
                worker_id=f"w{i}",
                healthy=draw(st.booleans()),
                block_size=BS,
                total_blocks=total,
                free_blocks=total - used - cached,
                cached_evictable_blocks=cached,
                blocks_in_flight=draw(st.integers(0, 8)),
                used_blocks=used,
                reported=draw(st.booleans()),
                blocks_migrating_in=draw(st.integers(0, 8)),
                blocks_migrating_out=draw(st.integers(0, 8)),
                swap_blocks=draw(st.sampled_from([0, 16])),
                running=draw(st.integers(0, 6)),
                waiting=draw(st.integers(0, 3)),
            )
        )
    reqs = [
        RunningRequest(
            f"r{j}",
            f"w{draw(st.integers(0, n - 1))}",
            draw(st.integers(0, 3)),
            float(j),
            (tokens := draw(st.integers(1, 40 * BS))),
            draw(st.integers(0, tokens - 1)),
            preemptible=draw(st.booleans()),
            remaining_tokens=draw(st.none() | st.integers(0, 64)),
        )
        for j in range(draw(st.integers(0, 8)))
    ]
    return views, reqs


@given(
    tables(),
    st.floats(0, 1),
    st.floats(0, 1),
    st.integers(0, 4),
    st.integers(1, 40),
    st.sets(st.sampled_from(["w0", "w1", "w2", "w3"])),
)
@settings(max_examples=300, deadline=None)
def test_decisions_only_target_healthy_workers_with_room(table, x, y, priority, need, busy):
    views, reqs = table
    by_id = {v.worker_id: v for v in views}
    by_rid = {r.request_id: r for r in reqs}
    wm = Watermarks(high=max(x, y), low=min(x, y))
    gate = MigrationGate()
    for v in views:
        for g in (gate, ALWAYS):
            move = plan_migration(v.worker_id, views, reqs, wm, frozenset(busy), gate=g)
            if move is None:
                continue
            dst, src, victim = by_id[move.dst], by_id[move.src], by_rid[move.request_id]
            assert dst.healthy and dst.reported and move.dst != move.src and move.dst not in busy
            assert move.blocks <= dst.available_blocks
            assert victim.worker_id == move.src
            assert dst.committed_blocks + move.blocks < src.committed_blocks
            if g is gate:  # the pay-off gate holds for every move it lets through
                assert src.waiting > 0 or src.running + src.waiting >= gate.imbalance * (dst.running + dst.waiting + 1)
                assert dst.waiting <= gate.max_dst_waiting
                assert dst.available_blocks - move.blocks >= gate.dst_headroom * dst.total_blocks
                assert victim.remaining_tokens is None or victim.remaining_tokens >= move.blocks
    got = plan_preemption(WaitingRequest("new", priority, need), views, reqs)
    if got is not None:
        victim, worker = by_rid[got.victim_id], by_id[got.worker_id]
        assert worker.healthy and victim.worker_id == worker.worker_id
        assert victim.preemptible and victim.priority < priority
        assert worker.available_blocks + victim.blocks_held(BS) >= need
        assert got.swap == (worker.swap_blocks > 0)


@dataclasses.dataclass
class _Report:
    worker_id: str
    seq: int
    used: int
    count: int
    imports_total: int
    exports_total: int


@given(st.data())
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_stale_and_reordered_reports_never_bounce_a_request(data):
    """A world of fixed-size requests on 2-3 workers; reports are snapshots of it, delivered late,
    out of order or twice (the router keeps only the newest by seq). Every migration the router
    decides is carried out at once. With the ledger every decision sees the true block counts of
    both workers, so each move lowers the sum of squared loads: no layout ever comes back, i.e.
    no request bounces back (it may return to a worker later, after other moves changed it)."""
    n = data.draw(st.integers(2, 3), "workers")
    workers = [f"w{i}" for i in range(n)]
    total = 48  # >= the most blocks the requests can hold together (6 x 8)
    sizes = data.draw(st.lists(st.integers(1, 8), min_size=2, max_size=6), "request blocks")
    world = {f"r{j}": data.draw(st.sampled_from(workers), f"worker of r{j}") for j in range(len(sizes))}
    blocks = {f"r{j}": b for j, b in enumerate(sizes)}
    # NOTE: low thresholds, as in the integration test (5%): moves are frequent, so are chances to bounce.
    high = data.draw(st.sampled_from([0.0, 0.05, 0.1, 0.25]), "high")
    wm = Watermarks(high=high, low=high * data.draw(st.sampled_from([0.0, 0.5, 1.0]), "low / high"))
    gate = data.draw(st.sampled_from([ALWAYS, MigrationGate(), MigrationGate(dst_headroom=0.0)]), "gate")
    imports = dict.fromkeys(workers, 0)
    exports = dict.fromkeys(workers, 0)
    seqs = dict.fromkeys(workers, 0)
    latest: dict[str, _Report] = {}
    pending: list[_Report] = []
    ledger = MigrationLedger()
    layouts = {frozenset(world.items())}

    def used(w: str) -> int:
        return sum(b for r, b in blocks.items() if world[r] == w)

    def snapshot(w: str) -> _Report:
        seqs[w] += 1
        return _Report(w, seqs[w], used(w), sum(1 for x in world.values() if x == w), imports[w], exports[w])

    def views() -> list[WorkerView]:
        out = []
        for w in workers:
            rep = latest.get(w)
            reported_used = rep.used if rep else 0
            out.append(
                WorkerView(
                    worker_id=w,
                    healthy=True,
                    block_size=BS,
                    total_blocks=total,
                    free_blocks=total - reported_used,
                    used_blocks=reported_used,
                    running=rep.count if rep else 0,
                    reported=rep is not None,
                    blocks_migrating_in=ledger.blocks_in(w),
                    blocks_migrating_out=ledger.blocks_out(w),
                )
            )
        return out

    for step in range(data.draw(st.integers(1, 40), "steps")):
        if not pending or data.draw(st.booleans(), f"snapshot at {step}"):
            pending.append(snapshot(data.draw(st.sampled_from(workers), f"reporter at {step}")))
            continue
        i = data.draw(st.integers(0, len(pending) - 1), f"deliver at {step}")
        rep = pending[i] if data.draw(st.booleans(), f"duplicate at {step}") else pending.pop(i)
        if rep.worker_id in latest and rep.seq <= latest[rep.worker_id].seq:
            continue  # the router drops reports older than the one it has
        latest[rep.worker_id] = rep
        ledger.reported(rep.worker_id, rep.imports_total, rep.exports_total)
        shapes = [RunningRequest(r, w, 0, float(j), blocks[r] * BS, 1) for j, (r, w) in enumerate(world.items())]
        current = {v.worker_id: v for v in views()}
        move = plan_migration(rep.worker_id, list(current.values()), shapes, wm, gate=gate)
        if move is None:
            continue
        for w in (move.src, move.dst):
            assert current[w].committed_blocks == used(w), f"decided on a stale count of {w}"
        potential = sum(used(w) ** 2 for w in workers)
        world[move.request_id] = move.dst
        assert sum(used(w) ** 2 for w in workers) < potential
        layout = frozenset(world.items())
        assert layout not in layouts, f"{move.request_id} bounced back to {move.dst}"
        layouts.add(layout)
        exports[move.src] += 1
        imports[move.dst] += 1
        ledger.moved(move)
