"""A rank > 0 of a tensor-parallel group as a Ray actor in its bundle of the worker's placement group.

Rank 0 (the worker actor, bundle 0) creates one per other rank (``launchers.RayActorRanks``); ``run`` is the
follower loop (``follower.run``, the same code a child-process rank runs) and returns when rank 0 sends STOP,
or raises when the group breaks (rank 0 gone: its collective fails). Its process belongs to rank 0's process
(Ray fate-sharing: an actor dies with its owner), and rank 0 kills it when the group ends.

NOTE: it imports only what the follower needs (no engine, no transport, no router): the actor's process
loads this module to unpickle the class.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from kvserve.workers.parallel import follower


class RankActor:
    """One rank > 0 (create it with ``rank_actor_class()``); ``run`` blocks for the group's life, so the actor
    is threaded: ``where`` answers meanwhile."""

    def __init__(self) -> None:
        logging.basicConfig(level=logging.WARNING, format="%(asctime)s tp-rank %(levelname)s %(name)s: %(message)s")

    def run(self, *args: Any) -> None:
        """``follower.run(*args)``: join, load the shard, follow rank 0's steps until STOP."""
        follower.run(*args)

    def where(self) -> dict[str, Any]:
        """Where Ray placed this rank: its process id, node, placement group and GPUs (tests, operators)."""
        import ray

        ctx = ray.get_runtime_context()
        return {"pid": os.getpid(), "node_id": ctx.get_node_id(), "placement_group_id": ctx.get_placement_group_id(),
                "actor_id": ctx.get_actor_id(), "gpu_ids": ray.get_gpu_ids()}  # fmt: skip


def rank_actor_class() -> Any:
    """``ray.remote(RankActor)``, threaded; Ray is imported only here."""
    import ray

    return ray.remote(max_concurrency=2)(RankActor)
