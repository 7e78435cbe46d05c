"""Scheduler on a bare BlockPool (no model): exact block ids, budgets, preemption, prefix hits, swap.

Each test drives ``schedule()`` then ``update(out, sampled)`` with fake sampled tokens, the way the
engine does, and checks the pool's integrity against the live block tables after every step. A
fresh pool hands out block ids in order 0, 1, 2, ...; a freed block goes to the back of the LRU
queue (a sequence's blocks tail first).
"""

from __future__ import annotations

import itertools

import pytest

from kvserve.workers.core.sampling_params import SamplingParams
from kvserve.workers.engine.block_pool import BlockPool
from kvserve.workers.engine.request import Request, RequestStatus
from kvserve.workers.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput

_clock = itertools.count()


def _req(rid: str, prompt: list[int], priority: int = 0, cache_salt: str | None = None) -> Request:
    params = SamplingParams(max_tokens=16, temperature=0.0)
    return Request(rid, list(prompt), params, priority=priority, cache_salt=cache_salt, arrival_time=next(_clock))


def _sched(
    num_blocks: int,
    block_size: int = 4,
    swap_blocks: int = 0,
    watermark: float = 0.0,
    **config: object,
) -> Scheduler:
    pool = BlockPool(num_blocks)
    swap = BlockPool(swap_blocks, enable_caching=False) if swap_blocks else None
    cfg = SchedulerConfig(block_size=block_size, watermark=watermark, **config)  # type: ignore[arg-type]
    return Scheduler(cfg, pool, swap, model_id="test-model")


def _check(s: Scheduler) -> None:
    s.pool.check_integrity(s.block_tables())
    if s.swap_pool is not None:
        s.swap_pool.check_integrity([r.swap_table for r in s.swapped])


def _step(s: Scheduler) -> tuple[SchedulerOutput, list[int | None]]:
    """One engine step: a fake token (900 + output index) for every request whose chunk reaches its end."""
    out = s.schedule()
    sampled = [
        900 + r.num_output_tokens if r.num_computed_tokens + n == r.num_tokens else None for r, n in out.scheduled
    ]
    s.update(out, sampled)
    _check(s)
    return out, sampled


def _ids(out: SchedulerOutput) -> list[tuple[str, int]]:
    return [(r.request_id, n) for r, n in out.scheduled]


# ---- admission --------------------------------------------------------------------------------


def test_admission_reserves_whole_prompt_even_when_chunked() -> None:
    s = _sched(10, max_num_batched_tokens=4)
    a = _req("a", list(range(10)))  # 3 blocks of 4
    s.add(a)
    out, sampled = _step(s)
    assert _ids(out) == [("a", 4)] and sampled == [None]
    assert a.block_table == [0, 1, 2]  # the whole prompt, not just the first chunk
    assert a.num_computed_tokens == 4
    assert s.pool.stats().used == 3


@pytest.mark.parametrize(("b_len", "admitted"), [(20, True), (24, False)])
def test_admission_keeps_the_watermark_free(b_len: int, admitted: bool) -> None:
    s = _sched(10, watermark=0.2)  # 2 blocks kept free at admission
    assert s.watermark_blocks == 2
    a, b = _req("a", list(range(10))), _req("b", list(range(100, 100 + b_len)))
    s.add(a)
    s.add(b)
    out, _ = _step(s)
    assert a.block_table == [0, 1, 2]
    # After a, 7 blocks are free; b needs 5 (leaves 2: ok) or 6 (leaves 1 < watermark: waits).
    if admitted:
        assert _ids(out) == [("a", 10), ("b", 20)]
        assert b.block_table == [3, 4, 5, 6, 7] and b.status is RequestStatus.RUNNING
    else:
        assert _ids(out) == [("a", 10)]
        assert b.block_table == [] and b.status is RequestStatus.WAITING and s.waiting == [b]
        assert s.pool.stats().used == 3


def test_max_num_seqs_limits_admission() -> None:
    s = _sched(32, max_num_seqs=2)
    reqs = [_req(f"r{i}", [i] * 5) for i in range(3)]
    for r in reqs:
        s.add(r)
    out, _ = _step(s)
    assert _ids(out) == [("r0", 5), ("r1", 5)]
    assert s.waiting == [reqs[2]]


