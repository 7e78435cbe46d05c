"""Joining the ranks of one tensor-parallel group: ``torch.distributed``'s default process group,
gloo on CPU (TCP), NCCL on CUDA. One group per process: a rank is one process (a child process of rank 0 or a
Ray actor of the worker's placement group: ``launchers``)."""

from __future__ import annotations

import socket
from datetime import timedelta

import torch
import torch.distributed as dist

# NOTE: a rank blocked in a collective whose peer died gets gloo's "connection closed" at once; the timeout
# bounds only a peer that hangs alive (then the whole group is declared dead, never half of it).
DEFAULT_TIMEOUT_S = 300.0


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (the rendezvous of a group: rank 0's address, the group is on one node)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def rank_device(device: torch.device, rank: int, own_device: bool = False) -> torch.device:
    """Rank ``rank``'s device: the CPU, or on CUDA ``cuda:rank`` when the group's processes see the machine's
    cards (child processes of rank 0), or ``cuda:0`` when each rank sees only its own card (a Ray actor: Ray
    sets its CUDA_VISIBLE_DEVICES to the one GPU of its bundle)."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", 0 if own_device else rank)


def join(rank: int, size: int, address: str, device: torch.device, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Join the group whose rank 0 listens on ``address`` (``host:port``); blocks until all ``size`` ranks do."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend, init_method=f"tcp://{address}", rank=rank, world_size=size, timeout=timedelta(seconds=timeout_s)
    )


def leave() -> None:
    """Destroy this process's group (idempotent)."""
    if dist.is_initialized():
        dist.destroy_process_group()
