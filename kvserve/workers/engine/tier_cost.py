"""TierCostModel: does loading a block from a tier beat recomputing it, on this model and machine?

Both sides are measured, never assumed: the engine times a probe at start-up (a prefill of a few
blocks and a store round trip of one block) and then every real load and every prefill step, and
keeps an exponential moving average of each:

* recompute: seconds per prefill token (a block costs ``block_size`` of them);
* load: seconds per block, per tier (read, verify, write into the KV cache).

``ratio(tier)`` = load / recompute per block. Below 1 a load pays; the router credits a tier hit
``1 - ratio`` of a device hit (``credit``), so a slow tier or a tiny model earns nothing.

Pure Python, no clock of its own: callers pass the measured seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

_ALPHA = 0.2  # EMA weight of a new sample: recent enough to follow load, smooth enough to ignore one


@dataclass
class TierCostModel:
    """Measured load and recompute costs.

    Args:
        block_size: tokens per block.
    """

    block_size: int
    recompute_s_per_token: float | None = None
    load_s_per_block: dict[str, float] = field(default_factory=dict)

    def record_prefill(self, num_tokens: int, seconds: float) -> None:
        """A forward that computed ``num_tokens`` prompt tokens in ``seconds``."""
        if num_tokens > 0 and seconds > 0:
            self.recompute_s_per_token = _ema(self.recompute_s_per_token, seconds / num_tokens)

    def record_load(self, tier: str, num_blocks: int, seconds: float) -> None:
        """``num_blocks`` loaded from ``tier`` in ``seconds``."""
        if num_blocks > 0 and seconds > 0:
            self.load_s_per_block[tier] = _ema(self.load_s_per_block.get(tier), seconds / num_blocks)

    def recompute_s_per_block(self) -> float | None:
        r = self.recompute_s_per_token
        return None if r is None else r * self.block_size

    def ratio(self, tier: str) -> float | None:
        """Load time / recompute time of one block from ``tier``; None until both were measured."""
        load, recompute = self.load_s_per_block.get(tier), self.recompute_s_per_block()
        if load is None or not recompute:
            return None
        return load / recompute

    def load_pays(self, tier: str) -> bool:
        """Whether loading from ``tier`` is cheaper than recomputing. Unmeasured: True, so the first
        load measures it (the start-up probe normally measured both already)."""
        r = self.ratio(tier)
        return r is None or r < 1.0

    def credit(self, tier: str) -> float:
        """What a hit in ``tier`` is worth relative to a device hit (1.0): ``1 - ratio``, in [0, 1]."""
        r = self.ratio(tier)
        return 0.0 if r is None else max(0.0, 1.0 - r)


def _ema(old: float | None, sample: float) -> float:
    return sample if old is None else (1 - _ALPHA) * old + _ALPHA * sample
