"""How many KV blocks a CUDA engine may allocate: its share of the card next to its own other memory.

Pure arithmetic over measured figures (``LLMEngine._profile_cuda_blocks`` measures them), so the rule is
tested without a device.
"""

from __future__ import annotations

from dataclasses import dataclass

GiB = 2**30


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
