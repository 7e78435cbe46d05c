"""Block events a worker's pool emits for the router's prefix index (docs/architecture.md: fixed interface).

Each event carries the pool's own sequence number, consecutive from 1, so a consumer detects a
gap (a lost event) and asks for a full snapshot instead of trusting a stale index.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BlockStored:
    """Blocks with these hashes became available for prefix hits."""

    seq: int
    hashes: tuple[int, ...]


@dataclass(frozen=True)
class BlockRemoved:
    """Blocks with these hashes were evicted; their content is gone."""

    seq: int
    hashes: tuple[int, ...]


@dataclass(frozen=True)
class AllBlocksCleared:
    """The whole prefix cache was dropped (reset)."""

    seq: int


BlockEvent = BlockStored | BlockRemoved | AllBlocksCleared
