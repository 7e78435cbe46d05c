"""Starting ranks 1..N-1 of a tensor-parallel group: one small interface (``RankLauncher``), two variants.

- ``ray_actors`` (``RayActorRanks``): rank 0 runs in a Ray actor scheduled into bundle 0 of its worker's
  placement group (STRICT_PACK, N bundles: kvserve/cluster/launch.py); rank r is a ``rank_actor.RankActor`` in
  bundle r, so Ray reserved every rank's GPU (or CPUs) and put them on one node. On CUDA each actor sees only
  its own card (Ray sets its CUDA_VISIBLE_DEVICES): every rank uses ``cuda:0``. The rendezvous is rank 0's
  node IP.
- ``processes`` (``ProcessRanks``): without Ray (tests, ``LLM(...)``, the GPU check script) rank r is a child
  process (``python -m kvserve.workers.parallel.follower``) of this machine using ``cuda:r``; rendezvous on
  loopback.

``for_this_process`` picks: a process inside a Ray actor with a placement group gets ``ray_actors``, any other
``processes``. Both run the same follower loop (``follower.run``) and report a dead rank the same way: rank 0's
next collective fails (the worker's liveness rule restarts the group as a whole).
"""

from __future__ import annotations

import logging
import os
import pickle
import subprocess
import sys
import uuid
from collections.abc import Callable
from typing import Any, Protocol

import torch

logger = logging.getLogger(__name__)

ACTOR_NAME_PREFIX = "kvserve-tp"  # a rank actor's name: ``kvserve-tp:<placement group id>:<start>:rank<r>``
STOP_WAIT_S = 30.0  # how long ``stop`` waits for the ranks to end after STOP before killing them

# The arguments of ``follower.run`` for one rank (``args_of(rank)``).
ArgsOf = Callable[[int], tuple]


class RankLauncher(Protocol):
    """Starts and ends ranks 1..N-1 of one group (rank 0 is the caller)."""

    host: str  # where rank 0 listens for the rendezvous (the group is on one node)
    own_device: bool  # each rank sees only its own CUDA card (cuda:0) rather than the machine's (cuda:rank)

    def check(self, device: torch.device) -> None:
        """Raise ValueError if the group cannot run here."""

    def start(self, args_of: ArgsOf) -> None:
        """Start ranks 1..N-1, each running ``follower.run(*args_of(rank))``."""

    def alive(self) -> bool:
        """Whether every rank started is still running."""

    def stop(self, timeout_s: float = STOP_WAIT_S) -> None:
        """After STOP was sent: wait (at most ``timeout_s``) for the ranks to end, then end any left."""

    def kill(self) -> None:
        """End every rank at once (start-up failed part-way)."""


class ProcessRanks:
    """Ranks as child processes of this one, on this machine's devices."""

    host = "127.0.0.1"
    own_device = False

    def __init__(self, size: int) -> None:
        self.size = size
        self.processes: list[subprocess.Popen] = []

    def check(self, device: torch.device) -> None:
        if device.type == "cuda" and torch.cuda.device_count() < self.size:
            raise ValueError(f"tensor_parallel_size={self.size} needs {self.size} CUDA devices, "
                             f"{torch.cuda.device_count()} visible")  # fmt: skip

    def start(self, args_of: ArgsOf) -> None:
        # NOTE: fresh interpreters (``python -m kvserve.workers.parallel.follower``), neither fork (this process
        # holds torch threads, maybe CUDA) nor multiprocessing's spawn (it re-imports the caller's __main__:
        # a script without a main guard).
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        for rank in range(1, self.size):
            p = subprocess.Popen(
                [sys.executable, "-m", "kvserve.workers.parallel.follower"], stdin=subprocess.PIPE, env=env
            )
            assert p.stdin is not None
            p.stdin.write(pickle.dumps(args_of(rank)))
            p.stdin.close()
            self.processes.append(p)

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.processes)

    def stop(self, timeout_s: float = STOP_WAIT_S) -> None:
        for p in self.processes:
            try:
                p.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def kill(self) -> None:
        for p in self.processes:
            if p.poll() is None:
                p.kill()
            p.wait()


