"""Placement policy: which worker should run a request (pure: no Ray, no gRPC, no torch).

The router keeps one ``WorkerView`` per worker, built from the worker's last PressureReport plus
the blocks the router has promised since (``blocks_in_flight``), and asks ``Placement.choose``
for a worker. ``None`` means "fits nowhere right now" (the router queues the request);
``fits_anywhere_ever`` says whether waiting can ever help (if not: INVALID_ARGUMENT).

Block arithmetic, per worker ``w`` (block_size ``bs``):

* ``prompt_blocks = ceil(num_prompt_tokens / bs)``
* ``cached = min(prefix_hits(w, hashes), (num_prompt_tokens - 1) // bs)``: leading prompt blocks
  in w's prefix cache or about to be (pending). NOTE: at least the last prompt token is always
  computed (its logits pick the first output token), so a fully cached, block-aligned prompt
  still needs one. The cost counts ``prompt_blocks - cached`` as the prefill left.
* ``ready``: of those, the leading blocks cached *now* (``PrefixMatch.cached``; a plain int is
  taken as all cached now). A pending prefix is still being computed: a request placed now
  computes and holds its own copy, so the room check counts only ``ready`` blocks as hits.
* ``need = prompt_blocks - ready + decode_reserve_blocks``
* ``available = free + cached_evictable - min(idle_hits, cached_evictable) - blocks_in_flight
  - blocks_migrating_in`` (``room_for``)
* feasible iff ``need <= available`` and the whole sequence
  ``ceil((num_prompt_tokens + max_tokens) / bs) <= total_blocks`` (a request that can never hold
  all its blocks at once would be preempted forever on that worker).

``idle_hits`` are the request's ready blocks that sit in the worker's evictable pool (ref count 0):
the request reuses them, so they cannot also be evicted to hold its new blocks. ``prefix_hits`` may
return a ``PrefixMatch`` (router/prefix_index.py: an int that also carries ``cached`` and ``idle``,
the ready hits with no live placement holding them); for a plain int every hit is taken as ready
and possibly idle (the conservative bound on room). NOTE: hits held by a running request (ref
count > 0) are not in the evictable count, which is why the router's index says which are idle.

Ties (equal cost and load) go to the worker that ranks highest for the request's first block hash
under rendezvous hashing (``tie_rank``), not to the lowest id: on an idle cluster every new prefix
would otherwise land on the same worker, filling its cache while the others stay empty. Requests
without a full block fall back to the lowest id.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from workers.core.sizes import blocks_for

__all__ = [
    "Candidate", "CostModel", "Placement", "PlacementPolicy", "PlacementRequest", "WorkerView",
    "blocks_for", "room_for",
]  # fmt: skip

# (worker_id, prompt block hashes) -> number of leading hashes cached (or pending) on that worker; an int,
# or a router.prefix_index.PrefixMatch that also says how many are cached now and idle.
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
        names = (
            "total_blocks", "free_blocks", "cached_evictable_blocks", "running", "waiting", "blocks_in_flight",
            "used_blocks", "blocks_migrating_in", "blocks_migrating_out", "swap_blocks",
        )  # fmt: skip
        if min(getattr(self, n) for n in names) >= 0:  # NOTE: one check on the common path
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
        return self.committed_blocks / self.total_blocks if self.total_blocks else 0.0


@dataclass(frozen=True)
class PlacementRequest:
    """The shape of a request, as placement sees it.

    Attributes:
        num_prompt_tokens: prompt length (>= 1).
        block_hashes: hash chain of the prompt's full blocks (workers/core/block_hash.py).
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
        cached_blocks: leading prompt blocks cached or pending there (capped, see module doc).
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

    tie: int = 0  # -tie_rank: lower sorts first

    @property
    def load_key(self) -> tuple[float, int, int, str]:
        """Order by load: pool usage after placement, then requests, then the tie rank, then id."""
        return (self.usage_after, self.requests, self.tie, self.worker_id)


class PlacementPolicy(str, enum.Enum):
    KV_AWARE = "kv_aware"
    LEAST_LOADED = "least_loaded"
    ROUND_ROBIN = "round_robin"


