"""`kvserve bench router`: the router's pure decision path at 8-512 synthetic workers (no model, no Ray).

What is timed (around each call, one process, one thread, as in the router actor's event loop;
both wall time, ``perf_counter_ns``, and this thread's CPU time, ``thread_time_ns``, which leaves
out time the thread waited for a core on a loaded machine; saturation uses CPU time):

* ``decision``: what the router does per request on its event loop in the pure modules: build a
  ``WorkerView`` per worker from its last report, ``Placement.fits_anywhere_ever``,
  ``Placement.choose`` with ``PrefixIndex.overlap`` as the prefix lookup, and an admission
  ``check`` (the queue's bound check every request passes through).
* ``event apply``: ``PrefixIndex.apply`` of one ``BlockStored`` / ``BlockRemoved`` event carrying
  ``--hashes-per-event`` hashes (a worker batches a step's blocks into one event).
* ``index memory``: ``tracemalloc`` growth while loading ``--cached-blocks`` hashes per worker,
  per cached block, at two sizes (so linearity shows).

Synthetic load: ``--groups`` shared prefixes of ``--prefix-blocks`` blocks; each worker caches a
random subset of groups plus unique blocks; a request is one group's prefix plus
``--unique-blocks`` fresh blocks. Pressure reports are random (free / evictable / running /
waiting). Per request, the router also folds the events its placement causes: about
``(prefix + unique) / hashes_per_event`` stored events and as many removals once the cache is full.

Saturation: one router actor is one thread, so at ``R`` requests/s its busy share is
``R * (decision_mean + events_per_request * apply_mean)``; it saturates where that reaches 1.
The report prints the busy share at each ``--rates`` value and that saturation rate.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
import tracemalloc
from dataclasses import dataclass
from typing import Any

from kvserve.router.policy.admission import AdmissionQueue
from kvserve.router.policy.placement import Placement, PlacementRequest, WorkerView
from kvserve.router.policy.prefix_index import BlockRemoved, BlockStored, PrefixIndex


@dataclass(frozen=True)
class RouterBenchConfig:
    """Sizes of the synthetic load (validated).

    Raises:
        ValueError: a non-positive size.
    """

    num_workers: int = 64
    requests: int = 2000
    groups: int = 200
    prefix_blocks: int = 32
    unique_blocks: int = 8
    cached_blocks: int = 4000
    hashes_per_event: int = 8
    policy: str = "kv_aware"
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_workers", "requests", "groups", "prefix_blocks", "cached_blocks", "hashes_per_event"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.unique_blocks < 0:
            raise ValueError(f"unique_blocks must be >= 0, got {self.unique_blocks}")


@dataclass(frozen=True)
class _Report:
    """A worker's last pressure report, as the router holds it."""

    free: int
    evictable: int
    running: int
    waiting: int


BLOCK_SIZE = 16
TOTAL_BLOCKS = 8192


def _percentile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q / 100 * len(sorted_values)))]


