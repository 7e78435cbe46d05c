"""TieredCache: the engine's side of the host and disk tiers (docs/architecture.md §3a).

* ``spill_evicted``: blocks the pool evicted are copied out of the KV cache (one gather per layer,
  issued on the engine thread before anything may overwrite them; on CUDA a side-stream copy into
  pinned memory the engine never waits for: ``tier_copy.py``) and handed to a background writer,
  which packs, checksums and writes them to the first tier. Off the decode path: the engine never
  waits for a file; when the writer falls behind by more than ``max_pending_bytes`` a spill is
  dropped (it is a cache).
* ``load``: on a prefix miss in its own pool the scheduler asks for the next hashes of the chain;
  each found (host, then disk), verified block is written into a fresh pool block, bit-identical
  to what was computed, so the request's tokens are those of a recompute (on CUDA: staged in pinned
  memory and copied on a side stream the compute stream waits for, not the engine thread).
* The cost model (``TierCostModel``) is fed with every load and decides, per tier, whether
  loading pays at all (``tier_load="auto"``).
* Tier events (stored / removed per tier) are collected by the writer and emitted into the pool's
  event stream on the engine thread (``publish_events``).

Payload of one block (the store's opaque bytes): for each layer its K and V,
``[2, block_size, num_kv_heads, head_dim]`` as raw bytes; then, for int8 caches, each layer's
scales ``[2, block_size, num_kv_heads]`` fp32. All layers contiguous, one file per block.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import os
import queue
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvserve.workers.core.kv_events import BlockRemoved, BlockStored
from kvserve.workers.engine.block_pool import BlockPool
from kvserve.workers.engine.block_store import BlockStore
from kvserve.workers.engine.config import EngineConfig
from kvserve.workers.engine.kv_cache import KVCache
from kvserve.workers.engine.tier_copy import Gathered, TierCopier
from kvserve.workers.engine.tier_cost import TierCostModel

logger = logging.getLogger(__name__)


def _probe_hash() -> int:
    """The start-up probe's block name: one per process (workers of a node probe the shared tier at
    once), in a range a 64-bit chain hash lands in with probability 2**-32; removed after the probe."""
    return 0xFFFF_FFFF_0000_0000 | os.getpid()


@dataclass
class TierStats:
    """Running totals of the tiers, as this worker saw them (reported in PressureReport)."""

    blocks_spilled: int = 0  # blocks written to the first tier by this worker
    spills_dropped: int = 0  # evicted blocks not written: the writer was too far behind
    bytes_written: int = 0
    blocks_loaded: dict[str, int] = field(default_factory=lambda: {"host": 0, "disk": 0})
    bytes_loaded: int = 0
    load_seconds: float = 0.0


@dataclass(frozen=True)
class TierReport:
    """The tiers' part of a pressure report (zeros: no tiers). Ratios: 0.0 = not measured / no tier."""

    host_bytes_used: int = 0
    host_bytes_capacity: int = 0
    disk_bytes_used: int = 0
    disk_bytes_capacity: int = 0
    host_load_ratio: float = 0.0
    disk_load_ratio: float = 0.0
    recompute_ms_per_block: float = 0.0
    host_hit_tokens: int = 0
    disk_hit_tokens: int = 0
    bytes_written: int = 0
    bytes_loaded: int = 0
    load_seconds: float = 0.0
    spills_dropped: int = 0


def layout_string(model_id: str, kv_cache: KVCache, shard: tuple[int, int] | None = None) -> str:
    """What a block file must match to be loaded here: model, layers, block shape, element types and, for a
    rank of a tensor-parallel group, ``shard`` = (rank, size): its KV heads of a block are its own file."""
    layer = kv_cache.layers[0]
    scales = "fp32" if kv_cache.scales is not None else "none"
    tp = f"|tp={shard[0]}/{shard[1]}" if shard is not None else ""
    return (f"{model_id}|layers={len(kv_cache.layers)}|block={list(layer.shape[2:])}x{kv_cache.block_size}"
            f"|dtype={layer.dtype}|scales={scales}{tp}")  # fmt: skip


