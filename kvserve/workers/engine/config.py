"""EngineConfig: every knob of one engine, declared, documented and validated here only.

The CLI flags (``kvserve generate``/``serve``/``bench``) and the ``engine:`` section of
``cluster.yaml`` are generated from these fields (``kvserve/workers/core/knobs.py``); ``SchedulerConfig``
takes its shared knobs from here.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.workers.core.knobs import NON_NEGATIVE, POSITIVE, POWER_OF_TWO, Check, knob, validate
from kvserve.workers.core.sizes import KV_CACHE_DTYPES, parse_bytes

PREEMPTION_MODES = ("recompute", "swap", "auto")
ALLOCATORS = ("paged", "contiguous")
RESERVES = ("max_model_len", "max_tokens")
TIER_LOADS = ("auto", "always")
CPU_WEIGHTS = ("fp32", "bf16")
CPU_KV_CACHE_MEMORY = "2GiB"  # the KV pool where neither num_gpu_blocks nor kv_cache_memory is given, off CUDA

WATERMARK = Check(lambda v: 0.0 <= v < 1.0, "must be in [0, 1)")
_UTILIZATION = Check(lambda v: 0.0 < v <= 1.0, "must be in (0, 1]")
_DEVICE = Check(lambda v: v in ("auto", "cpu", "cuda") or v.startswith("cuda:"), "must be auto, cpu or cuda[:N]")


@dataclass(frozen=True)
class EngineConfig:
    """Args mirror vLLM's engine args where they overlap.

    Pool size: ``num_gpu_blocks`` if given; else ``kv_cache_memory`` if given (2GiB by default on CPU);
    else, on CUDA, ``gpu_memory_utilization`` of the card minus weights, a profiled activation peak and
    the decode graphs' pool (no more than is free).

    Raises:
        ValueError: a bad value, ``"<field> must be ..., got <value>"``.
    """

    model: str = knob(help="HF model directory", cli=False)
    dtype: str = knob("auto", help="auto (the checkpoint's) | float32 | float16 | bfloat16")
    device: str = knob("auto", help="auto (cuda if available, else cpu) | cpu | cuda[:N]", check=_DEVICE)
    block_size: int = knob(16, help="tokens per KV block", check=POWER_OF_TWO)
    num_gpu_blocks: int | None = knob(None, help="pool size in blocks (overrides memory)", check=POSITIVE)
    kv_cache_memory: str | int | None = knob(
        None, help="KV pool size, e.g. 2GiB (default: 2GiB on CPU; on CUDA from gpu_memory_utilization)"
    )
    gpu_memory_utilization: float = knob(0.9, help="fraction of the card for weights + KV", check=_UTILIZATION)
    enforce_eager: bool = knob(False, help="CUDA: run decode steps eagerly (no CUDA graphs; as vLLM's flag)")
    # NOTE: off by default: on CPU the forward is synchronous, so there is nothing to overlap (the step only
    # gets a step's latency added to its streaming); on CUDA it hides the host's scheduling behind the GPU's step.
    async_scheduling: bool = knob(
        False, help="overlapped scheduling: schedule step N+1 while step N runs; decodes read N's ids on the device"
    )
    tensor_parallel_size: int = knob(
        1, help="ranks per worker: the model sharded over N devices (N processes; gloo on CPU, NCCL on CUDA)",
        check=POSITIVE,
    )
    # NOTE: an opt-in speed mode, off by default: tokens then match HF fp32 only as far as bf16-rounded weights
    # allow (kvserve/cluster/bench/RESULTS.md reports the agreement); fp32 keeps the engine token-exact.
    cpu_weights: str = knob(
        "fp32",
        help="CPU fp32 models: bf16 = stream the projection and LM head weights as bf16 (half the bytes of a "
        "decode step; activations and accumulation stay fp32; tokens may differ from fp32)",
        choices=CPU_WEIGHTS,
    )
    max_model_len: int | None = knob(None, help="context limit (default: the model's)", check=POSITIVE)
    max_num_seqs: int = knob(256, help="requests running at once", check=POSITIVE)
    max_num_batched_tokens: int = knob(4096, help="tokens per step", check=POSITIVE)
    enable_prefix_caching: bool = knob(True, help="disable prefix caching", flag="--no-prefix-caching")
    preemption_mode: str = knob("recompute", help="what preemption does with KV", choices=PREEMPTION_MODES)
    swap_space: float = knob(0.0, help="GiB of host memory for swapped KV blocks", check=NON_NEGATIVE)
    watermark: float = knob(0.01, help="fraction of the pool kept free at admission", check=WATERMARK)
    seed: int = knob(0, help="global seed for unseeded sampling")
    kv_cache_dtype: str = knob(
        "auto",
        help="KV element type: the model's; fp16/bf16; fp8 (float8_e4m3fn, per-tensor scale; 2x/4x the blocks "
        "of fp16/fp32); int8 (a scale per token and head)",
        choices=KV_CACHE_DTYPES,
    )
    allocator: str = knob(
        "paged", help="contiguous = reserve each request's longest footprint up front (baseline)", choices=ALLOCATORS
    )
    reserve: str = knob(
        "max_model_len", help="contiguous allocator: reserve max_model_len or prompt + max_tokens", choices=RESERVES
    )
    model_id: str = knob("", help="part of the prefix-cache hash (default: the model path)")
    # Tiered prefix cache (docs/architecture.md §3a): evicted prefix blocks spill to a node-shared host
    # tier (files in shared memory) and on to local disk; any worker of the node loads them back.
    host_cache_memory: str | int = knob(
        "0", help="host tier budget per node (shared by its workers), e.g. 4GiB; 0 = off"
    )
    host_cache_dir: str = knob("", help="host tier directory (default: /dev/shm/kvserve-<model layout digest>)")
    disk_cache_dir: str = knob("", help="disk tier directory (blocks leaving the host tier); empty = off")
    disk_cache_size: str | int = knob("16GiB", help="disk tier budget, e.g. 64GiB")
    tier_load: str = knob(
        "auto", help="auto: load a tier block only when measured faster than recomputing it; always: whenever found",
        choices=TIER_LOADS,
    )

    def __post_init__(self) -> None:
        validate(self)
        try:
            parse_bytes(self.kv_cache_memory if self.kv_cache_memory is not None else CPU_KV_CACHE_MEMORY)
        except ValueError as e:
            raise ValueError(f"kv_cache_memory: {e}") from None
        for name in ("host_cache_memory", "disk_cache_size"):
            try:
                parse_bytes(getattr(self, name))
            except ValueError as e:
                raise ValueError(f"{name}: {e}") from None
        if self.tiers_enabled and not (self.enable_prefix_caching and self.allocator == "paged"):
            raise ValueError("host_cache_memory / disk_cache_dir need prefix caching and the paged allocator")
        # NOTE: rank 0 broadcasts a step's host-staged inputs to the other ranks before the forward, so a
        # token only on the device (overlapped scheduling's PENDING) would reach them as -1.
        if self.async_scheduling and self.tensor_parallel_size > 1:
            raise ValueError("async_scheduling needs tensor_parallel_size 1 (ranks get the host's input ids)")
        if self.preemption_mode == "swap" and self.swap_space == 0:
            raise ValueError("preemption_mode='swap' needs swap_space > 0 (GiB of host memory)")

    @property
    def kv_cache_bytes(self) -> int:
        """The KV pool's size in bytes where memory decides it: ``kv_cache_memory``, else 2GiB."""
        return parse_bytes(self.kv_cache_memory if self.kv_cache_memory is not None else CPU_KV_CACHE_MEMORY)

    @property
    def host_cache_bytes(self) -> int:
        return parse_bytes(self.host_cache_memory)

    @property
    def disk_cache_bytes(self) -> int:
        return parse_bytes(self.disk_cache_size) if self.disk_cache_dir else 0

    @property
    def tiers_enabled(self) -> bool:
        """Whether evicted prefix blocks spill to a host or disk tier."""
        return self.host_cache_bytes > 0 or bool(self.disk_cache_dir)

    @property
    def swap_bytes(self) -> int:
        return int(self.swap_space * 2**30)
