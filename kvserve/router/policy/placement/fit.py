"""Filter: whether a request fits a worker now, and the one computation of its hits, room and promised_blocks.

Block arithmetic, per worker ``w`` (block_size ``bs``):

* ``prompt_blocks = ceil(num_prompt_tokens / bs)``
* ``cached = min(prefix_hits(w, hashes), (num_prompt_tokens - 1) // bs)``: leading prompt blocks
  in w's prefix cache or about to be (pending). NOTE: at least the last prompt token is always
  computed (its logits pick the first output token), so a fully cached, block-aligned prompt
  still needs one. The scorers count ``prompt_blocks - cached`` as the prefill left.
* ``ready``: of those, the leading blocks cached *now* (``PrefixMatch.cached``; a plain int is
  taken as all cached now). A pending prefix is still being computed: a request placed now
  computes and holds its own copy, so the room check counts only ``ready`` blocks as hits.
* ``tier_saved``: the prompt blocks after ``cached`` that w's node holds in its host or disk tier
  (``PrefixMatch.host`` / ``.disk``), each worth its tier's measured credit
  (``WorkerView.host_credit``: ``1 - load/recompute``), in prefill blocks. Loaded blocks land in
  fresh blocks, so they are part of ``promised_blocks``.
* ``promised_blocks = prompt_blocks - ready + decode_reserve_blocks``: what the placement promises.
* ``available = free + cached_evictable - min(idle_hits, cached_evictable) - blocks_in_flight
  - blocks_migrating_in`` (``room_for``)
* feasible iff ``promised_blocks <= available`` and the whole sequence
  ``ceil((num_prompt_tokens + max_tokens) / bs) <= total_blocks`` (a request that can never hold
  all its blocks at once would be preempted forever on that worker).

``idle_hits`` are the request's ready blocks that sit in the worker's evictable pool (ref count 0):
the request reuses them, so they cannot also be evicted to hold its new blocks. NOTE: hits held by
a running request (ref count > 0) are not in the evictable count, which is why the router's index
says which are idle.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvserve.router.policy.placement.views import PlacementRequest, PrefixHits, PrefixMatch, WorkerView
from kvserve.workers.core.sizes import blocks_for


@dataclass(frozen=True, slots=True)
class Fit:
    """How a request fits one worker now (module doc): the numbers every scorer and the router share.

    Attributes:
        prompt_blocks: blocks of the prompt.
        cached: leading prompt blocks cached or pending there (capped).
        promised_blocks: blocks the placement takes there (the router promises exactly these).
        available: room there before the placement.
        usage_after: fraction of the pool committed after the placement, 0..1.
        tier_saved: prefill blocks the node's host/disk tiers save there (module doc).
    """

    prompt_blocks: int
    cached: int
    promised_blocks: int
    available: int
    usage_after: float
    tier_saved: float = 0.0


def prefix_match(hits: int) -> PrefixMatch:
    """``hits`` as a ``PrefixMatch``; a plain int counts as that many blocks cached now and idle."""
    return hits if isinstance(hits, PrefixMatch) else PrefixMatch(hits, hits, hits)


def fit(request: PlacementRequest, worker: WorkerView, prefix_hits: PrefixHits) -> Fit | None:
    """``request`` on ``worker`` now (module doc), or None if the worker is unhealthy or lacks room."""
    total, bs = worker.total_blocks, worker.block_size
    if not worker.healthy or total == 0 or request.blocks_needed_ever(bs) > total:
        return None
    n_tokens, hashes = request.num_prompt_tokens, request.block_hashes
    prompt_blocks = blocks_for(n_tokens, bs)
    cached = ready = idle = 0
    tier_saved = 0.0
    if hashes:
        match = prefix_match(prefix_hits(worker.worker_id, hashes))
        cap = min(len(hashes), (n_tokens - 1) // bs)
        cached = max(0, min(match, cap))
        ready = min(cached, match.cached)
        idle = min(ready, match.idle)
        host = max(0, min(match.host, cap - cached))
        disk = max(0, min(match.disk, cap - cached - host))
        tier_saved = host * worker.host_credit + disk * worker.disk_credit
    promised_blocks = prompt_blocks - ready + request.decode_reserve_blocks
    available = room_for(worker, idle)
    if promised_blocks > available:
        return None
    usage_after = min(1.0, (total - available + promised_blocks) / total)
    return Fit(prompt_blocks, cached, promised_blocks, available, usage_after, tier_saved)


def room_for(worker: WorkerView, idle_hits: int) -> int:
    """Blocks ``worker`` can allocate to a request that hits ``idle_hits`` of its idle cached blocks.

    ``available_blocks`` counts every cached-evictable block as allocatable, but the ones the
    request hits are reused, not evicted: they cannot also hold its new blocks (module doc).
    """
    return worker.available_blocks - min(idle_hits, worker.cached_evictable_blocks)


def fits_anywhere_ever(request: PlacementRequest, workers: Sequence[WorkerView]) -> bool:
    """Whether the whole sequence fits some worker's total pool, healthy or not.

    False means waiting can never help: reject with INVALID_ARGUMENT. Vacuously True with
    no workers: there is no pool to measure against (the caller reports UNAVAILABLE or
    queues instead).
    """
    if not workers:
        return True
    return any(request.blocks_needed_ever(w.block_size) <= w.total_blocks for w in workers)
