"""Device KV tensors, host swap space, and pool sizing."""

from __future__ import annotations

import logging
import re

import torch

import kernels
from kernels.reference import raw_bytes
from workers.model_config import ModelConfig

logger = logging.getLogger(__name__)

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "t": 10**12, "tb": 10**12}


def parse_bytes(value: str | int | float) -> int:
    """'2GiB', '512MiB', '1.5GB', 1024 -> bytes. Raises ValueError on anything else."""
    if isinstance(value, int | float):
        if value < 0:
            raise ValueError(f"negative size {value}")
        return int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", value)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot parse size {value!r}; use e.g. '2GiB', '512MiB' or a byte count")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


KV_CACHE_DTYPES = ("auto", "fp8")


def kv_storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The element type of the KV tensors: the model's (auto) or float8_e4m3fn (fp8, scale 1.0)."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    return torch.float8_e4m3fn if kv_cache_dtype == "fp8" else model_dtype


def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """K and V of ``block_size`` tokens across every layer."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * elem


class KVCache:
    """Per-layer paged KV tensors on the device plus an optional host swap space of the same layout.

    Shapes (DESIGN.md): ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` per layer.
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
        shape = (2, num_blocks, block_size, config.num_kv_heads, config.head_dim)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = device
        self.layers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
        swap_shape = (2, num_swap_blocks, block_size, config.num_kv_heads, config.head_dim)
        pin = device.type == "cuda"
        self.swap_layers = (
            [torch.zeros(swap_shape, dtype=dtype, pin_memory=pin) for _ in range(config.num_layers)]
            if num_swap_blocks
            else []
        )
        self._backend = kernels.get_backend(device)

    def swap_out(self, mapping: list[tuple[int, int]]) -> None:
        """Copy device blocks to host blocks: ``mapping`` = [(device id, host id)]."""
        if mapping:
            dev, host = (torch.tensor(x, dtype=torch.int64) for x in zip(*mapping, strict=True))
            for gpu, cpu in zip(self.layers, self.swap_layers, strict=True):
                self._backend.swap_blocks(gpu, cpu, dev, host)

    def swap_in(self, mapping: list[tuple[int, int]]) -> None:
        """Copy host blocks back to device blocks: ``mapping`` = [(host id, device id)]."""
        if mapping:
            host, dev = (torch.tensor(x, dtype=torch.int64) for x in zip(*mapping, strict=True))
            for gpu, cpu in zip(self.layers, self.swap_layers, strict=True):
                self._backend.swap_blocks(cpu, gpu, host, dev)
            if self.device.type == "cuda":
                torch.cuda.current_stream().synchronize()

    def read_blocks(self, block_ids: list[int], swapped: bool = False) -> list[torch.Tensor]:
        """Host copies of device (or, with ``swapped``, swap-space) blocks, per layer
        [2, n, block_size, kv_heads, head_dim] (migration)."""
        layers = self.swap_layers if swapped else self.layers
        idx = torch.tensor(block_ids, dtype=torch.int64, device=layers[0].device)
        # NOTE: fp8 is moved as raw bytes (no fp8 index kernels on CPU) and viewed back: bit-exact.
        return [raw_bytes(layer)[:, idx].cpu().view(layer.dtype) for layer in layers]

    def write_blocks(self, block_ids: list[int], data: list[torch.Tensor]) -> None:
        """Inverse of ``read_blocks``."""
        idx = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        for layer, blocks in zip(self.layers, data, strict=True):
            if blocks.dtype != layer.dtype:
                raise ValueError(f"KV blocks of dtype {blocks.dtype} cannot go into a {layer.dtype} cache")
            raw_bytes(layer)[:, idx] = raw_bytes(blocks).to(self.device)
