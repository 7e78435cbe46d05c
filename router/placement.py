"""Placement policy: which worker should run a request (pure: no Ray, no gRPC, no torch).

The router keeps one ``WorkerView`` per worker, built from the worker's last PressureReport plus
the blocks the router has promised since (``blocks_in_flight``), and asks ``Placement.choose``
for a worker. ``None`` means "fits nowhere right now" (the router queues the request);
``fits_anywhere_ever`` says whether waiting can ever help (if not: INVALID_ARGUMENT).

Block arithmetic, per worker ``w`` (block_size ``bs``):

* ``prompt_blocks = ceil(num_prompt_tokens / bs)``
* ``cached = min(prefix_hits(w, hashes), (num_prompt_tokens - 1) // bs)``: leading prompt blocks
  already in w's prefix cache. NOTE: at least the last prompt token is always computed (its
  logits pick the first output token), so a fully cached, block-aligned prompt still needs one.
* ``need = prompt_blocks - cached + decode_reserve_blocks``
* ``available = free + cached_evictable - blocks_in_flight``
* feasible iff ``need <= available`` and the whole sequence
  ``ceil((num_prompt_tokens + max_tokens) / bs) <= total_blocks`` (a request that can never hold
  all its blocks at once would be preempted forever on that worker).

NOTE: ``available`` counts evictable cached blocks as allocatable even when they are the very
blocks this request hits, so it may overestimate by up to ``cached`` blocks; the worker's own
scheduler has the final word (it queues rather than fails), so the router errs towards placing.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from workers.block_pool import blocks_for

__all__ = ["Candidate", "Placement", "PlacementPolicy", "PlacementRequest", "WorkerView", "blocks_for"]

# (worker_id, prompt block hashes) -> number of leading hashes cached on that worker.
PrefixHits = Callable[[str, Sequence[int]], int]


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
            reflect yet (router/rebalance.py ``MigrationLedger``).
        blocks_migrating_out: blocks of requests migrated away that the last report still counts.
        swap_blocks: host swap space, in blocks (0 = the worker cannot swap).

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

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"{self.worker_id}: block_size must be positive, got {self.block_size}")
        for name in (
            "total_blocks",
            "free_blocks",
            "cached_evictable_blocks",
            "running",
            "waiting",
            "blocks_in_flight",
            "used_blocks",
            "blocks_migrating_in",
            "blocks_migrating_out",
            "swap_blocks",
        ):
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
        return self.committed_blocks / self.total_blocks if self.total_blocks else 0.0


@dataclass(frozen=True)
class PlacementRequest:
    """The shape of a request, as placement sees it.

    Attributes:
        num_prompt_tokens: prompt length (>= 1).
        block_hashes: hash chain of the prompt's full blocks (workers/block_hash.py).
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


@dataclass(frozen=True)
class Candidate:
    """A feasible worker and how placement scored it (lower ``cost`` is better).

    Attributes:
        worker_id: the worker.
        cached_blocks: leading prompt blocks already cached there (capped, see module doc).
        blocks_needed: blocks placing the request there takes (``need`` in the module doc).
        usage_after: fraction of the pool committed after placing it there, 0..1.
        requests: running + waiting requests on the worker.
        cost: the policy's score; only meaningful for ``kv_aware``.
    """

    worker_id: str
    cached_blocks: int
    blocks_needed: int
    usage_after: float
    requests: int
    cost: float

    @property
    def load_key(self) -> tuple[float, int, str]:
        """Order by load: pool usage after placement, then requests, then id."""
        return (self.usage_after, self.requests, self.worker_id)


class PlacementPolicy(str, enum.Enum):
    KV_AWARE = "kv_aware"
    LEAST_LOADED = "least_loaded"
    ROUND_ROBIN = "round_robin"


