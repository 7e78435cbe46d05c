"""TierCostModel: load vs recompute per block, from measurements only."""

from __future__ import annotations

import pytest

from kvserve.workers.engine.tier_cost import TierCostModel


def test_unmeasured_loads_once_and_credits_nothing() -> None:
    c = TierCostModel(block_size=16)
    assert c.ratio("host") is None
    assert c.load_pays("host")  # the first load measures it
    assert c.credit("host") == 0.0


def test_big_model_loads_and_credit_follows_ratio() -> None:
    c = TierCostModel(block_size=16)
    c.record_prefill(num_tokens=64, seconds=0.064)  # 1 ms/token -> 16 ms/block
    c.record_load("host", num_blocks=4, seconds=0.008)  # 2 ms/block
    assert c.ratio("host") == pytest.approx(0.125)
    assert c.load_pays("host")
    assert c.credit("host") == pytest.approx(0.875)


def test_tiny_model_chooses_recompute() -> None:
    c = TierCostModel(block_size=16)
    c.record_prefill(num_tokens=64, seconds=0.0016)  # 25 us/token -> 0.4 ms/block
    c.record_load("disk", num_blocks=1, seconds=0.002)  # 2 ms/block
    assert c.ratio("disk") == pytest.approx(5.0)
    assert not c.load_pays("disk")
    assert c.credit("disk") == 0.0


def test_estimates_follow_new_measurements() -> None:
    c = TierCostModel(block_size=16)
    c.record_prefill(16, 0.016)
    c.record_load("host", 1, 0.032)  # a cold first load: looks like a loss
    assert not c.load_pays("host")
    for _ in range(20):
        c.record_load("host", 1, 0.001)  # the steady state
    assert c.load_pays("host")
    c.record_load("host", 0, 1.0)  # nothing loaded: no information
    c.record_prefill(0, 1.0)
    assert c.load_pays("host")
