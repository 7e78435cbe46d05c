"""Block events a worker's pool emits for the router's prefix index (docs/architecture.md: fixed interface).

Each event names its tier (``TIERS``; a host or disk tier is shared by the workers of a node, so
its events from any of them describe the node's tier) and carries the pool's own sequence number,
consecutive from 1, so a consumer detects a gap (a lost event) and asks for a full snapshot instead
of trusting a stale index.
"""

from __future__ import annotations

from dataclasses import dataclass

# Where a block's KV lives: a worker's own pool, the node-shared host tier, or the node's disk tier.
TIERS = ("device", "host", "disk")


@dataclass(frozen=True)
class BlockStored:
    """Blocks with these hashes became available for prefix hits in ``tier``."""

    seq: int
    hashes: tuple[int, ...]
    tier: str = "device"


@dataclass(frozen=True)
class BlockRemoved:
    """Blocks with these hashes were evicted from ``tier``; their content is gone from it."""

    seq: int
    hashes: tuple[int, ...]
    tier: str = "device"


@dataclass(frozen=True)
class AllBlocksCleared:
    """The whole prefix cache was dropped (reset)."""

    seq: int


BlockEvent = BlockStored | BlockRemoved | AllBlocksCleared
