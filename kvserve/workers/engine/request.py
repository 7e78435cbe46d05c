"""Per-request state inside one engine: tokens, progress, block table, prefix hashes."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvserve.workers.core.block_hash import ROOT_HASH, hash_block
from kvserve.workers.core.sampling_params import SamplingParams
from kvserve.workers.engine.table_mirror import TableMirror

if TYPE_CHECKING:  # NOTE: annotations only; the scheduler imports this module and must not pull in torch
    import torch

    from kvserve.workers.engine.sampler import TokenRNG
    from kvserve.workers.text.tokenizer import IncrementalDetokenizer


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # not admitted, or preempted by recompute (num_computed_tokens == 0)
    RUNNING = "running"  # holds blocks; scheduled every step
    SWAPPED = "swapped"  # KV moved to host swap space; waits for blocks to come back
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """One sequence being generated. Owned by the engine thread; never shared across threads.

    ``all_token_ids`` is prompt + outputs; ``num_computed_tokens`` of them have K/V in the cache.
    ``block_hashes[i]`` is the chain hash of full block i of ``all_token_ids`` (docs/architecture.md).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    priority: int = 0  # larger = more important; the victim of a preemption has the smallest
    cache_salt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)

    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    num_cached_blocks: int = 0  # leading blocks of block_table registered in the prefix cache
    # Leading entries of block_table already returned to the pool (outside the sliding window);
    # they stay as placeholders so position p still maps to block_table[p // block_size].
    num_released_blocks: int = 0
    # Positions below this already hold the right K/V in a shared block: their slots are skipped.
    skip_store_below: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit at first admission (-1: not admitted yet)
    num_preemptions: int = 0
    num_swaps: int = 0
    swap_table: list[int] = field(default_factory=list)  # host block ids while SWAPPED
    finish_reason: str | None = None
    # Seeded requests only: token i's noise is a function of (seed, i), so the state to carry
    # anywhere (migration, replay) is the seed and the output tokens (see kvserve/workers/engine/sampler.py).
    rng: TokenRNG | None = None
    # {token id: logprob} of the token the last step sampled (sampling_params.logprobs set); set by
    # the runner, taken by the engine's output of that token.
    new_logprobs: dict[int, float] | None = None
    detokenizer: IncrementalDetokenizer | None = None
    # Text already handed out (for stop strings and incremental detokenization).
    output_text: str = ""
    # ``block_table`` as numpy, grown as the table is extended (kvserve/workers/engine/table_mirror.py)
    table_mirror: TableMirror = field(default_factory=TableMirror, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids) + list(self.output_token_ids)

    @property
    def generator(self) -> torch.Generator | None:
        """The generator for the next output token's noise (None: unseeded, global RNG)."""
        return self.rng.at(self.num_output_tokens) if self.rng is not None else None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def live_blocks(self) -> list[int]:
        """Device blocks this request holds a reference on."""
        return self.block_table[self.num_released_blocks :]

    def append_output(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def update_block_hashes(self, block_size: int, extra: str, upto_tokens: int) -> None:
        """Extend the hash chain over full blocks of the first ``upto_tokens`` tokens."""
        parent = self.block_hashes[-1] if self.block_hashes else ROOT_HASH
        for i in range(len(self.block_hashes), upto_tokens // block_size):
            parent = hash_block(parent, self.all_token_ids[i * block_size : (i + 1) * block_size], extra)
            self.block_hashes.append(parent)
