"""How many KV blocks a CUDA engine may allocate: its share of the card next to its own other memory.

``CudaMemory`` is pure arithmetic over measured figures, so the rule is tested without a device.
``profile_kv_blocks`` measures them: it runs the engine's largest step and its largest decode batch on a
scratch cache and reads the card through a ``MemoryMeter``, the only CUDA calls of the sizing
(``CudaMeter``), so the same code runs on CPU under a meter that reports given figures (tests: each rank
of a tensor-parallel group profiles its own card, ``kvserve/workers/parallel/sizing.py``).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Protocol

import torch

from kvserve.workers.core.sampling_params import SamplingParams
from kvserve.workers.core.sizes import blocks_for
from kvserve.workers.engine.config import EngineConfig
from kvserve.workers.engine.cuda_graphs import decode_buckets
from kvserve.workers.engine.input_buffers import DecodeBuffers
from kvserve.workers.engine.kv_cache import KVCache
from kvserve.workers.engine.model_runner import ModelRunner
from kvserve.workers.engine.request import Request
from kvserve.workers.engine.sampler import Sampler
from kvserve.workers.engine.scheduler import SchedulerOutput
from kvserve.workers.models.model import CausalLM

GiB = 2**30


class MemoryMeter(Protocol):
    """A device's memory figures, as the sizing reads them."""

    def start_peak(self) -> int:
        """Settle the device and start a peak measurement; returns the bytes allocated now."""

    def peak_since(self, start: int) -> int:
        """Settle the device; the peak bytes allocated above ``start`` since ``start_peak``."""

    def free_total(self) -> tuple[int, int]:
        """(free, total) bytes of the device, this process's cached-but-unused memory released first."""


class CudaMeter:
    """``MemoryMeter`` of one CUDA device (``torch.cuda``'s allocator statistics and ``mem_get_info``)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def start_peak(self) -> int:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        return torch.cuda.memory_allocated(self.device)

    def peak_since(self, start: int) -> int:
        torch.cuda.synchronize(self.device)
        return max(torch.cuda.max_memory_allocated(self.device) - start, 0)

    def free_total(self) -> tuple[int, int]:
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        return int(free), int(total)


@dataclass(frozen=True)
class ProfileShape:
    """What to profile: the KV layout of the model held (a tensor-parallel rank's: its KV heads), the
    largest step's tokens, the largest decode-graph batch (0: no decode graphs) and the device bytes of the
    graphs' static inputs (``input_buffers.DecodeBuffers``: block tables as wide as the longest sequence)."""

    block_size: int
    kv_dtype: torch.dtype
    utilization: float
    num_tokens: int
    graph_batch: int
    graph_buffer_bytes: int = 0

    @classmethod
    def of(cls, config: EngineConfig, kv_dtype: torch.dtype, max_model_len: int) -> ProfileShape:
        """The shape an engine of ``config`` profiles: a step of its token budget, a decode at its largest bucket."""
        graph_batch = 0 if config.enforce_eager else decode_buckets(config.max_num_seqs)[-1]
        num_tokens = min(config.max_num_batched_tokens, max_model_len)
        buffers = DecodeBuffers.device_bytes(graph_batch, -(-max_model_len // config.block_size)) if graph_batch else 0
        return cls(config.block_size, kv_dtype, config.gpu_memory_utilization, num_tokens, graph_batch, buffers)


@torch.inference_mode()
def profile_kv_blocks(
    meter: MemoryMeter, model: CausalLM, shape: ProfileShape, block_bytes: int
) -> tuple[CudaMemory, int]:
    """Measure this engine's weights, the activation peak of its largest step and, with decode graphs, of a
    decode at the largest bucket (their memory pool), then the card's free and total memory: the figures
    and the KV blocks of ``block_bytes`` they leave (``CudaMemory.kv_blocks``; ValueError when none).

    NOTE: a tensor-parallel rank's forward holds collectives: every rank must profile with the same shape.
    """
    weights = sum(t.numel() * t.element_size() for t in itertools.chain(model.parameters(), model.buffers()))
    activation = _probe_peak(meter, model, shape, [shape.num_tokens])
    graphs = 0
    if shape.graph_batch:  # NOTE: their pool (a decode's peak at the largest bucket) and their static inputs
        graphs = _probe_peak(meter, model, shape, [1] * shape.graph_batch) + shape.graph_buffer_bytes
    free, total = meter.free_total()
    memory = CudaMemory(total, free, shape.utilization, weights, activation, graphs)
    return memory, memory.kv_blocks(block_bytes)


def _probe_peak(meter: MemoryMeter, model: CausalLM, shape: ProfileShape, counts: list[int]) -> int:
    """Bytes allocated above the current level while one step runs requests of these token counts on a
    scratch cache (the step's activation peak; the scratch cache itself is allocated before and not counted)."""
    bs = shape.block_size
    per_req = [blocks_for(n, bs) for n in counts]
    scratch = KVCache(model.config, sum(per_req), bs, shape.kv_dtype, next(model.parameters()).device)
    probes, first = [], 0
    for i, (n, blocks) in enumerate(zip(counts, per_req, strict=True)):
        probe = Request(f"__profile_{i}__", [0] * n, SamplingParams(max_tokens=1, temperature=0.0))
        probe.block_table, first = list(range(first, first + blocks)), first + blocks
        probes.append((probe, n))
    start = meter.start_peak()
    ModelRunner(model, scratch, Sampler()).execute(SchedulerOutput(scheduled=probes))
    peak = meter.peak_since(start)
    del scratch
    return peak


@dataclass(frozen=True)
class CudaMemory:
    """Measured bytes: the card's ``total`` and ``free`` memory (with this engine's weights loaded, before
    its KV pool), the engine's ``weights``, the ``activation`` peak of its largest step and the ``graphs``
    pool of its decode graphs (0 with ``enforce_eager``)."""

    total: int
    free: int
    utilization: float
    weights: int
    activation: int
    graphs: int

    def kv_bytes(self) -> int:
        """``utilization`` x total, minus this engine's own weights, activation peak and graph pool, and no
        more than is free once the activations and graphs have their room.

        NOTE: only this engine's memory counts against its share: what else the process holds (another
        engine's pool) is not its peak, and is respected by the free-memory bound instead.
        """
        own = self.weights + self.activation + self.graphs
        share = int(self.total * self.utilization) - own
        return min(share, self.free - self.activation - self.graphs)

    def kv_blocks(self, block_bytes: int) -> int:
        """Blocks of ``block_bytes`` in ``kv_bytes()``.

        Raises:
            ValueError: not one block fits (the message gives every figure).
        """
        n = self.kv_bytes() // block_bytes
        if n <= 0:
            raise ValueError(
                f"no memory left for the KV cache: {self.describe()}; raise gpu_memory_utilization, lower "
                "max_num_batched_tokens or max_num_seqs, or pass --enforce-eager"
            )
        return n

    def describe(self) -> str:
        return (
            f"{self.total / GiB:.1f} GiB card x {self.utilization} = {self.total * self.utilization / GiB:.1f} GiB "
            f"share, {self.free / GiB:.1f} GiB free; this engine's weights {self.weights / GiB:.2f} GiB, activation "
            f"peak {self.activation / GiB:.2f} GiB, decode graphs {self.graphs / GiB:.2f} GiB"
        )
