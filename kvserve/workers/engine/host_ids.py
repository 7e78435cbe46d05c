"""The one device→host copy of a step's sampled token ids (docs/architecture.md, the engine step).

A step samples on the device (``Sampler.sample``, the model's greedy head) and the host needs the ids
once, for streaming and stop checks. On CUDA that copy is ``non_blocking`` into a pinned host buffer
followed by an event wait, so the copy is the step's only sync and nothing else queued behind it on
the stream is waited for; on CPU torch runs synchronously and a plain ``tolist`` is the copy.
"""

from __future__ import annotations

import torch


class HostIds:
    """Copies ``[n]`` int64 device ids to a host ``list[int]`` with one transfer.

    Args:
        device: The device the ids live on. CUDA gets a pinned staging buffer, grown on demand
            (sized to the largest batch seen; a step never allocates once it has been reached).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pinned: torch.Tensor | None = None
        self._event = torch.cuda.Event() if device.type == "cuda" else None
        self._ready: list[int] | torch.Tensor = []  # the last start's ids (CPU) or their pinned landing place

    def start(self, ids: torch.Tensor) -> None:
        """Queue the copy of ``ids`` (on CPU: make it); ``wait`` returns it. One outstanding at a time:
        the pinned buffer is shared (overlapped scheduling queues step N's copy before step N+1 launches,
        and waits for it before queueing N+1's)."""
        if self._event is None:
            self._ready = ids.tolist()
            return
        n = ids.numel()
        if self._pinned is None or self._pinned.numel() < n:
            self._pinned = torch.empty(max(n, 256), dtype=torch.int64, pin_memory=True)
        host = self._pinned[:n]
        host.copy_(ids.to(torch.int64), non_blocking=True)
        self._event.record()
        self._ready = host

    def wait(self) -> list[int]:
        """The ids of the last ``start``, once the copy has landed."""
        ready = self._ready
        if isinstance(ready, list):
            return ready
        assert self._event is not None
        self._event.synchronize()
        return ready.tolist()

    def fetch(self, ids: torch.Tensor) -> list[int]:
        """The host copy of ``ids`` (``[n]`` integer, on ``device``), in order: ``start`` then ``wait``.

        NOTE: the pinned buffer is reused by the next call, so the ids are read into a list here,
        after the event says the copy landed, never handed out as a view.
        """
        self.start(ids)
        return self.wait()
