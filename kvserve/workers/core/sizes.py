"""Sizes and names the control side shares with the engine, without importing torch.

NOTE: a leaf module. ``kvserve/workers/engine/config.py`` (read by the router and the CLI) and ``kvserve plan``
need these constants and ``parse_bytes``; ``kvserve/workers/engine/kv_cache.py`` (torch) re-exports them.
"""

from __future__ import annotations

import re

KV_CACHE_DTYPES = ("auto", "fp16", "bf16", "fp8", "int8")
SCALE_BYTES = 4  # one fp32 scale per (K|V, token, KV head) of an int8 cache

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "t": 10**12, "tb": 10**12}  # fmt: skip


def parse_bytes(value: str | int | float) -> int:
    """'2GiB', '512MiB', '1.5GB', 1024 -> bytes.

    Raises:
        ValueError: a negative number or text that is not a size.
    """
    if isinstance(value, int | float):
        if value < 0:
            raise ValueError(f"negative size {value}")
        return int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", value)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot parse size {value!r}; use e.g. '2GiB', '512MiB' or a byte count")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``num_tokens`` tokens (ceil division); the one definition of it."""
    return -(-num_tokens // block_size)


def pool_usage(used_blocks: int, total_blocks: int) -> float:
    """Fraction of a pool's blocks held by requests, 0 for an empty pool (the one definition: reports,
    watermarks, metrics, ``kvserve top``)."""
    return used_blocks / total_blocks if total_blocks else 0.0