def test_waiting_queue_orders_by_priority_then_arrival() -> None:
    s = _sched(32)
    low, high, low2 = _req("low", [1] * 4), _req("high", [2] * 4, priority=5), _req("low2", [3] * 4)
    for r in (low, high, low2):
        s.add(r)
    out, _ = _step(s)
    assert _ids(out) == [("high", 4), ("low", 4), ("low2", 4)]
    assert (high.block_table, low.block_table, low2.block_table) == ([0], [1], [2])


# ---- budget and growth -------------------------------------------------------------------------


def test_chunked_prefill_splits_by_token_budget() -> None:
    s = _sched(16, max_num_batched_tokens=6)
    a, b = _req("a", list(range(10))), _req("b", list(range(50, 55)))
    s.add(a)
    s.add(b)
    out, sampled = _step(s)
    assert _ids(out) == [("a", 6)] and sampled == [None]  # budget spent: b waits
    assert b.status is RequestStatus.WAITING
    out, sampled = _step(s)
    assert _ids(out) == [("a", 4), ("b", 2)] and sampled == [900, None]  # a's prefill ends: a token
    assert (a.block_table, b.block_table) == ([0, 1, 2], [3, 4])
    out, sampled = _step(s)
    assert _ids(out) == [("a", 1), ("b", 3)] and sampled == [901, 900]  # a decodes, b finishes prefill
    assert (a.num_computed_tokens, b.num_computed_tokens) == (11, 5)
    assert (a.output_token_ids, b.output_token_ids) == ([900, 901], [900])


def test_decode_allocates_a_block_exactly_at_the_boundary() -> None:
    s = _sched(8)
    a = _req("a", list(range(8)))  # exactly two full blocks
    s.add(a)
    _step(s)
    assert a.block_table == [0, 1] and a.num_tokens == 9
    tables = []
    for _ in range(5):  # compute positions 8..12
        out, _ = _step(s)
        assert _ids(out) == [("a", 1)]
        tables.append(list(a.block_table))
    # Position 8 opens block 2; positions 9-11 fit in it; position 12 opens block 3.
    assert tables == [[0, 1, 2], [0, 1, 2], [0, 1, 2], [0, 1, 2], [0, 1, 2, 3]]


# ---- preemption --------------------------------------------------------------------------------


def _three_running(s: Scheduler) -> tuple[Request, Request, Request]:
    """a (prio 0, first), c (prio 0, second), b (prio 1, last): each holds 2 full blocks of 4."""
    a = _req("a", list(range(0, 8)))
    c = _req("c", list(range(20, 28)))
    b = _req("b", list(range(40, 48)), priority=1)
    for r in (a, c, b):
        s.add(r)
    out, _ = _step(s)
    assert _ids(out) == [("b", 8), ("a", 8), ("c", 8)]
    assert (b.block_table, a.block_table, c.block_table) == ([0, 1], [2, 3], [4, 5])
    assert s.pool.num_free_blocks == 0
    return a, b, c


def test_preemption_picks_lowest_priority_then_latest_arrival() -> None:
    s = _sched(6)
    a, b, c = _three_running(s)
    out, _ = _step(s)  # every request needs a third block; none is free
    # b arrived last but has the higher priority; among priority 0, c arrived after a.
    assert out.preempted == [c]
    assert _ids(out) == [("b", 1), ("a", 1)]
    assert c.status is RequestStatus.WAITING and s.waiting == [c]
    assert c.block_table == [] and c.num_computed_tokens == 0 and c.num_preemptions == 1
    assert c.output_token_ids == [900]  # what it generated is kept and recomputed later
    # c's blocks were freed tail first (5, then 4) and handed to b, then a.
    assert (b.block_table, a.block_table) == ([0, 1, 5], [2, 3, 4])
    assert s.num_preemptions == {"recompute": 1, "swap": 0}
    assert out.swap_out == [] and out.swap_in == []


def test_no_admission_in_a_step_that_preempted() -> None:
    s = _sched(6)
    _three_running(s)
    d = _req("d", [7])
    s.add(d)
    out, _ = _step(s)
    assert out.preempted and d.status is RequestStatus.WAITING


