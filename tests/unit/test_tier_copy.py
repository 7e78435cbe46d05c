"""TierCopier (the CPU twin of the CUDA side-stream copier): a block gathered, packed and scattered into
another block is bit-identical, scales included; the gather is a copy taken when it is issued."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvserve.workers.engine.tier_copy import TierCopier

BLOCKS, BS, HEADS, DIM, LAYERS = 8, 4, 2, 8, 3


def _cache(dtype: torch.dtype) -> SimpleNamespace:
    g = torch.Generator().manual_seed(0)

    def rand(t: torch.dtype, *tail: int) -> torch.Tensor:
        if t == torch.int8:
            return torch.randint(-128, 128, (2, BLOCKS, BS, *tail), dtype=t, generator=g)
        return torch.randn(2, BLOCKS, BS, *tail, generator=g).to(t)

    scales = [rand(torch.float32, HEADS) for _ in range(LAYERS)] if dtype == torch.int8 else None
    return SimpleNamespace(layers=[rand(dtype, HEADS, DIM) for _ in range(LAYERS)], scales=scales,
                           device=torch.device("cpu"))  # fmt: skip


def _block(cache: SimpleNamespace, b: int) -> list[torch.Tensor]:
    return [t[:, b].clone() for t in (*cache.layers, *(cache.scales or []))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_gather_pack_scatter_round_trip_is_bit_identical(dtype: torch.dtype) -> None:
    cache = _cache(dtype)
    copier = TierCopier.for_cache(cache)  # type: ignore[arg-type]
    assert type(copier) is TierCopier  # the CPU twin on a CPU cache
    want = {b: _block(cache, b) for b in (5, 2)}
    gathered = copier.gather([5, 2])
    for t in (*cache.layers, *(cache.scales or [])):
        t[:, [5, 2]] = 0  # the blocks are reused right after the gather: the copies keep what was there
    payloads = [gathered.payload(0), gathered.payload(1)]
    assert all(len(p) == copier.payload_bytes for p in payloads)
    data = torch.frombuffer(bytearray(b"".join(payloads)), dtype=torch.uint8).view(2, -1)
    copier.scatter([7, 0], data)
    for src, dst in ((5, 7), (2, 0)):
        got = _block(cache, dst)
        assert all(torch.equal(g.view(torch.uint8), w.view(torch.uint8)) for g, w in zip(got, want[src], strict=True))
    copier.synchronize()
