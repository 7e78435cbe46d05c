"""The ``kv_aware`` policy's weights and balance guard, in prefill blocks (pure)."""

from __future__ import annotations

from dataclasses import dataclass


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

    def overloaded(self, load: int, least_load: int) -> bool:
        """Whether a worker with ``load`` requests is too far above the least-loaded one's ``least_load``."""
        return load - least_load > self.balance_abs and load > self.balance_rel * least_load
