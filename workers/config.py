"""EngineConfig: every knob of one engine, validated once, frozen."""

from __future__ import annotations

from dataclasses import dataclass

from workers.kv_cache import KV_CACHE_DTYPES, parse_bytes
from workers.scheduler import ALLOCATORS, PREEMPTION_MODES, RESERVES


@dataclass(frozen=True)
class EngineConfig:
    """Args mirror vLLM's engine args where they overlap.

    Pool size: ``num_gpu_blocks`` if given; else ``kv_cache_memory`` on CPU, and on CUDA
    ``gpu_memory_utilization`` of the card minus weights and a profiled activation peak.
    """

    model: str
    dtype: str = "auto"  # auto = the checkpoint's torch_dtype
    device: str = "auto"  # auto = cuda if available, else cpu
    block_size: int = 16
    num_gpu_blocks: int | None = None
    kv_cache_memory: str | int = "2GiB"
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096
    enable_prefix_caching: bool = True
    preemption_mode: str = "recompute"
    swap_space: float = 0.0  # GiB of host memory for swapped-out KV blocks
    watermark: float = 0.01
    seed: int = 0
    kv_cache_dtype: str = "auto"  # auto (the model's) | fp16 | bf16 | fp8 (e4m3) | int8 (+ fp32 scale per token, head)
    allocator: str = "paged"  # paged | contiguous (the pre-paging baseline; no prefix caching)
    reserve: str = "max_model_len"  # contiguous: reserve max_model_len or prompt + max_tokens
    model_id: str = ""  # part of the prefix-cache hash; default: the model path

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.num_gpu_blocks is not None and self.num_gpu_blocks <= 0:
            raise ValueError(f"num_gpu_blocks must be positive, got {self.num_gpu_blocks}")
        parse_bytes(self.kv_cache_memory)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")
        if self.swap_space < 0:
            raise ValueError(f"swap_space must be >= 0 GiB, got {self.swap_space}")
        if self.preemption_mode == "swap" and self.swap_space == 0:
            raise ValueError("preemption_mode='swap' needs swap_space > 0 (GiB of host memory)")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.allocator not in ALLOCATORS:
            raise ValueError(f"allocator must be one of {ALLOCATORS}, got {self.allocator!r}")
        if self.reserve not in RESERVES:
            raise ValueError(f"reserve must be one of {RESERVES}, got {self.reserve!r}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be auto, cpu or cuda[:N], got {self.device!r}")

    @property
    def kv_cache_bytes(self) -> int:
        return parse_bytes(self.kv_cache_memory)

    @property
    def swap_bytes(self) -> int:
        return int(self.swap_space * 2**30)
