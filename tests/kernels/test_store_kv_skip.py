"""``store_kv``'s once-per-step check for skipped slots (``kernels.reference._SkipFreeSlots``)."""

from __future__ import annotations

import torch

from kvserve.kernels import reference


def _store(slots: torch.Tensor) -> torch.Tensor:
    cache = torch.zeros(2, 4, 4, 1, 2)  # [K|V, blocks, block_size, kv_heads, head_dim]
    kv = torch.arange(1, 1 + 2 * len(slots), dtype=torch.float32).view(len(slots), 1, 2)
    reference.store_kv(kv, kv, cache, slots)
    return cache.view(2, 16, 2)[0]


def test_a_slot_mapping_checked_clean_then_written_in_place_is_checked_again() -> None:
    slots = torch.tensor([0, 1, 2])
    assert _store(slots)[:3].flatten().tolist() == [1, 2, 3, 4, 5, 6]
    slots[1] = -1  # bumps the version counter: the remembered "no skipped slot" no longer holds
    rows = _store(slots)
    assert rows[0].tolist() == [1, 2] and rows[1].tolist() == [0, 0] and rows[2].tolist() == [5, 6]


def test_each_new_tensor_is_checked() -> None:
    assert _store(torch.tensor([3, 4]))[3:5].flatten().tolist() == [1, 2, 3, 4]
    rows = _store(torch.tensor([-1, 5]))
    assert rows[5].tolist() == [3, 4] and rows[:5].abs().sum() == 0