def test_least_important_request_preempts_itself() -> None:
    s = _sched(4)
    b = _req("b", list(range(7)), priority=1)  # 7 tokens: its first output still fits block 1
    c = _req("c", list(range(10, 18)))  # 8 tokens: its first output needs a third block
    s.add(b)
    s.add(c)
    _step(s)
    assert (b.block_table, c.block_table) == ([0, 1], [2, 3])
    out, _ = _step(s)
    assert out.preempted == [c] and _ids(out) == [("b", 1)]
    assert c.block_table == [] and s.pool.stats().used == 2


def test_router_preempt_command_recompute() -> None:
    s = _sched(8)
    a = _req("a", list(range(6)))
    s.add(a)
    _step(s)
    assert s.preempt(a, "recompute") == []
    assert a.status is RequestStatus.WAITING and a.block_table == [] and s.pool.stats().used == 0
    assert s.preempt(a) is None  # not running any more
    _check(s)


# ---- prefix cache ------------------------------------------------------------------------------

PROMPT = list(range(100, 108))  # two full blocks of 4


def test_prefix_hit_reuses_exact_block_ids() -> None:
    s = _sched(10)
    a = _req("a", PROMPT + [1, 2])
    s.add(a)
    _step(s)
    assert a.block_table == [0, 1, 2] and a.num_cached_blocks == 2
    b = _req("b", PROMPT + [3])
    s.add(b)
    out, _ = _step(s)
    assert b.block_table == [0, 1, 3]  # the two cached blocks, plus one fresh block
    assert (b.num_cached_tokens, b.skip_store_below) == (8, 8)
    assert [s.pool.ref_cnt[x] for x in (0, 1, 2, 3)] == [2, 2, 1, 1]
    assert _ids(out) == [("a", 1), ("b", 1)]  # b computes only its uncached token
    assert b.num_computed_tokens == 9
    assert (s.prefix_queries, s.prefix_hits) == (10 + 9, 8)


def test_prefix_cache_is_isolated_by_cache_salt() -> None:
    s = _sched(10)
    a = _req("a", PROMPT + [1], cache_salt="tenant-1")
    s.add(a)
    _step(s)
    b = _req("b", PROMPT + [1], cache_salt="tenant-2")
    s.add(b)
    out, _ = _step(s)
    assert b.num_cached_tokens == 0 and b.block_table == [3, 4, 5]
    assert ("b", 9) in _ids(out)


def test_full_hit_recomputes_only_the_last_token() -> None:
    s = _sched(10)
    a = _req("a", PROMPT)
    s.add(a)
    _step(s)
    b = _req("b", PROMPT)
    s.add(b)
    out, sampled = _step(s)
    assert b.block_table == [0, 1] and b.num_cached_tokens == 8
    # The last prompt token runs again for its logits; its K/V is already in shared block 1.
    assert ("b", 1) in _ids(out)
    assert b.skip_store_below == 8 and b.num_computed_tokens == 8 and b.output_token_ids == [900]
    assert sampled[_ids(out).index(("b", 1))] == 900
    # a's first decode took block 2; b's first decode now opens its own block 3.
    out, _ = _step(s)
    assert a.block_table == [0, 1, 2] and b.block_table == [0, 1, 3]


def test_full_hit_scheduled_state_before_update() -> None:
    s = _sched(10)
    a = _req("a", PROMPT)
    s.add(a)
    _step(s)
    s.finish(a, "length")  # blocks 0, 1 stay cached (evictable)
    b = _req("b", PROMPT)
    s.add(b)
    out = s.schedule()
    assert _ids(out) == [("b", 1)]
    assert (b.num_computed_tokens, b.skip_store_below) == (7, 8)
    assert b.block_table == [0, 1] and s.pool.stats().used == 2  # revived from the cache


def test_preempted_request_revives_its_own_cached_blocks() -> None:
    s = _sched(8)
    a = _req("a", list(range(8)))
    s.add(a)
    _step(s)
    assert s.preempt(a) == []
    out, _ = _step(s)
    # Re-admitted with both full prompt blocks found again: only the output token is computed.
    assert _ids(out) == [("a", 1)]
    assert a.block_table == [0, 1, 2] and a.num_computed_tokens == 9
    assert a.num_cached_tokens == 0  # reported hit is the first admission's


