"""TierCopier: the device side of a tier spill or load, the one place the tiers touch CUDA streams.

* ``gather(block_ids)``: the blocks' KV (every layer, then every layer's int8 scales) copied to host
  memory, as ``uint8`` tensors ``[2, n, ...]``. ``Gathered.wait()`` blocks until the host copies are
  complete: the tier writer thread calls it, never the engine thread.
* ``scatter(block_ids, data)``: ``data`` (``uint8 [n, payload]`` on the host, one block's payload per
  row, layout of ``kvserve/workers/engine/tiered_cache.py``) written into the blocks.

Both keep the engine's ordering contract: a gather reads what every forward queued before it wrote,
and nothing queued after it may overwrite those blocks before it read them; a scatter lands before
anything queued after it reads the blocks.

``TierCopier`` is the CPU twin: plain synchronous copies (the tests run it). ``CudaTierCopier`` moves
the work off the compute stream onto a side stream:

* spill: the side stream waits for the compute stream, gathers the blocks into a device temporary
  (one index kernel per tensor) and copies it into pinned host memory (``non_blocking``); the compute
  stream waits only for the gather kernels (so the next forward may reuse the blocks), never for the
  device->host copy, and the engine thread waits for neither;
* load: the payload is staged in pinned host memory, copied to the device and scattered into the
  blocks on the side stream; the compute stream waits for it (``wait_event``) at the point the load
  was issued, so the forward that reads the blocks runs after it while the engine thread goes on
  building the step. NOTE: the scheduler loads a request's blocks in the step that computes it, so
  the copy overlaps the step's host-side work and whatever the compute stream still had queued, not
  a whole step of its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvserve.workers.engine.kv_cache import KVCache


@dataclass
class Gathered:
    """Host copies of some blocks: per layer ``uint8 [2, n, ...]``, then per layer its scales."""

    layers: list[torch.Tensor]
    scales: list[torch.Tensor]
    done: torch.cuda.Event | None = None  # recorded after the device->host copies (CUDA only)

    def wait(self) -> None:
        """Block until the host copies hold the blocks (any thread)."""
        if self.done is not None:
            self.done.synchronize()

    def payload(self, j: int) -> bytes:
        """Block ``j``'s payload: each layer's K and V, then each layer's scales (waits for the copies)."""
        self.wait()
        parts = [t[:, j].reshape(-1) for t in self.layers] + [t[:, j].reshape(-1) for t in self.scales]
        return torch.cat(parts).numpy().tobytes()


def block_bytes(t: torch.Tensor) -> int:
    """Bytes of one block of a ``[2, num_blocks, ...]`` tensor."""
    return 2 * t[0, 0].numel() * t.element_size()


