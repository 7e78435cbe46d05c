"""The host/disk KV tiers of a tensor-parallel group: each rank spills and loads its own KV heads of a block,
under the same block ids and hashes, to files of its own layout (``tp=rank/size`` in the layout string, so in
every file's name and header: shards of different ranks or group sizes never mix).

Rank 0 decides (its pool evicts, its scheduler asks for hashes, its cost model picks the tiers worth reading)
and broadcasts each decision before acting on it (``TIER_SPILL``, ``TIER_LOAD``); every rank then does the
same copies and file I/O on its shard, with its own writer thread. A load is agreed: each rank finds the run
of hashes it holds, the group loads the shortest (an all-reduce MIN), so a block is loaded on all ranks or
on none (a rank's spill may have been dropped or its file evicted when another rank's was not).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from kvserve.workers.engine.tiered_cache import TieredCache
from kvserve.workers.parallel import step_message


class GroupTieredCache(TieredCache):
    """One rank's tiers, built as a ``TieredCache`` with ``shard=(rank, size)`` (required here). On rank 0
    (``pool`` given) spills and loads are broadcast first; on the others (``pool`` None) ``follow`` calls
    ``spill`` and ``load_run`` as the messages arrive."""

    @property
    def rank(self) -> int:
        assert self.shard is not None, "GroupTieredCache needs shard=(rank, size)"
        return self.shard[0]

    def spill(self, evicted: list[tuple[int, int]]) -> None:
        if self.rank == 0:
            step_message.send_tier_spill(evicted, self.kv_cache.device)
        super().spill(evicted)

    def load_run(self, block_hashes: Sequence[int], block_ids: Sequence[int], tiers: Sequence[str]) -> list[str]:
        if self.rank == 0:
            n = min(len(block_hashes), len(block_ids))
            if n == 0 or not tiers:  # nothing to find on any rank: no message, no collective
                return []
            step_message.send_tier_load(list(block_hashes[:n]), list(block_ids[:n]), list(tiers), self.kv_cache.device)
        return super().load_run(block_hashes, block_ids, tiers)

    def flush(self) -> None:
        """Wait until every rank's spills so far are written (rank 0: all ranks'; a collective)."""
        if self.rank == 0:
            step_message.send_tier_flush(self.kv_cache.device)
        super().flush()
        dist.barrier()

    def agree(self, num_found: int) -> int:
        t = torch.tensor([num_found], dtype=torch.int64, device=self.kv_cache.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())