@dataclass(frozen=True)
class CostModel:
    """Weights of the ``kv_aware`` cost, in *prefill blocks* (the time one block of prompt takes).

    The cost of placing a request on worker ``w`` estimates what the placement spends, in the one
    unit both cache affinity and load can be measured in:

    ``cost = overlap_weight * uncached + backlog + usage_weight * usage_after * prompt_blocks``

    * ``uncached = prompt_blocks - cached``: blocks this request prefills there. ``overlap_weight``
      (default 2) counts them twice: once as the request's own wait, once as the compute (and
      cache space, if the prefix lives elsewhere too) it takes from everyone behind it. NOTE: with 1
      the second request of a new prefix would already split off to an idle peer (its own TTFT is
      a few blocks shorter there) and every group would be computed on every worker.
    * ``backlog = blocks_in_flight + waiting_blocks * waiting + running_blocks * running``: the
      queueing delay the worker's backlog implies. ``blocks_in_flight`` is the prefill the router
      placed there that has not started yet (the router promises ``uncached + 1`` blocks per
      placement until the worker reports it started); a request ``waiting`` inside the worker
      could not be admitted (its compute or pool is saturated) and delays a newcomer by about one
      request's turn; a ``running`` request slows every engine step by one decode token. The
      backlog needs no throughput figure because every worker is charged in the same unit
      (NOTE: heterogeneous workers would divide it by their prefill rate).
    * ``usage_after``: the pool fraction committed after the placement: a full pool means
      preemptions, so fuller workers cost up to ``usage_weight`` of a full prefill more.

    Affinity yields to load by construction: a cached prefix saves ``overlap_weight * cached``
    blocks, so once the backlog of the worker holding it exceeds a peer's by more than that, the
    next request of the prefix goes to the peer and computes the prefix there (deliberate
    replication of a hot prefix; the pending-prefix index then makes both workers attract it and
    the load terms split it between them).

    Balance guard (after SGLang's cache-aware router): if the best-cost worker has
    ``balance_abs`` more requests (running + waiting) than the least-loaded feasible worker *and*
    more than ``balance_rel`` times as many, the request goes to the least-loaded one (reports lag:
    this bounds the pile-up whatever the weights).

    Raises:
        ValueError: a negative weight, ``balance_abs < 0`` or ``balance_rel < 1``.
    """

    overlap_weight: float = 2.0
    waiting_blocks: float = 8.0
    running_blocks: float = 1.0
    usage_weight: float = 0.5
    balance_abs: int = 16
    balance_rel: float = 2.0

    def __post_init__(self) -> None:
        for name in ("overlap_weight", "waiting_blocks", "running_blocks", "usage_weight"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.balance_abs < 0 or self.balance_rel < 1.0:
            raise ValueError(f"need balance_abs >= 0 and balance_rel >= 1, got {self.balance_abs}, {self.balance_rel}")

    def backlog(self, worker: WorkerView) -> float:
        """Queueing delay on ``worker`` in prefill blocks (see the class doc)."""
        return worker.blocks_in_flight + self.waiting_blocks * worker.waiting + self.running_blocks * worker.running

    def overloaded(self, load: int, least_load: int) -> bool:
        """Whether a worker with ``load`` requests is too far above the least-loaded one's ``least_load``."""
        return load - least_load > self.balance_abs and load > self.balance_rel * least_load


class Placement:
    """Chooses a worker for a request.

    Policies (all consider only healthy, feasible workers, see the module doc):

    * ``kv_aware`` (default): minimise ``CostModel``'s cost (prefill saved vs queueing delay), then
      the balance guard; ties go to the lower load, then ``tie_rank``, then the id.
    * ``least_loaded``: minimise ``(usage_after, running + waiting, -tie_rank, worker_id)``.
    * ``round_robin``: the next feasible worker after the last choice, in id order.

    Args:
        policy: a ``PlacementPolicy`` or its string value.
        cost: the ``kv_aware`` weights; ``overlap_weight`` / ``running_weight`` / ``waiting_weight``
            override its ``overlap_weight`` / ``running_blocks`` / ``waiting_blocks``.

    Raises:
        ValueError: unknown policy or a negative weight.
    """

    def __init__(
        self,
        policy: PlacementPolicy | str = PlacementPolicy.KV_AWARE,
        *,
        cost: CostModel | None = None,
        overlap_weight: float | None = None,
        running_weight: float | None = None,
        waiting_weight: float | None = None,
    ) -> None:
        self.policy = PlacementPolicy(policy)
        model = cost or CostModel()
        overrides = {
            name: value
            for name, value in (
                ("overlap_weight", overlap_weight),
                ("running_blocks", running_weight),
                ("waiting_blocks", waiting_weight),
            )
            if value is not None
        }
        self.cost = dataclasses.replace(model, **overrides) if overrides else model
        self._last_rr: str | None = None

    def candidates(
        self, request: PlacementRequest, workers: Sequence[WorkerView], prefix_hits: PrefixHits
    ) -> list[Candidate]:
        """Every healthy worker the request fits now, scored, best first for the policy.

        For ``round_robin`` the order is the rotation order starting after the last choice
        (this call does not advance the rotation; ``choose`` does). For ``kv_aware`` a worker the
        balance guard rules out comes after the others.

        Raises:
            ValueError: two views share a worker_id.
        """
        _check_unique(workers)
        found = [c for w in workers if (c := self._evaluate(request, w, prefix_hits)) is not None]
        if self.policy is PlacementPolicy.KV_AWARE:
            least = min((c.requests for c in found), default=0)
            found.sort(key=lambda c: (self.cost.overloaded(c.requests, least), c.cost, *c.load_key))
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
            prefix_hits: leading-hash overlap lookup, e.g. ``PrefixIndex.affinity`` (a ``PrefixMatch``
                also says how many of the hits are idle cached blocks; a plain int is taken as
                all of them possibly idle, see the module doc).

        Returns:
            A worker_id, or None ("not now": queue and retry when pressure changes).

        Raises:
            ValueError: two views share a worker_id.
        """
        if self.policy is PlacementPolicy.ROUND_ROBIN:
            ranked = self.candidates(request, workers, prefix_hits)
            if not ranked:
                return None
            self._last_rr = ranked[0].worker_id
            return ranked[0].worker_id
        # NOTE: the hot path (once per request per worker): ``_score`` inlined and the order of
        # ``candidates`` without a Candidate per worker, the tie rank only computed among exact ties
        # (test_placement_affinity and test_placement_cost check choose == candidates[0]).
        _check_unique(workers)
        kv_aware = self.policy is PlacementPolicy.KV_AWARE
        hashes = request.block_hashes
        n_tokens, reserve, n_hashes = request.num_prompt_tokens, request.decode_reserve_blocks, len(hashes)
        m = self.cost
        w_overlap, w_wait, w_run, w_usage = m.overlap_weight, m.waiting_blocks, m.running_blocks, m.usage_weight
        scored: list[tuple[tuple[float, ...], str, int]] = []
        for w in workers:
            total, bs = w.total_blocks, w.block_size
            if not w.healthy or total == 0 or -(-(n_tokens + request.max_tokens) // bs) > total:
                continue
            prompt_blocks = -(-n_tokens // bs)
            cached = ready = idle = 0
            if hashes:
                hits = prefix_hits(w.worker_id, hashes)
                cached = max(0, min(hits, n_hashes, (n_tokens - 1) // bs))
                ready = min(cached, getattr(hits, "cached", cached))
                idle = min(ready, getattr(hits, "idle", ready))
            need = prompt_blocks - ready + reserve
            evictable = w.cached_evictable_blocks
            available = (
                w.free_blocks + evictable - min(idle, evictable) - w.blocks_in_flight - w.blocks_migrating_in
            )  # room_for
            if need > available:
                continue
            usage_after = min(1.0, (total - available + need) / total)
            load = w.running + w.waiting
            if kv_aware:
                cost = (
                    w_overlap * (prompt_blocks - cached)
                    + w.blocks_in_flight + w_wait * w.waiting + w_run * w.running
                    + w_usage * usage_after * prompt_blocks
                )  # fmt: skip
                key: tuple[float, ...] = (cost, usage_after, load)
            else:
                key = (usage_after, load)
            scored.append((key, w.worker_id, load))
        if not scored:
            return None
        if kv_aware:
            least = min(load for _, _, load in scored)
            overloaded = m.overloaded
            scored = [((overloaded(load, least), *key), wid, load) for key, wid, load in scored]
        best_key = min(key for key, _, _ in scored)
        best = [wid for key, wid, _ in scored if key == best_key]
        if len(best) == 1:
            return best[0]
        return min(best, key=lambda worker_id: (-tie_rank(hashes, worker_id), worker_id))

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
        scored = self._score(request, worker, prefix_hits)
        if scored is None:
            return None
        cached, need, usage_after, cost = scored
        return Candidate(
            worker_id=worker.worker_id,
            cached_blocks=cached,
            blocks_needed=need,
            usage_after=usage_after,
            requests=worker.running + worker.waiting,
            cost=cost,
            tie=-tie_rank(request.block_hashes, worker.worker_id),
        )

    def _score(
        self, request: PlacementRequest, worker: WorkerView, prefix_hits: PrefixHits
    ) -> tuple[int, int, float, float] | None:
        """``(cached, need, usage_after, cost)`` on ``worker`` (module doc), or None if it does not fit now."""
        if not worker.healthy or worker.total_blocks == 0:
            return None
        bs = worker.block_size
        if request.blocks_needed_ever(bs) > worker.total_blocks:
            return None
        prompt_blocks = blocks_for(request.num_prompt_tokens, bs)
        cached = ready = idle = 0
        if request.block_hashes:
            hits = prefix_hits(worker.worker_id, request.block_hashes)
            cached = max(0, min(hits, len(request.block_hashes), (request.num_prompt_tokens - 1) // bs))
            ready = min(cached, getattr(hits, "cached", cached))
            idle = min(ready, getattr(hits, "idle", ready))
        need = prompt_blocks - ready + request.decode_reserve_blocks
        available = room_for(worker, idle)
        if need > available:
            return None
        usage_after = min(1.0, (worker.total_blocks - available + need) / worker.total_blocks)
        model = self.cost
        cost = (
            model.overlap_weight * (prompt_blocks - cached)
            + model.backlog(worker)
            + model.usage_weight * usage_after * prompt_blocks
        )
        return cached, need, usage_after, cost


def room_for(worker: WorkerView, idle_hits: int) -> int:
    """Blocks ``worker`` can allocate to a request that hits ``idle_hits`` of its idle cached blocks.

    ``available_blocks`` counts every cached-evictable block as allocatable, but the ones the
    request hits are reused, not evicted: they cannot also hold its new blocks (module doc).
    """
    return worker.available_blocks - min(idle_hits, worker.cached_evictable_blocks)


def _check_unique(workers: Sequence[WorkerView]) -> None:
    if len({w.worker_id for w in workers}) == len(workers):
        return
    ids = sorted(w.worker_id for w in workers)
    for a, b in itertools.pairwise(ids):
        if a == b:
            raise ValueError(f"duplicate worker_id {a!r} in placement views")
