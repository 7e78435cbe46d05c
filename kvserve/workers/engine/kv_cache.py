"""Device KV tensors, host swap space, and pool sizing."""

from __future__ import annotations

import logging

import torch

from kvserve import kernels
from kvserve.kernels import reference
from kvserve.kernels.reference import raw_bytes
from kvserve.workers.core.sizes import KV_CACHE_DTYPES, SCALE_BYTES
from kvserve.workers.models.model_config import ModelConfig

logger = logging.getLogger(__name__)

_STORAGE = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "int8": torch.int8}


def kv_storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The element type of the KV tensors: the model's (auto), fp16/bf16 (an fp32 model's K/V rounded),
    float8_e4m3fn (fp8) or int8.

    fp8 keeps one scale per tensor (the checkpoint's ``k_scale``/``v_scale``, else 1.0, as vLLM does):
    e4m3 has an exponent, so each value keeps its ~6 % relative precision wherever it sits and a scale
    only has to keep values in range. int8 is fixed-point, so its scale must follow the data: one fp32
    scale per (token, KV head), computed as the token is written (``kernels.reference.quantize_int8``).
    Per token rather than per block because a block fills over many steps: a scale fixed by its first
    token would clip later ones, and rescaling a block on every write re-rounds it and races with the
    other tokens of the step written in parallel.
    """
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    return _STORAGE.get(kv_cache_dtype, model_dtype)


def has_scales(dtype: torch.dtype) -> bool:
    """Whether a cache of this element type carries per-(token, head) scales."""
    return dtype == torch.int8


def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """K and V of ``block_size`` tokens across every layer, int8 scales (fp32 per token and head) included."""
    elem = torch.empty((), dtype=dtype).element_size()
    per_row = config.head_dim * elem + (SCALE_BYTES if has_scales(dtype) else 0)
    return 2 * config.num_layers * block_size * config.num_kv_heads * per_row


class KVCache:
    """Per-layer paged KV tensors on the device plus an optional host swap space of the same layout.

    Shapes (docs/architecture.md): ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` per layer.
    """

    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        num_swap_blocks: int = 0,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = device
        self.dtype = dtype
        heads, dim, n = config.num_kv_heads, config.head_dim, config.num_layers
        pin = device.type == "cuda"

        def alloc(blocks: int, dev: torch.device | str, t: torch.dtype, *tail: int) -> list[torch.Tensor]:
            if not blocks:
                return []
            return [torch.zeros(2, blocks, block_size, *tail, dtype=t, device=dev, pin_memory=pin and dev == "cpu")
                    for _ in range(n)]  # fmt: skip

        self.layers = alloc(num_blocks, device, dtype, heads, dim)
        self.swap_layers = alloc(num_swap_blocks, "cpu", dtype, heads, dim)
        # int8 only: [2, blocks, block_size, kv_heads] fp32 per layer; None for other dtypes.
        scaled = has_scales(dtype)
        self.scales: list[torch.Tensor] | None = alloc(num_blocks, device, torch.float32, heads) if scaled else None
        self.swap_scales = alloc(num_swap_blocks, "cpu", torch.float32, heads) if scaled else []
        self._backend = kernels.get_backend(device)

    @property
    def layer_scales(self) -> list[torch.Tensor | None]:
        """Per layer: the kv_scales argument of the attention ops (None unless int8)."""
        return list(self.scales) if self.scales is not None else [None] * len(self.layers)

    def swap_out(self, mapping: list[tuple[int, int]]) -> None:
        """Copy device blocks to host blocks: ``mapping`` = [(device id, host id)]."""
        if mapping:
            dev, host = (torch.tensor(x, dtype=torch.int64) for x in zip(*mapping, strict=True))
            for gpu, cpu in zip(self.layers, self.swap_layers, strict=True):
                self._backend.swap_blocks(gpu, cpu, dev, host)
            for gpu, cpu in zip(self.scales or [], self.swap_scales, strict=True):
                reference.swap_blocks(gpu, cpu, dev, host)  # a few bytes per token: no kernel needed

    def swap_in(self, mapping: list[tuple[int, int]]) -> None:
        """Copy host blocks back to device blocks: ``mapping`` = [(host id, device id)]."""
        if mapping:
            host, dev = (torch.tensor(x, dtype=torch.int64) for x in zip(*mapping, strict=True))
            for gpu, cpu in zip(self.layers, self.swap_layers, strict=True):
                self._backend.swap_blocks(cpu, gpu, host, dev)
            for gpu, cpu in zip(self.scales or [], self.swap_scales, strict=True):
                reference.swap_blocks(cpu, gpu, host, dev)
            if self.device.type == "cuda":
                torch.cuda.current_stream().synchronize()

    def read_blocks(
        self, block_ids: list[int], swapped: bool = False
    ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """Host copies of device (or, with ``swapped``, swap-space) blocks for migration: per layer
        [2, n, block_size, kv_heads, head_dim], and for int8 caches the scales [2, n, block_size, kv_heads]."""
        layers = self.swap_layers if swapped else self.layers
        idx = torch.tensor(block_ids, dtype=torch.int64, device=layers[0].device)
        # NOTE: fp8 is moved as raw bytes (no fp8 index kernels on CPU) and viewed back: bit-exact.
        data = [raw_bytes(layer)[:, idx].cpu().view(layer.dtype) for layer in layers]
        if self.scales is None:
            return data, None
        scales = self.swap_scales if swapped else self.scales
        return data, [layer[:, idx].cpu() for layer in scales]

    def check_blocks(self, data: list[torch.Tensor], scales: list[torch.Tensor] | None) -> None:
        """Raise ValueError unless ``read_blocks`` output of another cache fits this one's format."""
        if len(data) != len(self.layers) or any(
            b.dtype != self.dtype or b.shape[2:] != layer.shape[2:] for b, layer in zip(data, self.layers, strict=False)
        ):
            got = f"{len(data)} layers of {data[0].dtype if data else None}"
            raise ValueError(f"KV blocks ({got}) cannot go into this {len(self.layers)}-layer {self.dtype} cache")
        if (scales is None) != (self.scales is None) or (scales is not None and len(scales) != len(data)):
            raise ValueError(f"KV blocks {'with' if scales is not None else 'without'} scales cannot go into a "
                             f"{self.dtype} cache")  # fmt: skip

    def write_blocks(self, block_ids: list[int], data: list[torch.Tensor], scales: list[torch.Tensor] | None) -> None:
        """Inverse of ``read_blocks``. Raises ValueError (writing nothing) if the format differs."""
        self.check_blocks(data, scales)
        idx = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        for layer, blocks in zip(self.layers, data, strict=True):
            raw_bytes(layer)[:, idx] = raw_bytes(blocks).to(self.device)
        for layer, blocks in zip(self.scales or [], scales or [], strict=True):
            layer[:, idx] = blocks.to(self.device)