# ---- swap ---------------------------------------------------------------------------------------


def test_swap_mode_swaps_out_and_back_in_with_exact_mappings() -> None:
    s = _sched(6, swap_blocks=8, preemption_mode="swap")
    a, b, c = _three_running(s)
    out, _ = _step(s)
    assert out.preempted == [c]
    assert out.swap_out == [(4, 0), (5, 1)]  # device block -> host block
    assert c.status is RequestStatus.SWAPPED and s.swapped == [c]
    assert c.swap_table == [0, 1] and c.block_table == []
    assert c.num_computed_tokens == 8 and c.num_swaps == 1  # progress is kept
    assert s.num_preemptions == {"recompute": 0, "swap": 1}
    assert (b.block_table, a.block_table) == ([0, 1, 5], [2, 3, 4])

    s.finish(b, "length")  # frees 5, 1, 0 (tail first)
    _check(s)
    out, _ = _step(s)
    assert out.swap_out == []
    assert out.swap_in == [(0, 5), (1, 1)]  # host block -> device block
    # c holds 9 tokens: the re-reservation covers its new position too.
    assert c.block_table == [5, 1, 0] and c.swap_table == []
    assert c.status is RequestStatus.RUNNING and s.swapped == []
    assert _ids(out) == [("a", 1), ("c", 1)]
    assert s.swap_pool is not None and s.swap_pool.stats().used == 0


def test_swap_falls_back_to_recompute_when_host_space_is_short() -> None:
    s = _sched(6, swap_blocks=1, preemption_mode="swap")
    _, _, c = _three_running(s)
    out, _ = _step(s)
    assert out.preempted == [c] and out.swap_out == []
    assert c.status is RequestStatus.WAITING
    assert s.num_preemptions == {"recompute": 1, "swap": 0}


# ---- validation ---------------------------------------------------------------------------------


def test_check_fits() -> None:
    s = _sched(10, max_model_len=64)  # 40 tokens
    s.check_fits(8, 32)  # 40 tokens: the whole pool
    with pytest.raises(ValueError, match="prompt \\+ max_tokens"):
        s.check_fits(8, 33)
    with pytest.raises(ValueError, match="prompt of 41 tokens"):
        s.check_fits(41, 1)
    assert s.pool.stats().used == 0 and not s.waiting


def test_check_fits_keeps_the_watermark_for_the_prompt() -> None:
    s = _sched(10, watermark=0.2)  # 2 of 10 blocks kept free at admission: 32 prompt tokens at most
    s.check_fits(31, 1)
    with pytest.raises(ValueError, match="prompt of 33 tokens"):
        s.check_fits(33, 1)


def test_check_fits_clamps_to_max_model_len() -> None:
    s = _sched(10, max_model_len=40)
    s.check_fits(8, 10_000)  # can never grow past 40 tokens = 10 blocks


def test_config_validation() -> None:
    with pytest.raises(ValueError):
        SchedulerConfig(block_size=0)
    with pytest.raises(ValueError):
        SchedulerConfig(watermark=1.0)
    with pytest.raises(ValueError):
        SchedulerConfig(preemption_mode="drop")


def test_preempted_request_is_readmitted_once_the_pool_drains() -> None:
    s = _sched(10, block_size=1, watermark=0.2)  # 2 blocks kept free at admission
    try:
        s.check_fits(6, 4)  # 6 + 4 tokens = the whole pool
    except ValueError:
        return  # rejected up front is a fine answer too: then it can never get stuck
    long = _req("long", [1] * 6)
    short = _req("short", [2], priority=1)
    s.add(long)
    _step(s)
    s.add(short)
    for _ in range(3):  # the pool runs dry; the less important long request is preempted at 9 tokens
        _step(s)
    assert long.status is RequestStatus.WAITING and long.num_tokens == 9
    s.finish(short, "length")
    assert s.pool.stats().used == 0
    out, _ = _step(s)  # an empty pool: the only waiting request must run
    assert [r.request_id for r, _ in out.scheduled] == ["long"]
    assert long.status is RequestStatus.RUNNING


