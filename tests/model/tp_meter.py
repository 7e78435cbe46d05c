"""A ``MemoryMeter`` (kvserve/workers/engine/memory_budget.py) whose figures the test gives per rank: the
sizing of a tensor-parallel group runs on CPU through the code CUDA runs, with each rank reading "its card".
Imported by the group's other ranks too (pickled by reference), so it lives in a module of its own."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True)
class RankMeter:
    """Rank r's card has ``totals[r]`` bytes, ``frees[r]`` free; every profiled step peaks at ``peak`` bytes."""

    totals: tuple[int, ...]
    frees: tuple[int, ...]
    peak: int

    def start_peak(self) -> int:
        return 0

    def peak_since(self, start: int) -> int:
        return self.peak

    def free_total(self) -> tuple[int, int]:
        rank = dist.get_rank()
        return self.frees[rank], self.totals[rank]