class RayActorRanks:
    """Ranks as Ray actors in bundles 1..N-1 of the placement group this actor (rank 0, bundle 0) runs in.

    The actors are named ``kvserve-tp:<group>:<this start>:rank<r>``: a restarted rank 0 (Ray starts the worker
    actor's process again) first kills those of its previous incarnation still alive, then starts new ones in
    the same bundles (Ray schedules them once the old ones' resources are free). Ray also ends them when this
    process dies (their owner); ``max_restarts=0``: a rank is never restarted alone, the group is."""

    own_device = True

    def __init__(self, size: int) -> None:
        import ray

        self.size = size
        self.placement_group = ray.util.get_current_placement_group()
        assert self.placement_group is not None, "RayActorRanks runs in an actor of a placement group"
        self.bundles: dict[int, dict[str, float]] = ray.util.placement_group_table(self.placement_group)["bundles"]
        self.host = ray.util.get_node_ip_address()
        self.prefix = f"{ACTOR_NAME_PREFIX}:{self.placement_group.id.hex()}:"
        self.actors: list[Any] = []
        self._runs: list[Any] = []

    def check(self, device: torch.device) -> None:
        if len(self.bundles) != self.size:
            raise ValueError(f"tensor_parallel_size={self.size} needs a placement group of {self.size} bundles "
                             f"(one per rank), this worker's has {len(self.bundles)}")  # fmt: skip

    def start(self, args_of: ArgsOf) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from kvserve.workers.parallel.rank_actor import rank_actor_class

        self._kill_previous()
        cls = rank_actor_class()
        start = uuid.uuid4().hex[:12]
        for rank in range(1, self.size):
            bundle = self.bundles[rank]
            actor = cls.options(
                name=f"{self.prefix}{start}:rank{rank}", num_cpus=bundle.get("CPU", 0), num_gpus=bundle.get("GPU", 0),
                max_restarts=0, scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.placement_group, placement_group_bundle_index=rank),
            ).remote()  # fmt: skip
            self.actors.append(actor)
            self._runs.append(actor.run.remote(*args_of(rank)))
        logger.info("tensor-parallel ranks 1..%d: Ray actors in placement group %s", self.size - 1,
                    self.placement_group.id.hex())  # fmt: skip

    def _kill_previous(self) -> None:
        """Kill the rank actors a previous incarnation of this rank 0 left in this placement group."""
        import ray

        for name in ray.util.list_named_actors():
            if not name.startswith(self.prefix):
                continue
            try:
                ray.kill(ray.get_actor(name), no_restart=True)
                logger.warning("tensor-parallel group: killed %s (a previous incarnation's rank)", name)
            except ValueError:  # died meanwhile
                pass

    def alive(self) -> bool:
        import ray

        if not self._runs:
            return True
        ended, _ = ray.wait(self._runs, num_returns=len(self._runs), timeout=0)
        return not ended

    def stop(self, timeout_s: float = STOP_WAIT_S) -> None:
        import ray

        if self._runs:
            ray.wait(self._runs, num_returns=len(self._runs), timeout=timeout_s)
        self.kill()  # NOTE: a finished run leaves its actor (and its bundle's resources) held until killed

    def kill(self) -> None:
        import ray

        for actor in self.actors:
            ray.kill(actor, no_restart=True)


LAUNCHERS: dict[str, Callable[[int], RankLauncher]] = {"processes": ProcessRanks, "ray_actors": RayActorRanks}


def launcher_kind() -> str:
    """``ray_actors`` inside a Ray actor (or task) of a placement group, else ``processes``."""
    if "ray" not in sys.modules:  # NOTE: never import Ray (nor start one) to find out
        return "processes"
    import ray

    if not ray.is_initialized() or ray.util.get_current_placement_group() is None:
        return "processes"
    return "ray_actors"


def for_this_process(size: int) -> RankLauncher:
    """The launcher of a group of ``size`` ranks whose rank 0 is this process (``launcher_kind``)."""
    return LAUNCHERS[launcher_kind()](size)