class Placement:
    """Chooses a worker for a request.

    Policies (all consider only healthy, feasible workers, see the module doc):

    * ``kv_aware`` (default): minimise
      ``cost = overlap_weight * uncached_fraction + usage_after
      + running_weight * running + waiting_weight * waiting``
      where ``uncached_fraction = (prompt_blocks - cached) / prompt_blocks`` (prefill work left)
      and ``usage_after`` is the pool fraction committed after placing the request there
      (``(total - available + need) / total``). With the defaults a fully cached prompt is worth
      as much as a completely empty pool. Ties go to the lower load, then the lower id.
    * ``least_loaded``: minimise ``(usage_after, running + waiting, worker_id)``.
    * ``round_robin``: the next feasible worker after the last choice, in id order.

    Args:
        policy: a ``PlacementPolicy`` or its string value.
        overlap_weight, running_weight, waiting_weight: ``kv_aware`` weights (>= 0).

    Raises:
        ValueError: unknown policy or a negative weight.
    """

    def __init__(
        self,
        policy: PlacementPolicy | str = PlacementPolicy.KV_AWARE,
        *,
        overlap_weight: float = 1.0,
        running_weight: float = 0.005,
        waiting_weight: float = 0.02,
    ) -> None:
        self.policy = PlacementPolicy(policy)
        for name, value in (
            ("overlap_weight", overlap_weight),
            ("running_weight", running_weight),
            ("waiting_weight", waiting_weight),
        ):
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        self.overlap_weight = overlap_weight
        self.running_weight = running_weight
        self.waiting_weight = waiting_weight
        self._last_rr: str | None = None

    def candidates(
        self, request: PlacementRequest, workers: Sequence[WorkerView], prefix_hits: PrefixHits
    ) -> list[Candidate]:
        """Every healthy worker the request fits now, scored, best first for the policy.

        For ``round_robin`` the order is the rotation order starting after the last choice
        (this call does not advance the rotation; ``choose`` does).

        Raises:
            ValueError: two views share a worker_id.
        """
        _check_unique(workers)
        found = [c for w in workers if (c := self._evaluate(request, w, prefix_hits)) is not None]
        if self.policy is PlacementPolicy.KV_AWARE:
            found.sort(key=lambda c: (c.cost, *c.load_key))
        elif self.policy is PlacementPolicy.LEAST_LOADED:
            found.sort(key=lambda c: c.load_key)
        else:
            found.sort(key=lambda c: c.worker_id)
            if self._last_rr is not None:
                after = [c for c in found if c.worker_id > self._last_rr]
                found = after + [c for c in found if c.worker_id <= self._last_rr]
        return found

    def choose(self, request: PlacementRequest, workers: Sequence[WorkerView], prefix_hits: PrefixHits) -> str | None:
        """The worker to place ``request`` on, or None if it fits no healthy worker now.

        Args:
            request: the request's shape.
            workers: current views (the caller adds each placement to ``blocks_in_flight``).
            prefix_hits: leading-hash overlap lookup, e.g. ``PrefixIndex.overlap``.

        Returns:
            A worker_id, or None ("not now": queue and retry when pressure changes).

        Raises:
            ValueError: two views share a worker_id.
        """
        ranked = self.candidates(request, workers, prefix_hits)
        if not ranked:
            return None
        if self.policy is PlacementPolicy.ROUND_ROBIN:
            self._last_rr = ranked[0].worker_id
        return ranked[0].worker_id

    @staticmethod
    def fits_anywhere_ever(request: PlacementRequest, workers: Sequence[WorkerView]) -> bool:
        """Whether the whole sequence fits some worker's total pool, healthy or not.

        False means waiting can never help: reject with INVALID_ARGUMENT. Vacuously True with
        no workers: there is no pool to measure against (the caller reports UNAVAILABLE or
        queues instead).
        """
        if not workers:
            return True
        return any(request.blocks_needed_ever(w.block_size) <= w.total_blocks for w in workers)

    def _evaluate(self, request: PlacementRequest, worker: WorkerView, prefix_hits: PrefixHits) -> Candidate | None:
        if not worker.healthy or worker.total_blocks == 0:
            return None
        bs = worker.block_size
        if request.blocks_needed_ever(bs) > worker.total_blocks:
            return None
        prompt_blocks = blocks_for(request.num_prompt_tokens, bs)
        cached = 0
        if request.block_hashes:
            hits = prefix_hits(worker.worker_id, request.block_hashes)
            cached = max(0, min(hits, len(request.block_hashes), (request.num_prompt_tokens - 1) // bs))
        need = prompt_blocks - cached + request.decode_reserve_blocks
        available = worker.available_blocks
        if need > available:
            return None
        usage_after = min(1.0, (worker.total_blocks - available + need) / worker.total_blocks)
        cost = (
            self.overlap_weight * (prompt_blocks - cached) / prompt_blocks
            + usage_after
            + self.running_weight * worker.running
            + self.waiting_weight * worker.waiting
        )
        return Candidate(
            worker_id=worker.worker_id,
            cached_blocks=cached,
            blocks_needed=need,
            usage_after=usage_after,
            requests=worker.running + worker.waiting,
            cost=cost,
        )


def _check_unique(workers: Sequence[WorkerView]) -> None:
    ids = sorted(w.worker_id for w in workers)
    for a, b in itertools.pairwise(ids):
        if a == b:
            raise ValueError(f"duplicate worker_id {a!r} in placement views")
