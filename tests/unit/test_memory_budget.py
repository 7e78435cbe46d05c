"""The CUDA KV pool's size: gpu_memory_utilization of the card next to this engine's own memory.

The device failure this guards: on a 141 GiB card a second engine in the same process (the first one's
pool held ~125 GiB) was refused with "139.8 GiB x 0.9 < peak 125.9 GiB": the other engine's pool had been
counted as this engine's peak.
"""

from __future__ import annotations

import pytest

from kvserve.workers.engine.memory_budget import CudaMemory

GiB = 2**30
CARD = int(139.8 * GiB)


def test_alone_the_share_decides() -> None:
    m = CudaMemory(total=CARD, free=CARD - 2 * GiB, utilization=0.9, weights=2 * GiB, activation=GiB, graphs=GiB // 4)
    assert m.kv_bytes() == int(CARD * 0.9) - 2 * GiB - GiB - GiB // 4


def test_memory_held_by_another_engine_is_not_this_engines_peak() -> None:
    # The first engine holds 125.9 GiB; this one's weights are tiny: it gets what is free, not an error.
    free = CARD - int(125.9 * GiB)
    m = CudaMemory(total=CARD, free=free, utilization=0.9, weights=GiB // 100, activation=GiB // 10, graphs=GiB // 50)
    assert m.kv_bytes() == free - GiB // 10 - GiB // 50
    assert m.kv_blocks(2**20) > 10_000


def test_graphs_and_activations_are_budgeted() -> None:
    base = dict(total=CARD, free=CARD, utilization=0.5, weights=GiB)
    eager = CudaMemory(**base, activation=GiB, graphs=0)
    graphs = CudaMemory(**base, activation=GiB, graphs=GiB // 2)
    assert eager.kv_bytes() - graphs.kv_bytes() == GiB // 2


def test_nothing_left_names_every_figure() -> None:
    m = CudaMemory(total=CARD, free=GiB, utilization=0.9, weights=GiB // 2, activation=GiB, graphs=0)
    with pytest.raises(ValueError, match=r"no memory left for the KV cache: 139.8 GiB card x 0.9 .* activation peak"):
        m.kv_blocks(2**20)