def _fill_index(index: PrefixIndex, cfg: RouterBenchConfig, rng: random.Random, chains: list[list[int]]) -> int:
    """Cache ``cfg.cached_blocks`` hashes per worker (whole groups first, then unique blocks)."""
    next_unique = 1 << 40
    for w in range(cfg.num_workers):
        worker = f"w{w}"
        seq, hashes = 0, []
        for g in rng.sample(range(len(chains)), k=min(len(chains), cfg.cached_blocks // (2 * cfg.prefix_blocks))):
            hashes.extend(chains[g])
        while len(hashes) < cfg.cached_blocks:
            hashes.append(next_unique)
            next_unique += 1
        for i in range(0, len(hashes), cfg.hashes_per_event):
            seq += 1
            index.apply(worker, [BlockStored(seq, tuple(hashes[i : i + cfg.hashes_per_event]))])
    return next_unique


def measure_memory(cfg: RouterBenchConfig) -> dict[str, float]:
    """Index bytes per cached block (tracemalloc), at ``cached_blocks`` and 4x as many."""
    out = {}
    for scale in (1, 4):
        sized = RouterBenchConfig(**{**cfg.__dict__, "cached_blocks": cfg.cached_blocks * scale, "num_workers": 8})
        rng = random.Random(cfg.seed)
        chains = [[rng.getrandbits(63) for _ in range(cfg.prefix_blocks)] for _ in range(cfg.groups)]
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        index = PrefixIndex()
        _fill_index(index, sized, rng, chains)
        used = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
        blocks = sum(index.num_hashes(w) for w in index.workers())
        out[f"bytes_per_block_at_{sized.cached_blocks}"] = used / blocks
        del index
    return out


def run_one(cfg: RouterBenchConfig) -> dict[str, Any]:
    """Time decisions and event applies at ``cfg.num_workers`` workers; see the module doc."""
    rng = random.Random(cfg.seed)
    chains = [[rng.getrandbits(63) for _ in range(cfg.prefix_blocks)] for _ in range(cfg.groups)]
    index = PrefixIndex()
    next_unique = _fill_index(index, cfg, rng, chains)
    seqs = {f"w{w}": index.last_seq(f"w{w}") for w in range(cfg.num_workers)}
    reports = {
        f"w{w}": _Report(rng.randrange(TOTAL_BLOCKS // 2), rng.randrange(TOTAL_BLOCKS // 4), rng.randrange(64),
                         rng.randrange(8))
        for w in range(cfg.num_workers)
    }  # fmt: skip
    placement = Placement(cfg.policy)
    queue: AdmissionQueue[Any] = AdmissionQueue(1024, 1 << 20)

    @dataclass
    class _Item:
        request_id: str
        priority: int
        num_blocks: int

    decisions: list[float] = []
    decisions_cpu: list[float] = []
    applies: list[float] = []
    chosen: dict[str, int] = {}
    for i in range(cfg.requests):
        g = rng.randrange(cfg.groups)
        hashes = (*chains[g], *range(next_unique, next_unique + cfg.unique_blocks))
        next_unique += cfg.unique_blocks
        num_tokens = (len(hashes) + 1) * BLOCK_SIZE - 3
        t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        views = [
            WorkerView(worker_id, True, BLOCK_SIZE, TOTAL_BLOCKS, r.free, r.evictable, r.running, r.waiting)
            for worker_id, r in reports.items()
        ]
        shape = PlacementRequest(num_tokens, hashes, 64)
        Placement.fits_anywhere_ever(shape, views)
        queue.check(_Item(f"r{i}", 0, len(hashes)))
        worker = placement.choose(shape, views, index.overlap)
        decisions_cpu.append(time.thread_time_ns() - c0)
        decisions.append(time.perf_counter_ns() - t0)
        chosen[worker or "-"] = chosen.get(worker or "-", 0) + 1
        if worker is None:
            continue
        # The events this placement causes on its worker: its blocks stored, as many old ones evicted.
        new = hashes[index.overlap(worker, hashes) :]
        for j in range(0, len(new), cfg.hashes_per_event):
            batch = tuple(new[j : j + cfg.hashes_per_event])
            for event_type in (BlockStored, BlockRemoved):
                seqs[worker] += 1
                event = event_type(seqs[worker], batch if event_type is BlockStored else _victims(index, worker, batch))
                c1 = time.thread_time_ns()
                index.apply(worker, [event])
                applies.append(time.thread_time_ns() - c1)
    decisions.sort()
    decisions_cpu.sort()
    applies.sort()
    decision_mean = statistics.fmean(decisions_cpu) / 1e3
    apply_mean = statistics.fmean(applies) / 1e3 if applies else 0.0
    events_per_request = len(applies) / cfg.requests
    per_request_us = decision_mean + events_per_request * apply_mean
    return {
        "workers": cfg.num_workers,
        "requests": cfg.requests,
        "decision_p50_us": _percentile(decisions, 50) / 1e3,
        "decision_p99_us": _percentile(decisions, 99) / 1e3,
        "decision_cpu_p50_us": _percentile(decisions_cpu, 50) / 1e3,
        "decision_cpu_p99_us": _percentile(decisions_cpu, 99) / 1e3,
        "decision_cpu_mean_us": decision_mean,
        "apply_mean_us": apply_mean,
        "events_per_s": 1e6 / apply_mean if apply_mean else float("inf"),
        "events_per_request": events_per_request,
        "router_us_per_request": per_request_us,
        "saturation_requests_per_s": 1e6 / per_request_us,
        "max_worker_share": max(chosen.values()) / cfg.requests,
    }


def _victims(index: PrefixIndex, worker: str, keep: tuple[int, ...]) -> tuple[int, ...]:
    """Some hashes the worker holds other than ``keep`` (evicted to make room)."""
    out = []
    for h in index._workers[worker].hashes:  # noqa: SLF001 - a bench peeks to pick realistic victims
        if h not in keep:
            out.append(h)
            if len(out) == len(keep):
                break
    return tuple(out)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", default="8,64,512", help="comma list of worker counts")
    p.add_argument("--requests", type=int, default=2000, help="placement decisions timed per worker count")
    p.add_argument("--rates", default="1000,5000,10000,20000", help="req/s at which to report the busy share")
    p.add_argument("--groups", type=int, default=200)
    p.add_argument("--prefix-blocks", type=int, default=32)
    p.add_argument("--unique-blocks", type=int, default=8)
    p.add_argument("--cached-blocks", type=int, default=4000, help="hashes cached per worker")
    p.add_argument("--hashes-per-event", type=int, default=8)
    p.add_argument("--policy", default="kv_aware", choices=("kv_aware", "least_loaded", "round_robin"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    try:
        counts = [int(x) for x in args.workers.split(",")]
        rates = [float(x) for x in args.rates.split(",")]
        cfgs = [
            RouterBenchConfig(n, args.requests, args.groups, args.prefix_blocks, args.unique_blocks,
                              args.cached_blocks, args.hashes_per_event, args.policy, args.seed)
            for n in counts
        ]  # fmt: skip
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    results = [run_one(c) for c in cfgs]
    for r in results:
        r["busy_share_at"] = {f"{rate:g}": rate * r["router_us_per_request"] / 1e6 for rate in rates}
    memory = measure_memory(cfgs[0])
    if args.json:
        print(json.dumps({"results": results, "memory": memory}))
        return 0
    cols = ["workers", "decision p50 / p99 wall (us)", "decision p50 / p99 CPU (us)", "apply CPU (us/event)",
            "events/s", "events/request", "router us/request", "saturates at (req/s)",
            *(f"busy @ {r:g}/s" for r in rates)]  # fmt: skip
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in results:
        busy = [f"{v:.0%}" for v in r["busy_share_at"].values()]
        print(f"| {r['workers']} | {r['decision_p50_us']:.0f} / {r['decision_p99_us']:.0f} "
              f"| {r['decision_cpu_p50_us']:.0f} / {r['decision_cpu_p99_us']:.0f} | {r['apply_mean_us']:.2f} "
              f"| {r['events_per_s']:.0f} | {r['events_per_request']:.1f} | {r['router_us_per_request']:.1f} "
              f"| {r['saturation_requests_per_s']:.0f} | " + " | ".join(busy) + " |")  # fmt: skip
    print("\nprefix index memory: " + ", ".join(f"{k.replace('_', ' ')}: {v:.0f} B" for k, v in memory.items()))
    return 0