def default_host_dir(layout: str) -> Path:
    """``/dev/shm/kvserve-<layout digest>``: every worker of the node serving this model shares it."""
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() else Path(tempfile.gettempdir())
    return base / f"kvserve-{hashlib.sha256(layout.encode()).hexdigest()[:16]}"


class TieredCache:
    """Spill, load and measure for one engine.

    Args:
        config: the engine's config (tier knobs).
        kv_cache: the device cache blocks are copied from and into.
        pool: the device pool (evicted blocks, event stream); None on a tensor-parallel rank > 0, which
            spills and loads what its rank 0 says (``kvserve/workers/parallel/tiers.py``) and emits no events.
        model_id: part of the layout every file is checked against.
        cost: the cost model this cache feeds and obeys.
        shard: (rank, size) of a tensor-parallel rank: its files are its KV heads of each block, named by a
            layout of its own; the group's ranks share one default host directory (one budget).
    """

    def __init__(
        self,
        config: EngineConfig,
        kv_cache: KVCache,
        pool: BlockPool | None,
        model_id: str,
        cost: TierCostModel,
        shard: tuple[int, int] | None = None,
    ) -> None:
        self.kv_cache = kv_cache
        self.pool = pool
        self.cost = cost
        self.shard = shard
        self.always_load = config.tier_load == "always"
        self.layout = layout_string(model_id, kv_cache, shard)
        self.copier = TierCopier.for_cache(kv_cache)
        payload = self.copier.payload_bytes
        disk = None
        if config.disk_cache_dir:
            disk = BlockStore(config.disk_cache_dir, config.disk_cache_bytes, self.layout, payload, "disk")
        host = None
        if config.host_cache_bytes:
            group = layout_string(model_id, kv_cache) + (f"|tp={shard[1]}" if shard is not None else "")
            host_dir = config.host_cache_dir or default_host_dir(group)
            host = BlockStore(host_dir, config.host_cache_bytes, self.layout, payload, "host", demote_to=disk)
        self.stores = [s for s in (host, disk) if s is not None]
        self.payload_bytes = payload
        self.stats = TierStats()
        # Host memory the writer may fall behind by (copies not yet in a file) before spills are dropped.
        self.max_pending_bytes = max(16 * payload, 256 * 2**20)
        self._pending_bytes = 0
        self._pending_lock = threading.Lock()
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._events: collections.deque[tuple[type[BlockStored] | type[BlockRemoved], tuple[int, ...], str]] = (
            collections.deque()
        )
        self._estimated_used = {s.name: s.used_bytes() for s in self.stores}
        self._last_sweep = 0.0
        self._writer = threading.Thread(target=self._write_loop, name="kv-tier-writer", daemon=True)
        self._writer.start()
        if pool is not None:
            pool.record_evictions = True
        logger.info("tiered prefix cache: %s", ", ".join(f"{s.name} {s.capacity_bytes / 2**30:.2f} GiB at "
                                                         f"{s.directory}" for s in self.stores))  # fmt: skip

    # ---- spill (engine thread, then writer) ---------------------------------------------------
    def spill_evicted(self) -> None:
        """Copy every block the pool evicted since the last call out of the KV cache, for the writer.

        Must run before anything writes into those blocks (the forward, a swap-in, a load, an import).
        """
        assert self.pool is not None
        evicted = self.pool.drain_evicted()
        if evicted:
            self.spill(evicted)

    def spill(self, evicted: list[tuple[int, int]]) -> None:
        """Copy these (block id, block hash) pairs out of the KV cache for the writer (``spill_evicted``)."""
        # A block the first tier already holds (e.g. loaded from it earlier) is not copied again: its
        # file only becomes most recent (one utime, no gather).
        evicted = [(b, h) for b, h in evicted if not self.stores[0].touch(h)]
        if not evicted:
            return
        with self._pending_lock:
            room = (self.max_pending_bytes - self._pending_bytes) // self.payload_bytes
            if room < len(evicted):
                self.stats.spills_dropped += len(evicted) - max(room, 0)
                evicted = evicted[: max(room, 0)]
            self._pending_bytes += len(evicted) * self.payload_bytes
        if not evicted:
            return
        # NOTE: one gather per layer, issued now (ordered before anything that rewrites the blocks);
        # waiting for the host copy, packing, checksums and files happen on the writer thread.
        self._jobs.put(_Job([h for _, h in evicted], self.copier.gather([b for b, _ in evicted])))

    def _write_loop(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                if job is None:
                    return
                self._write(job)
            except Exception:  # a full disk or a vanished directory loses cache entries, never the worker
                logger.exception("tier writer: a spill failed")
            finally:
                if job is not None:
                    with self._pending_lock:
                        self._pending_bytes -= len(job.hashes) * self.payload_bytes
                self._jobs.task_done()

    def _write(self, job: _Job) -> None:
        first = self.stores[0]
        stored: list[int] = []
        for j, h in enumerate(job.hashes):
            payload = job.payload if job.payload is not None else self._pack(job, j)
            if first.put(h, payload):
                stored.append(h)
                self._estimated_used[first.name] += first.file_bytes
        self.stats.blocks_spilled += len(stored)
        self.stats.bytes_written += len(stored) * first.file_bytes
        self._event(BlockStored, stored, first.name)
        self._sweep()

    def _event(self, kind: type[BlockStored] | type[BlockRemoved], hashes: list[int], tier: str) -> None:
        if self.pool is not None:  # NOTE: a tensor-parallel rank > 0's files are announced by its rank 0's
            self._events.append((kind, tuple(hashes), tier))

    def _pack(self, job: _Job, j: int) -> bytes:
        assert job.blocks is not None
        return job.blocks.payload(j)  # on CUDA: waits for the side stream's device->host copy

    def _sweep(self) -> None:
        """Keep every tier within its budget (LRU), demoting down the tiers. Runs when this writer's
        estimate says a tier is full, or once a second (other workers of the node write too)."""
        now = time.monotonic()
        due = now - self._last_sweep > 1.0
        if not due and all(self._estimated_used[s.name] <= s.capacity_bytes for s in self.stores):
            return
        self._last_sweep = now
        for i, store in enumerate(self.stores):
            ev = store.evict_to_budget()
            self._event(BlockRemoved, ev.removed, store.name)
            if ev.demoted and i + 1 < len(self.stores):
                self._event(BlockStored, ev.demoted, self.stores[i + 1].name)
            self._estimated_used[store.name] = store.used_bytes()

    # ---- load (engine thread) -----------------------------------------------------------------
    def load(self, block_hashes: Sequence[int], block_ids: Sequence[int]) -> list[str]:
        """Load the longest run of ``block_hashes`` found in the tiers into ``block_ids`` (fresh blocks).

        Stops at the first hash not found, not valid, or in a tier where loading does not pay.

        Returns:
            The tier of each block loaded, in order (``block_ids[:len(result)]`` now hold them).
        """
        self.spill_evicted()  # the fresh blocks may have been evicted just now: save them first
        tiers = [s.name for s in self.stores if self.always_load or self.cost.load_pays(s.name)]
        return self.load_run(block_hashes[: len(block_ids)], block_ids, tiers)

    def load_run(self, block_hashes: Sequence[int], block_ids: Sequence[int], tiers: Sequence[str]) -> list[str]:
        """``load``'s work once the tiers it may read (``tiers``, in order) are chosen: the longest run of
        ``block_hashes`` found, cut to what ``agree`` allows, written into ``block_ids``."""
        found: list[tuple[bytes, str]] = []
        t0 = time.perf_counter()
        for h in block_hashes[: len(block_ids)]:
            hit = self._find(h, tiers)
            if hit is None:
                break
            found.append(hit)
        found = found[: self.agree(len(found))]
        if not found:
            return []
        self._write_into(block_ids[: len(found)], [p for p, _ in found])
        # NOTE: on CUDA this times the read, the checks and the pinned staging, not the device copy, which
        # runs on the side stream meanwhile (the start-up probe, which synchronizes, times it whole).
        seconds = time.perf_counter() - t0
        tiers = [t for _, t in found]
        for tier, n in collections.Counter(tiers).items():
            self.cost.record_load(tier, n, seconds * n / len(found))
            self.stats.blocks_loaded[tier] += n
        self.stats.bytes_loaded += len(found) * self.payload_bytes
        self.stats.load_seconds += seconds
        for (payload, tier), h in zip(found, block_hashes, strict=False):
            if tier != self.stores[0].name:  # a lower tier's hit moves up again (the writer does it)
                with self._pending_lock:
                    self._pending_bytes += self.payload_bytes
                self._jobs.put(_Job([h], None, payload=payload))
        return tiers

    def agree(self, num_found: int) -> int:
        """How many of the ``num_found`` blocks found to load: all of them here; a tensor-parallel group's
        ranks load the run every rank found (its minimum), so the group never loads half a block."""
        return num_found

    def _find(self, block_hash: int, tiers: Sequence[str]) -> tuple[bytes, str] | None:
        for store in self.stores:
            if store.name not in tiers:
                continue
            payload = store.get(block_hash)
            if payload is not None:
                return payload, store.name
        return None

    def _write_into(self, block_ids: Sequence[int], payloads: list[bytes]) -> None:
        n = len(payloads)
        data = torch.frombuffer(bytearray(b"".join(payloads)), dtype=torch.uint8).view(n, -1)
        self.copier.scatter(block_ids, data)

    # ---- probe, events, lifecycle ---------------------------------------------------------------
    def probe(self, block_id: int) -> None:
        """Measure one block's load from each tier (write a probe file of ``block_id``'s content, time
        reading and writing it back, remove it). Call while ``block_id`` is free (at start-up)."""
        probe = _probe_hash()
        payload = self._pack(_Job([probe], self.copier.gather([block_id])), 0)
        for store in self.stores:
            store.put(probe, payload)
            try:
                for _ in range(2):  # the first read warms caches; the second is the measurement
                    t0 = time.perf_counter()
                    got = store.get(probe)
                    assert got is not None, f"{store.name} tier: probe block unreadable at {store.directory}"
                    self._write_into([block_id], [got])
                    self.copier.synchronize()  # the whole load, device copy included (CUDA: async)
                    seconds = time.perf_counter() - t0
                self.cost.record_load(store.name, 1, seconds)
            finally:
                store.path(probe).unlink(missing_ok=True)

    def publish_events(self) -> None:
        """Emit the writer's tier events into the pool's event stream (engine thread)."""
        assert self.pool is not None
        while self._events:
            kind, hashes, tier = self._events.popleft()
            self.pool.emit_tier_event(kind, hashes, tier)

    def tier_hashes(self) -> dict[str, list[int]]:
        """Every hash each tier holds now (for a snapshot)."""
        return {s.name: [h for h in s.hashes() if h >> 32 != 0xFFFF_FFFF] for s in self.stores}

    def used_bytes(self) -> dict[str, int]:
        """This writer's estimate of each tier's bytes (refreshed by every sweep)."""
        return dict(self._estimated_used)

    def report(self, hit_tokens: dict[str, int]) -> TierReport:
        """Usage, measured ratios and running totals; ``hit_tokens`` are the scheduler's per-tier hits."""
        used, total = self.used_bytes(), {s.name: s.capacity_bytes for s in self.stores}
        c = self.cost
        return TierReport(
            host_bytes_used=used.get("host", 0),
            host_bytes_capacity=total.get("host", 0),
            disk_bytes_used=used.get("disk", 0),
            disk_bytes_capacity=total.get("disk", 0),
            host_load_ratio=(c.ratio("host") or 0.0) if "host" in total else 0.0,
            disk_load_ratio=(c.ratio("disk") or 0.0) if "disk" in total else 0.0,
            recompute_ms_per_block=1e3 * (c.recompute_s_per_block() or 0.0),
            host_hit_tokens=hit_tokens.get("host", 0),
            disk_hit_tokens=hit_tokens.get("disk", 0),
            bytes_written=self.stats.bytes_written,
            bytes_loaded=self.stats.bytes_loaded,
            load_seconds=self.stats.load_seconds,
            spills_dropped=self.stats.spills_dropped,
        )

    def flush(self) -> None:
        """Wait until every spill so far is written (tests, shutdown)."""
        self._jobs.join()

    def close(self) -> None:
        """Finish pending writes and stop the writer."""
        self._jobs.put(None)
        self._writer.join()


@dataclass
class _Job:
    """Blocks for the writer: gathered host copies (``TierCopier.gather``) or one ready payload."""

    hashes: list[int]
    blocks: Gathered | None
    payload: bytes | None = None
