"""What placement reads: one ``WorkerView`` per worker, the request's ``PlacementRequest`` shape, and
the prefix lookup (``PrefixHits`` answering a ``PrefixMatch``). Pure: no Ray, no gRPC, no torch."""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvserve.workers.core.sizes import blocks_for, pool_usage


class PrefixMatch(int):
    """A prefix match length (an ``int``: ``affinity``'s answer, leading blocks cached *or* pending)
    that also says how many of the leading blocks the worker can hit *now*:

    * ``cached``: leading blocks cached on the worker now (``overlap``); the rest of the match is
      pending, i.e. still being computed by a request placed there. NOTE: a worker only hits
      blocks already computed, so a request that arrives while the prefix is in prefill computes
      (and holds) its own copy: placement's room check must count those blocks as needed.
    * ``idle``: of ``cached``, those with no live placement on the worker holding them, i.e. (as
      far as the router knows) in its evictable pool: a request reuses them, so they are not also
      free room for its new blocks (kvserve/router/policy/placement.py ``room_for``).
    * ``host``, ``disk``: the blocks right after the match that the worker's node holds in its host
      tier, then those (after the host run) in its disk tier (docs/architecture.md §3a): the worker
      loads them into fresh blocks instead of computing them, at the cost its reports measure.

    NOTE: an int subclass so that ``affinity`` keeps the ``PrefixHits`` contract
    (``(worker_id, hashes) -> int``) every caller relies on.

    Raises:
        ValueError: unless ``0 <= idle <= cached <= value``.
    """

    cached: int
    idle: int
    host: int
    disk: int

    def __new__(cls, value: int, cached: int, idle: int, host: int = 0, disk: int = 0) -> PrefixMatch:
        if not 0 <= idle <= cached <= value or min(host, disk) < 0:
            raise ValueError(f"need 0 <= idle <= cached <= matched and tier runs >= 0, got {idle}, {cached}, "
                             f"{value}, {host}, {disk}")  # fmt: skip
        match = super().__new__(cls, value)
        match.cached = cached
        match.idle = idle
        match.host = host
        match.disk = disk
        return match


# (worker_id, prompt block hashes) -> leading hashes cached (or pending) on that worker: a ``PrefixMatch``
# (router/policy/prefix_index.py ``PrefixIndex.affinity``), or a plain int meaning "all of them cached now and idle".
PrefixHits = Callable[[str, Sequence[int]], int]


def tie_rank(block_hashes: Sequence[int], worker_id: str) -> int:
    """Rendezvous rank of ``worker_id`` for a prompt (higher wins a tie); 0 for a prompt without blocks.

    Stable across processes (crc32, not Python's salted ``hash``), so a restarted router breaks ties
    the same way, and a prefix's ties always go to the same worker while different prefixes spread.
    """
    if not block_hashes:
        return 0
    return zlib.crc32(f"{block_hashes[0]}:{worker_id}".encode())


@dataclass(frozen=True)
class WorkerView:
    """What placement knows about one worker.

    Attributes:
        worker_id: unique id.
        healthy: False excludes the worker from placement (not from ``fits_anywhere_ever``).
        block_size: tokens per KV block.
        total_blocks: device KV blocks in the worker's pool.
        free_blocks: blocks with no content (from the last report).
        cached_evictable_blocks: ref-count-0 blocks kept for prefix reuse; evictable on demand.
        running: requests the worker is decoding.
        waiting: requests queued inside the worker.
        blocks_in_flight: blocks the router promised to requests placed on this worker that the
            last report does not yet reflect.
        used_blocks: blocks held by requests (ref count > 0), from the last report.
        reported: False until the first report arrives (the counts above are then defaults).
        blocks_migrating_in: blocks of requests migrated here that the last report does not
            reflect yet (kvserve/router/policy/rebalance.py ``MigrationLedger``).
        blocks_migrating_out: blocks of requests migrated away that the last report still counts.
        swap_blocks: host swap space, in blocks (0 = the worker cannot swap).
        host_credit: what loading one block from the node's host tier saves there, as a fraction of
            computing it: ``1 - load/recompute`` as the worker measured it (0 = no tier, unmeasured,
            or loading does not pay).
        disk_credit: the same for the disk tier.

    Raises:
        ValueError: non-positive block_size or a negative count.
    """

    worker_id: str
    healthy: bool
    block_size: int
    total_blocks: int
    free_blocks: int
    cached_evictable_blocks: int = 0
    running: int = 0
    waiting: int = 0
    blocks_in_flight: int = 0
    used_blocks: int = 0
    reported: bool = True
    blocks_migrating_in: int = 0
    blocks_migrating_out: int = 0
    swap_blocks: int = 0
    host_credit: float = 0.0
    disk_credit: float = 0.0

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"{self.worker_id}: block_size must be positive, got {self.block_size}")
        names = (
            "total_blocks", "free_blocks", "cached_evictable_blocks", "running", "waiting", "blocks_in_flight",
            "used_blocks", "blocks_migrating_in", "blocks_migrating_out", "swap_blocks",
        )  # fmt: skip
        # NOTE: one check on the common path (a view per worker per placed request): an OR of ints is
        # negative exactly when one of them is
        if (self.total_blocks | self.free_blocks | self.cached_evictable_blocks | self.running | self.waiting
                | self.blocks_in_flight | self.used_blocks | self.blocks_migrating_in | self.blocks_migrating_out
                | self.swap_blocks) >= 0:  # fmt: skip
            return
        for name in names:
            if getattr(self, name) < 0:
                raise ValueError(f"{self.worker_id}: {name} must be >= 0, got {getattr(self, name)}")

    @property
    def available_blocks(self) -> int:
        """Blocks a new request could take now: free + evictable - promised - migrating in (may be
        negative). NOTE: blocks migrating out are not counted as available before a report shows
        them freed (placing on them early could overcommit if the export is undone)."""
        return self.free_blocks + self.cached_evictable_blocks - self.blocks_in_flight - self.blocks_migrating_in

    @property
    def committed_blocks(self) -> int:
        """Blocks held by requests once the migrations the last report misses have landed."""
        return max(0, self.used_blocks + self.blocks_migrating_in - self.blocks_migrating_out)

    @property
    def usage(self) -> float:
        """``committed_blocks / total_blocks`` (0 for an empty pool)."""
        return pool_usage(self.committed_blocks, self.total_blocks)


@dataclass(frozen=True)
class PlacementRequest:
    """The shape of a request, as placement sees it.

    Attributes:
        num_prompt_tokens: prompt length (>= 1).
        block_hashes: hash chain of the prompt's full blocks (kvserve/workers/core/block_hash.py).
        max_tokens: output tokens the request may generate (>= 1).
        decode_reserve_blocks: blocks kept free beyond the prompt so decoding can start (>= 0).

    Raises:
        ValueError: a field out of range.
    """

    num_prompt_tokens: int
    block_hashes: tuple[int, ...] = ()
    max_tokens: int = 1
    decode_reserve_blocks: int = 1

    def __post_init__(self) -> None:
        if self.num_prompt_tokens < 1:
            raise ValueError(f"num_prompt_tokens must be >= 1, got {self.num_prompt_tokens}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.decode_reserve_blocks < 0:
            raise ValueError(f"decode_reserve_blocks must be >= 0, got {self.decode_reserve_blocks}")
        object.__setattr__(self, "block_hashes", tuple(self.block_hashes))

    def blocks_needed_ever(self, block_size: int) -> int:
        """Blocks the whole sequence (prompt + max_tokens) holds at its longest."""
        return blocks_for(self.num_prompt_tokens + self.max_tokens, block_size)