class TierCopier:
    """Synchronous copies between a KV cache's blocks and host memory (the CPU twin of ``CudaTierCopier``).

    Args:
        kv_cache: the cache whose blocks are copied out of and into.
    """

    def __init__(self, kv_cache: KVCache) -> None:
        self.kv_cache = kv_cache
        self.device = kv_cache.device
        self.layer_bytes = block_bytes(kv_cache.layers[0])
        self.scale_bytes = block_bytes(kv_cache.scales[0]) if kv_cache.scales is not None else 0
        self.payload_bytes = len(kv_cache.layers) * (self.layer_bytes + self.scale_bytes)

    @staticmethod
    def for_cache(kv_cache: KVCache) -> TierCopier:
        """The copier for the cache's device: side-stream pinned copies on CUDA, plain ones elsewhere."""
        return CudaTierCopier(kv_cache) if kv_cache.device.type == "cuda" else TierCopier(kv_cache)

    def _tensors(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return list(self.kv_cache.layers), list(self.kv_cache.scales or [])

    def gather(self, block_ids: Sequence[int]) -> Gathered:
        idx = torch.tensor(list(block_ids), dtype=torch.int64, device=self.device)
        layers, scales = self._tensors()
        # NOTE: advanced indexing copies: later writes into the blocks do not reach these tensors.
        return Gathered([t.view(torch.uint8)[:, idx].cpu() for t in layers],
                        [s.view(torch.uint8)[:, idx].cpu() for s in scales])  # fmt: skip

    def scatter(self, block_ids: Sequence[int], data: torch.Tensor) -> None:
        idx = torch.tensor(list(block_ids), dtype=torch.int64, device=self.device)
        self._scatter_all(idx, data)

    def _scatter_all(self, idx: torch.Tensor, data: torch.Tensor) -> None:
        """Write row ``i`` of ``data`` (one payload) into block ``idx[i]``, tensor by tensor in payload order."""
        layers, scales = self._tensors()
        offset = 0
        for t in layers:
            offset = _scatter(t, idx, data, offset, self.layer_bytes)
        for s in scales:
            offset = _scatter(s, idx, data, offset, self.scale_bytes)

    def synchronize(self) -> None:
        """Wait until every copy issued so far is complete (probes, checks; never on the step path)."""


class CudaTierCopier(TierCopier):
    """``TierCopier`` on a CUDA device: pinned host buffers and a side stream (module docstring)."""

    def __init__(self, kv_cache: KVCache) -> None:
        super().__init__(kv_cache)
        self.side = torch.cuda.Stream(device=self.device)

    def _index(self, block_ids: Sequence[int]) -> torch.Tensor:
        """The block ids on the device, copied on the side stream (the caller is inside it)."""
        host = torch.tensor(list(block_ids), dtype=torch.int64).pin_memory()
        return host.to(self.device, non_blocking=True)

    def gather(self, block_ids: Sequence[int]) -> Gathered:
        compute = torch.cuda.current_stream(self.device)
        self.side.wait_stream(compute)  # the blocks hold what every forward queued so far wrote
        layers, scales = self._tensors()
        with torch.cuda.stream(self.side):
            idx = self._index(block_ids)
            # NOTE: the device temporaries belong to the side stream's pool: dropped after the copies are
            # queued, their memory is reused only by later side-stream work, which runs after the copies.
            on_device = [t.view(torch.uint8)[:, idx] for t in (*layers, *scales)]
            gathered = torch.cuda.Event()
            gathered.record(self.side)
            host = [torch.empty(d.shape, dtype=torch.uint8, pin_memory=True) for d in on_device]
            for h, d in zip(host, on_device, strict=True):
                h.copy_(d, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.side)
        compute.wait_event(gathered)  # nothing queued from now on overwrites the blocks before they were read
        return Gathered(host[: len(layers)], host[len(layers) :], done)

    def scatter(self, block_ids: Sequence[int], data: torch.Tensor) -> None:
        compute = torch.cuda.current_stream(self.device)
        staged = torch.empty(data.shape, dtype=torch.uint8, pin_memory=True)
        staged.copy_(data)
        self.side.wait_stream(compute)  # whatever is queued on these blocks (a spill's gather) goes first
        with torch.cuda.stream(self.side):
            idx = self._index(block_ids)
            self._scatter_all(idx, staged.to(self.device, non_blocking=True))
            loaded = torch.cuda.Event()
            loaded.record(self.side)
        compute.wait_event(loaded)  # the forward that reads the blocks runs after the copy; the thread goes on

    def synchronize(self) -> None:
        self.side.synchronize()


def _scatter(target: torch.Tensor, idx: torch.Tensor, data: torch.Tensor, offset: int, size: int) -> int:
    """Write ``data[:, offset:offset+size]`` (one slice per block) into blocks ``idx`` of ``target``."""
    u8 = target.view(torch.uint8)  # [2, num_blocks, *block, bytes of the last dim]
    chunk = data[:, offset : offset + size].reshape(len(idx), 2, *u8.shape[2:]).transpose(0, 1)
    u8[:, idx] = chunk.to(target.device)
    return offset + size
