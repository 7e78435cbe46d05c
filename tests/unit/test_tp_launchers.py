"""The rank launchers' choice and the device each rank takes (kvserve/workers/parallel/launchers.py, group.py),
and the soft target nodes of ``--spread`` with tensor parallelism (kvserve/cluster/launch.py)."""

from __future__ import annotations

import subprocess
import sys

import torch

from kvserve.cluster.launch import spread_targets
from kvserve.workers.parallel.group import rank_device
from kvserve.workers.parallel.launchers import LAUNCHERS, ProcessRanks, RayActorRanks


def test_rank_device_own_card_or_the_machines() -> None:
    cuda = torch.device("cuda")
    assert rank_device(cuda, 2) == torch.device("cuda", 2)  # child processes see the machine's cards
    assert rank_device(cuda, 2, own_device=True) == torch.device("cuda", 0)  # a Ray actor sees its own only
    assert rank_device(torch.device("cpu"), 2, own_device=True) == torch.device("cpu")


def test_launcher_registry() -> None:
    assert LAUNCHERS == {"processes": ProcessRanks, "ray_actors": RayActorRanks}
    assert not ProcessRanks.own_device and RayActorRanks.own_device


def test_without_ray_the_ranks_are_processes_and_ray_is_not_imported() -> None:
    code = ("import sys; from kvserve.workers.parallel.launchers import for_this_process, launcher_kind; "
            "r = for_this_process(2); print(launcher_kind(), type(r).__name__, r.host, 'ray' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["processes", "ProcessRanks", "127.0.0.1", "False"]


def test_spread_targets_round_robin() -> None:
    assert spread_targets(["a", "b"], 5) == ["a", "b", "a", "b", "a"]
    assert spread_targets([], 2) == [None, None]
