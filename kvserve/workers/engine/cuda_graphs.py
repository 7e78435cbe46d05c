"""Decode as CUDA graphs: the decode forward captured once per padded batch-size bucket, replayed on
static input buffers (``input_buffers.DecodeBuffers``) filled in place.

The capture is the only CUDA-only call, and it sits in one class (``CudaGraph``). Its CPU twin
(``EagerGraph``) "replays" by running the same forward eagerly on the same padded static buffers, so
the bucket choice, the padding and the buffer filling are the code CPU tests run.

A step takes the graph path when every scheduled request decodes one token and the batch fits the
largest bucket; prefill, mixed steps and bigger batches run eagerly (``ModelRunner``).
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Sequence

import torch

from kvserve.workers.engine.input_buffers import DecodeBuffers
from kvserve.workers.engine.request import Request

logger = logging.getLogger(__name__)

# (ids, positions, attn) -> (hidden states [rows, hidden], greedy token ids [rows]): the greedy head is part
# of the graph, so a greedy decode step is one replay plus the uploads and the ids' read-back.
Outputs = tuple[torch.Tensor, torch.Tensor]
Forward = Callable[[torch.Tensor, torch.Tensor, object], Outputs]


def decode_buckets(max_num_seqs: int, largest: int = 256) -> list[int]:
    """Padded batch sizes to capture: 1, 2, 4, 8, then every 8 up to ``min(max_num_seqs, largest)``,
    plus that bound itself (vLLM's and SGLang's spacing: at most 7 padded rows past 8)."""
    top = max(1, min(max_num_seqs, largest))
    sizes = {b for b in (1, 2, 4) if b <= top} | set(range(8, top + 1, 8)) | {top}
    return sorted(sizes)


class CudaGraph:
    """One captured decode forward. ``replay()`` returns the static outputs (rewritten by the next replay)."""

    def __init__(self, run: Callable[[], Outputs], pool: object, stream: torch.cuda.Stream) -> None:
        # NOTE: one eager run first (Triton compiles and autotunes, cuBLAS picks its kernels), on a side
        # stream as torch requires for a capture, then the capture itself.
        stream.wait_stream(torch.cuda.current_stream())  # the static buffers' initial values
        with torch.cuda.stream(stream):
            run()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool, stream=stream):
            self.output = run()

    def replay(self) -> Outputs:
        self.graph.replay()
        return self.output


class EagerGraph:
    """The CPU twin of ``CudaGraph``: each replay runs the forward eagerly on the same static buffers."""

    def __init__(self, run: Callable[[], Outputs], pool: object = None, stream: object = None) -> None:
        self.run = run

    def replay(self) -> Outputs:
        return self.run()


class DecodeGraphs:
    """The decode graphs of one model runner: static buffers, one graph per bucket, the bucket choice.

    Args:
        forward: the model's forward over (ids, positions, attention metadata); it must close over the
            KV cache tensors, which must not be reallocated afterwards (a graph holds their addresses).
        buckets: the padded batch sizes (``decode_buckets``).
        max_blocks: block-table width (blocks of the longest sequence).
    """

    def __init__(self, forward: Forward, buckets: Sequence[int], max_blocks: int, device: torch.device) -> None:
        self.buckets = sorted(set(buckets))
        self.device = device
        self.buffers = DecodeBuffers(self.buckets[-1], max_blocks, device)
        self.forward = forward
        self.graphs: dict[int, CudaGraph | EagerGraph] = {}
        self.replays = 0  # decode steps that took the graph path (tests, the bench)

    @property
    def largest(self) -> int:
        return self.buckets[-1]

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first (the smaller ones reuse its memory pool). On CPU the
        twin captures nothing. Padding rows store nowhere, so capturing writes no KV block."""
        kind = CudaGraph if self.device.type == "cuda" else EagerGraph
        pool = torch.cuda.graph_pool_handle() if kind is CudaGraph else None
        stream = torch.cuda.Stream(self.device) if kind is CudaGraph else None
        before = torch.cuda.memory_reserved(self.device) if kind is CudaGraph else 0
        for b in reversed(self.buckets):
            self.graphs[b] = kind(self._runner(b), pool, stream)
        if kind is CudaGraph:
            torch.cuda.synchronize(self.device)
            used = torch.cuda.memory_reserved(self.device) - before
            logger.info("captured %d decode graphs (batch %s), %.1f MiB", len(self.buckets),
                        ",".join(map(str, self.buckets)), used / 2**20)  # fmt: skip

    def _runner(self, batch_size: int) -> Callable[[], Outputs]:
        def run() -> Outputs:
            ids, positions, attn = self.buffers.inputs(batch_size)
            return self.forward(ids, positions, attn)

        return run

    def bucket(self, num_seqs: int) -> int | None:
        """The smallest bucket holding ``num_seqs`` decodes, or None (run eagerly)."""
        i = bisect.bisect_left(self.buckets, num_seqs)
        return self.buckets[i] if i < len(self.buckets) and self.graphs else None

    def run(
        self,
        batch: list[tuple[Request, int]],
        block_size: int,
        fix_ids: Callable[[torch.Tensor], None] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """Fill the static buffers with a decode batch (padded to its bucket) and replay that bucket's
        graph. Returns the real rows' hidden states ``[len(batch), hidden]`` and greedy token ids
        ``[len(batch)]`` (views of the graph's outputs: read them before the next replay) and the batch
        indices to sample. ``fix_ids`` rewrites the staged ids on the device before the replay (overlapped
        scheduling: a token the host does not know yet)."""
        b = self.bucket(len(batch))
        assert b is not None, f"{len(batch)} decodes past the largest graph ({self.largest})"
        sample_reqs = self.buffers.stage(batch, block_size, b)
        if fix_ids is not None:
            fix_ids(self.buffers.inputs(b)[0])
        self.staged(batch, b, sample_reqs)
        hidden, greedy = self.replay(b)
        return hidden[: len(batch)], greedy[: len(batch)], sample_reqs

    def staged(self, batch: list[tuple[Request, int]], batch_size: int, sample_reqs: list[int]) -> None:
        """Called between filling the static buffers and the replay: a tensor-parallel rank 0 sends the
        buffers' rows to the other ranks here (``parallel.runner``), so every rank replays the same inputs."""

    def replay(self, batch_size: int) -> Outputs:
        """Replay bucket ``batch_size``'s graph on what the static buffers hold now (the full padded outputs)."""
        out = self.graphs[batch_size].replay()
        self.replays += 1
        return out