# ---- migration import ---------------------------------------------------------------------------------
def test_admit_imported_uses_the_admission_rule() -> None:
    # 10 blocks of 4 tokens, watermark 20% = 2 blocks, kept free only while something runs.
    s = _sched(10, watermark=0.2)
    s.add(_req("run", [1] * 12))  # 3 blocks
    _step(s)
    big = _req("big", [2] * 20)  # 5 blocks: 10 - 3 - 5 = 2 left == the watermark -> fits
    assert s.admit_imported(big, 20) == [3, 4, 5, 6, 7]
    assert big.status is RequestStatus.RUNNING and big.num_computed_tokens == 20 and big in s.running
    _check(s)
    nope = _req("nope", [3] * 4)  # 1 block would eat into the watermark: "not now", nothing taken
    assert s.admit_imported(nope, 4) is None
    assert nope.block_table == [] and s.pool.num_free_blocks == 2 and nope not in s.running
    _check(s)


def test_admit_imported_into_an_idle_pool_waives_the_watermark_like_admission() -> None:
    s = _sched(10, watermark=0.2)
    whole = _req("whole", [1] * 40)  # the whole pool
    assert s.admit_imported(whole, 39) == list(range(10))
    _check(s)


def test_admit_imported_respects_max_num_seqs_and_rejects_bad_counts() -> None:
    s = _sched(10, max_num_seqs=1)
    s.add(_req("run", [1] * 4))
    _step(s)
    assert s.admit_imported(_req("second", [2] * 4), 4) is None
    with pytest.raises(ValueError, match="cannot import"):
        _sched(10).admit_imported(_req("x", [1] * 4), 5)


# ---- a shared prefix being computed ----------------------------------------------------------------


def test_a_burst_sharing_a_new_prefix_computes_it_once() -> None:
    """Two requests with the same uncached prefix, queued together: the second waits while the first
    computes the prefix, then hits all of it (it computed the whole prefix beside the first before)."""
    s = _sched(20)
    a, b = _req("a", PROMPT + [1, 2, 3, 4, 5]), _req("b", PROMPT + [6, 7, 8, 9, 10])
    s.add(a)
    s.add(b)
    out, _ = _step(s)
    assert _ids(out) == [("a", 13)]
    out, _ = _step(s)
    assert _ids(out) == [("a", 1), ("b", 5)]  # b computes only its own suffix
    assert b.num_cached_tokens == 8 and b.block_table[:2] == a.block_table[:2]
    assert s.prefill_tokens == 13 + 5  # the prefix once (13 + 13 computed side by side)


def test_waiting_for_a_prefix_lets_unrelated_requests_by() -> None:
    s = _sched(20)
    a, b, c = _req("a", PROMPT + [1]), _req("b", PROMPT + [2]), _req("c", [7, 7, 7, 7, 7])
    for r in (a, b, c):
        s.add(r)
    out, _ = _step(s)
    assert _ids(out) == [("a", 9), ("c", 5)]


def test_a_prefix_computed_in_chunks_is_waited_for_until_cached() -> None:
    """A chunked prefill caches its blocks step by step: the request behind it takes the blocks
    cached so far and waits for the one being computed, then takes that too."""
    s = _sched(20, max_num_batched_tokens=8)
    a, b = _req("a", PROMPT + [1, 2, 3, 4]), _req("b", PROMPT + [1, 2, 3, 4, 5])
    s.add(a)
    s.add(b)
    out, _ = _step(s)
    assert _ids(out) == [("a", 8)]  # no budget left
    out, _ = _step(s)
    assert _ids(out) == [("a", 4)]  # b's third block is a's last chunk: b waits
    out, _ = _step(s)
    assert _ids(out) == [("a", 1), ("b", 1)]
    assert b.num_cached_tokens == 12 and b.block_table[:3] == a.block_table[:3]


def test_a_finished_prefill_no_longer_holds_the_prefix() -> None:
    """Only running requests are waited for: once the one computing the prefix is gone (aborted
    before its step), the other computes the prefix itself rather than wait for nothing."""
    s = _sched(20)
    a, b = _req("a", PROMPT + [1]), _req("b", PROMPT + [2])
    s.add(a)
    s.add(b)
    s.schedule()  # a admitted, b waits for a's prefix; the step never runs
    s.finish(a, "abort")
    out = s.schedule()
    assert _ids(out) == [("b", 9)]
