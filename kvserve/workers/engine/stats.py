"""The engine's report of itself: ``EngineStats``, made by ``LLMEngine.make_stats`` (as vLLM's scheduler
makes its own ``SchedulerStats``), so nothing outside the engine reads its pool, queues or tiers to say
how loaded it is.

Contract: every field is named as the ``PressureReport`` field it becomes
(``kvserve/protos/kvserve/v1/pressure.proto``); the worker copies them by name
(``kvserve/workers/transport/pressure.py`` ``pressure_report``) and adds only what it measures itself
(step latency, decode steps, migrations). Counters are running totals over the engine's life.
Adding a stat: the proto field, a field here, its line in ``engine_stats``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from kvserve.workers.engine.block_pool import BlockPool
from kvserve.workers.engine.model_runner import ModelRunner
from kvserve.workers.engine.scheduler import Scheduler
from kvserve.workers.engine.tiered_cache import TieredCache, TierReport


@dataclass(frozen=True)
class EngineStats:
    """One engine's state after a step. Plain (no slots): ``vars()`` is the report's keyword arguments."""

    # the pool
    total_blocks: int
    free_blocks: int
    used_blocks: int
    cached_evictable_blocks: int
    swap_blocks_total: int
    swap_blocks_free: int
    # the scheduler
    num_running: int
    num_waiting: int
    num_swapped: int
    tokens_in_flight: int
    num_preemptions_total: int
    num_swaps_total: int
    prefix_cache_query_tokens_total: int
    prefix_cache_hit_tokens_total: int
    prefill_tokens_total: int
    # the tiered prefix cache (docs/architecture.md §3a): zeros without tiers
    host_cache_bytes_used: int = 0
    host_cache_bytes_capacity: int = 0
    disk_cache_bytes_used: int = 0
    disk_cache_bytes_capacity: int = 0
    host_load_ratio: float = 0.0
    disk_load_ratio: float = 0.0
    recompute_ms_per_block: float = 0.0
    prefix_cache_host_hit_tokens_total: int = 0
    prefix_cache_disk_hit_tokens_total: int = 0
    tier_bytes_written_total: int = 0
    tier_bytes_loaded_total: int = 0
    tier_load_seconds_total: float = 0.0
    tier_spills_dropped_total: int = 0
    # the runner
    decode_graph_steps_total: int = 0  # decode steps that replayed a captured graph (cuda_graphs)


class EngineParts(Protocol):
    """What an engine's stats are read from (``LLMEngine`` has it all; a Protocol because engine.py imports
    this module, not the reverse)."""

    pool: BlockPool
    swap_pool: BlockPool | None
    scheduler: Scheduler
    tiers: TieredCache | None
    runner: ModelRunner


def engine_stats(engine: EngineParts) -> EngineStats:
    """The stats of ``engine`` (``LLMEngine.make_stats`` passes itself). Call it on the engine's thread:
    it reads live queues."""
    pool, swap_pool, scheduler, tiers = engine.pool, engine.swap_pool, engine.scheduler, engine.tiers
    ps = pool.stats()
    t = tiers.report(scheduler.tier_hits) if tiers is not None else TierReport()
    return EngineStats(
        total_blocks=ps.total,
        free_blocks=ps.free,
        used_blocks=ps.used,
        cached_evictable_blocks=ps.cached_evictable,
        swap_blocks_total=swap_pool.num_blocks if swap_pool else 0,
        swap_blocks_free=swap_pool.num_free_blocks if swap_pool else 0,
        num_running=len(scheduler.running),
        num_waiting=len(scheduler.waiting),
        num_swapped=len(scheduler.swapped),
        tokens_in_flight=scheduler.tokens_in_flight(),
        num_preemptions_total=sum(scheduler.num_preemptions.values()),
        num_swaps_total=scheduler.num_preemptions["swap"],
        prefix_cache_query_tokens_total=scheduler.prefix_queries,
        prefix_cache_hit_tokens_total=scheduler.prefix_hits,
        prefill_tokens_total=scheduler.prefill_tokens,
        host_cache_bytes_used=t.host_bytes_used,
        host_cache_bytes_capacity=t.host_bytes_capacity,
        disk_cache_bytes_used=t.disk_bytes_used,
        disk_cache_bytes_capacity=t.disk_bytes_capacity,
        host_load_ratio=t.host_load_ratio,
        disk_load_ratio=t.disk_load_ratio,
        recompute_ms_per_block=t.recompute_ms_per_block,
        prefix_cache_host_hit_tokens_total=t.host_hit_tokens,
        prefix_cache_disk_hit_tokens_total=t.disk_hit_tokens,
        tier_bytes_written_total=t.bytes_written,
        tier_bytes_loaded_total=t.bytes_loaded,
        tier_load_seconds_total=t.load_seconds,
        tier_spills_dropped_total=t.spills_dropped,
        decode_graph_steps_total=engine.runner.decode_graphs.replays if engine.runner.decode_graphs else 0,
    )
