"""Continuous batching: which requests run this step, with how many tokens, in which blocks.

Policy lives here; the BlockPool is mechanism. One ``schedule()`` call per engine step:

1. Running requests, most important first (priority desc, arrival asc), each gets its remaining
   tokens (1 for decode, a chunk for an unfinished prefill) within the token budget. A request
   that cannot get the blocks it needs preempts the least important running request (lowest
   priority, latest arrival) until it fits, or is itself the victim.
2. If nothing was preempted this step: swapped requests come back (swap-in), then waiting ones
   are admitted in priority/arrival order. Admission looks up the prefix cache and reserves
   blocks for the whole known sequence plus a watermark, so a long prompt admitted in chunks
   cannot be starved of blocks half-way (thrash).

Preemption modes: ``recompute`` (free the blocks, recompute later; prefix caching often revives
them), ``swap`` (copy the blocks to host swap space), ``auto`` (swap when host space fits and the
context is long enough that recomputing would cost more than copying).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvserve.workers.core.block_hash import cache_extra
from kvserve.workers.core.knobs import POSITIVE, knob, same_as, validate
from kvserve.workers.core.sizes import blocks_for
from kvserve.workers.engine.block_pool import BlockPool
from kvserve.workers.engine.config import EngineConfig
from kvserve.workers.engine.request import Request, RequestStatus

# The scheduler's knobs that the engine's config declares (default, help, choices, check): EngineConfig's.
ENGINE_KNOBS = (
    "block_size", "max_num_seqs", "max_num_batched_tokens", "watermark", "preemption_mode", "allocator", "reserve"
)  # fmt: skip


@dataclass(frozen=True)
class SchedulerConfig:
    """The scheduler's knobs: ``ENGINE_KNOBS`` as declared by ``EngineConfig``, plus what the engine resolves.

    Raises:
        ValueError: a bad value, ``"<field> must be ..., got <value>"``.
    """

    block_size: int = same_as(EngineConfig, "block_size")
    max_num_seqs: int = same_as(EngineConfig, "max_num_seqs")
    max_num_batched_tokens: int = same_as(EngineConfig, "max_num_batched_tokens")
    max_model_len: int = knob(4096, help="the resolved context limit", check=POSITIVE)
    watermark: float = same_as(EngineConfig, "watermark")
    preemption_mode: str = same_as(EngineConfig, "preemption_mode")
    # auto mode: swap contexts at least this long (shorter ones are cheaper to recompute)
    swap_min_tokens: int = knob(256, help="auto preemption: swap contexts at least this long")
    # Mistral-style window: blocks wholly behind every future query's window go back to the pool.
    sliding_window: int | None = knob(None, help="the model's attention window", check=POSITIVE)
    # "contiguous" reserves a request's longest possible footprint at admission, as pre-paging
    # engines did (a baseline to measure what paging buys); ``reserve`` picks that footprint.
    allocator: str = same_as(EngineConfig, "allocator")
    reserve: str = same_as(EngineConfig, "reserve")

    def __post_init__(self) -> None:
        validate(self)

    @classmethod
    def from_engine(cls, config: EngineConfig, *, max_model_len: int, sliding_window: int | None) -> SchedulerConfig:
        """The engine's shared knobs with the context limit and window it resolved from the model."""
        shared = {name: getattr(config, name) for name in ENGINE_KNOBS}
        return cls(**shared, max_model_len=max_model_len, sliding_window=sliding_window)


@dataclass
class SchedulerOutput:
    """What the runner executes this step. ``scheduled`` pairs a request with its new-token count."""

    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block)

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class PrefixTier(Protocol):
    """Where blocks missing from the pool may still be found (the host and disk tiers: ``TieredCache``)."""

    def load(self, block_hashes: Sequence[int], block_ids: Sequence[int]) -> list[str]:
        """Load the longest found run of ``block_hashes`` into ``block_ids``; the tier of each loaded block."""
        ...


def _importance(req: Request) -> tuple[int, float]:
    """Sort key: most important first (higher priority, then earlier arrival)."""
    return (-req.priority, req.arrival_time)


class Scheduler:
    """Owns the waiting / running / swapped queues of one engine and the request-to-block mapping."""

    def __init__(
        self,
        config: SchedulerConfig,
        pool: BlockPool,
        swap_pool: BlockPool | None = None,
        model_id: str = "",
    ) -> None:
        self.config = config
        self.pool = pool
        self.swap_pool = swap_pool
        self.model_id = model_id
        self.block_size = config.block_size
        self.watermark_blocks = int(config.watermark * pool.num_blocks)
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.swapped: list[Request] = []
        self.num_preemptions = {"recompute": 0, "swap": 0}
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of which found cached in the pool
        self.prefill_tokens = 0  # tokens computed before a request's newest one (prompt, recompute, replay)
        self.tier: PrefixTier | None = None  # the host/disk tiers, when the engine has them
        self.tier_hits: dict[str, int] = {"host": 0, "disk": 0}  # prompt tokens loaded from each tier

    # ---- queues --------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        """Queue a validated request (see ``check_fits``)."""
        req.status = RequestStatus.WAITING
        self._insert(self.waiting, req)

    @staticmethod
    def _insert(queue: list[Request], req: Request) -> None:
        key = _importance(req)
        i = len(queue)
        while i > 0 and _importance(queue[i - 1]) > key:
            i -= 1
        queue.insert(i, req)

    def check_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Raise ValueError if a request could never run in this pool, before any block is taken."""
        total = self.pool.num_blocks
        need_prompt = blocks_for(num_prompt_tokens, self.block_size)
        if need_prompt > total - self.watermark_blocks:
            raise ValueError(
                f"prompt of {num_prompt_tokens} tokens needs {need_prompt} KV blocks; the pool has "
                f"{total} ({self.watermark_blocks} kept as watermark)"
            )
        longest = min(num_prompt_tokens + max_tokens, self.config.max_model_len)
        if self.config.allocator == "contiguous":
            longest = self._reservation(num_prompt_tokens, max_tokens)
        if blocks_for(longest, self.block_size) > total:
            raise ValueError(
                f"prompt + max_tokens = {longest} tokens needs {blocks_for(longest, self.block_size)} KV "
                f"blocks; the whole pool has {total}"
            )

    def _reservation(self, num_prompt_tokens: int, max_tokens: int) -> int:
        """Tokens a contiguous allocator reserves for a request at admission."""
        if self.config.reserve == "max_model_len":
            return self.config.max_model_len
        return min(num_prompt_tokens + max_tokens, self.config.max_model_len)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.swapped)

    def tokens_in_flight(self) -> int:
        return sum(r.num_tokens for r in self.running)

    # ---- the step ------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        self.running.sort(key=_importance)

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            if self._grow(req, req.num_computed_tokens + num_new, out):
                out.scheduled.append((req, num_new))
                budget -= num_new
                i += 1

        if not out.preempted:
            budget = self._swap_in(out, budget)
            self._admit(out, budget)
        return out

    def _grow(self, req: Request, num_tokens: int, out: SchedulerOutput) -> bool:
        """Give ``req`` blocks for ``num_tokens`` tokens, preempting from the tail; False if it was the victim."""
        need = blocks_for(num_tokens, self.block_size) - len(req.block_table)
        while need > 0:
            blocks = self.pool.allocate(need)
            if blocks is not None:
                req.block_table.extend(blocks)
                return True
            victim = self.running[-1]
            self._preempt(victim, out)
            if victim is req:
                return False
        return True

    def preempt(self, req: Request, mode: str | None = None) -> list[tuple[int, int]] | None:
        """Preempt a running request between steps (router command); ``mode`` overrides the config.

        Returns the (device, host) block copies the caller must run before the next step (empty
        for recompute), or None if the request is not running. A swap that does not fit the host
        space falls back to recompute.
        """
        if req not in self.running:
            return None
        out = SchedulerOutput()
        self._preempt(req, out, mode)
        return out.swap_out

    def detach(self, req: Request) -> None:
        """Take a request out of every queue but keep its blocks (migration export in progress)."""
        for queue in (self.running, self.waiting, self.swapped):
            if req in queue:
                queue.remove(req)

    def reattach(self, req: Request) -> None:
        """Undo ``detach``: the request continues where it stopped."""
        if req.status is RequestStatus.SWAPPED:
            self.swapped.append(req)
        elif req.block_table:
            req.status = RequestStatus.RUNNING
            self.running.append(req)
        else:
            self.add(req)

    def _preempt(self, req: Request, out: SchedulerOutput, mode: str | None = None) -> None:
        self.running.remove(req)
        out.preempted.append(req)
        req.num_preemptions += 1
        # NOTE: a victim is never already scheduled this step: victims come from the tail of the
        # importance-sorted running list, scheduled requests from its head, and the request being
        # grown is taken before any scheduled one.
        live = req.live_blocks
        if self._should_swap(req, mode):
            host = self.swap_pool.allocate(len(live))  # type: ignore[union-attr]
            if host is not None:
                out.swap_out.extend(zip(live, host, strict=True))
                self.pool.free(reversed(live))
                # Released (out-of-window) entries stay as placeholders: positions keep their index.
                req.block_table, req.swap_table = req.block_table[: req.num_released_blocks], host
                req.status = RequestStatus.SWAPPED
                req.num_swaps += 1
                self.num_preemptions["swap"] += 1
                self.swapped.append(req)
                return
        self.pool.free(reversed(live))
        req.block_table = []
        req.num_released_blocks = 0
        req.num_computed_tokens = 0
        req.num_cached_blocks = 0
        req.skip_store_below = 0
        self.num_preemptions["recompute"] += 1
        self.add(req)

    def _should_swap(self, req: Request, mode: str | None = None) -> bool:
        mode = mode or self.config.preemption_mode
        if mode == "recompute" or self.swap_pool is None:
            return False
        if self.swap_pool.num_free_blocks < len(req.live_blocks):
            return False
        return mode == "swap" or req.num_computed_tokens >= self.config.swap_min_tokens

    def admit_imported(self, req: Request, num_computed_tokens: int) -> list[int] | None:
        """Admit a migrated request that brings its KV: it runs at once, in fresh blocks.

        The same rule as admitting a waiting request (``_has_room``: the watermark, the footprint
        of the allocator, ``max_num_seqs``), so an import never takes what admission would not.

        Args:
            req: the request, with its prompt and outputs; it holds no blocks yet.
            num_computed_tokens: tokens whose K/V it brings (the caller writes them into the
                leading blocks returned).

        Returns:
            Its new block table (the request is RUNNING), or None ("not now": no room; nothing
            was taken).

        Raises:
            ValueError: ``num_computed_tokens`` outside ``[0, req.num_tokens]`` or the request
                already holds blocks.
        """
        if not 0 <= num_computed_tokens <= req.num_tokens or req.block_table:
            raise ValueError(f"{req.request_id}: cannot import {num_computed_tokens} of {req.num_tokens} tokens")
        if len(self.running) >= self.config.max_num_seqs:
            return None
        need = self._footprint_blocks(req)
        if not self._has_room(need):
            return None
        blocks = self.pool.allocate(need)
        assert blocks is not None  # _has_room checked the free count
        req.block_table = blocks
        req.num_computed_tokens = num_computed_tokens
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        return blocks

    def _footprint_blocks(self, req: Request) -> int:
        """Blocks a request holds once admitted: its known tokens, or the contiguous reservation."""
        footprint = req.num_tokens
        if self.config.allocator == "contiguous":
            footprint = max(footprint, self._reservation(req.num_prompt_tokens, req.sampling_params.max_tokens))
        return blocks_for(footprint, self.block_size)

    def _has_room(self, need: int, revived: int = 0) -> bool:
        """The one admission rule: taking ``need`` free blocks (and reviving ``revived`` cached
        ones) leaves the watermark free."""
        return self.pool.num_free_blocks - revived - need >= self._watermark()

    def _watermark(self) -> int:
        """Blocks admission keeps free. NOTE: waived while nothing runs: the watermark exists to keep
        running requests from thrashing, and holding it then could leave a request that needs the
        whole pool waiting forever on an empty pool."""
        return self.watermark_blocks if self.running else 0

    def _swap_in(self, out: SchedulerOutput, budget: int) -> int:
        """Bring swapped requests back in arrival order while blocks (and the budget) allow."""
        self.swapped.sort(key=_importance)
        while self.swapped and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.swapped[0]
            if self.waiting and _importance(self.waiting[0]) < _importance(req):
                break  # a more important newcomer goes first (router-ordered preemption relies on it)
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            # Re-reserve what the request held (a chunked prefill reserved its whole prompt).
            released = req.num_released_blocks
            need = max(len(req.swap_table), blocks_for(req.num_tokens, self.block_size) - released)
            if not self._has_room(need):
                break
            blocks = self.pool.allocate(need)
            assert blocks is not None
            out.swap_in.extend(zip(req.swap_table, blocks[: len(req.swap_table)], strict=True))
            self.swap_pool.free(req.swap_table)  # type: ignore[union-attr]
            req.swap_table, req.block_table = [], req.block_table[:released] + blocks
            req.num_cached_blocks = released  # fresh device blocks: re-register their hashes after the step
            req.status = RequestStatus.RUNNING
            self.swapped.pop(0)
            self.running.append(req)
            out.scheduled.append((req, num_new))
            budget -= num_new
        return budget

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        """Admit waiting requests in order while the budget, ``max_num_seqs`` and the pool allow.

        A request whose first uncached block a running request is computing right now waits for it
        (``_prefilling``) instead of computing the same blocks beside it: a burst of requests with a
        new shared prefix computes it once, and the others hit it as soon as it is cached (the
        computing request is running, so it progresses every step: nothing waits for long).
        """
        bs = self.block_size
        prefilling: set[int] | None = None
        i = 0
        while i < len(self.waiting) and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[i]
            req.update_block_hashes(bs, cache_extra(self.model_id, req.cache_salt), req.num_tokens)
            hits = self.pool.find_prefix(req.block_hashes)
            if len(hits) < len(req.block_hashes):
                if prefilling is None:
                    prefilling = self._prefilling()
                if req.block_hashes[len(hits)] in prefilling:
                    i += 1
                    continue
            num_hit_tokens = len(hits) * bs
            need = self._footprint_blocks(req) - len(hits)
            revived = sum(1 for b in hits if self.pool.ref_cnt[b] == 0)
            if not self._has_room(need, revived):
                break
            self.waiting.pop(i)
            self.pool.touch(hits)
            blocks = self.pool.allocate(need)
            assert blocks is not None
            # A miss in the pool may be a hit in a tier: the next blocks of the chain load into fresh
            # blocks and count as computed; their hashes are registered after the step, as computed ones.
            loaded = self.tier.load(req.block_hashes[len(hits) :], blocks) if self.tier is not None else []
            num_pool_hit_tokens = num_hit_tokens
            num_hit_tokens += len(loaded) * bs
            req.block_table = hits + blocks
            req.num_cached_blocks = len(hits)
            # A full hit still runs the last token for its logits; its K/V is already cached.
            req.num_computed_tokens = min(num_hit_tokens, req.num_tokens - 1)
            req.skip_store_below = num_hit_tokens
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit_tokens
                self.prefix_queries += req.num_prompt_tokens
                self.prefix_hits += min(num_pool_hit_tokens, req.num_prompt_tokens)
                for i, tier in enumerate(loaded):
                    self.tier_hits[tier] += max(0, min(bs, req.num_prompt_tokens - num_pool_hit_tokens - i * bs))
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            out.scheduled.append((req, num_new))
            budget -= num_new
            if prefilling is not None:
                prefilling.update(self._uncomputed_hashes(req))

    def _prefilling(self) -> set[int]:
        """Hashes of the blocks running requests have yet to compute and cache."""
        return {h for r in self.running for h in self._uncomputed_hashes(r)}

    @staticmethod
    def _uncomputed_hashes(req: Request) -> list[int]:
        if req.num_computed_tokens >= req.num_tokens - 1:  # decoding: its full blocks are cached
            return []
        return req.block_hashes[req.num_cached_blocks :]

    # ---- after the model ran ----------------------------------------------------------------
    def update(self, out: SchedulerOutput, sampled: Sequence[int | None]) -> list[Request]:
        """Apply a step's results. ``sampled[i]`` is the token for ``out.scheduled[i]`` (None: mid-prefill).

        Returns the requests that got a new token (the caller checks stop conditions).
        """
        grew: list[Request] = []
        for (req, num_new), token in zip(out.scheduled, sampled, strict=True):
            self.prefill_tokens += num_new if req.num_computed_tokens + 1 < req.num_tokens else 0
            req.num_computed_tokens += num_new
            self._cache_full_blocks(req)
            if self.config.sliding_window is not None:
                self._release_out_of_window(req)
            if token is not None:
                req.append_output(token)
                grew.append(req)
        return grew

    def _cache_full_blocks(self, req: Request) -> None:
        if not self.pool.enable_caching:
            return
        full = req.num_computed_tokens // self.block_size
        if full <= req.num_cached_blocks:
            return
        req.update_block_hashes(self.block_size, cache_extra(self.model_id, req.cache_salt), full * self.block_size)
        for i in range(req.num_cached_blocks, full):
            self.pool.cache_block(req.block_table[i], req.block_hashes[i])
        req.num_cached_blocks = full

    def _release_out_of_window(self, req: Request) -> None:
        """Free blocks no future query can see: the next query sits at ``num_computed_tokens`` and
        sees keys after ``position - window``, so block i goes once its last slot is at or before
        ``num_computed_tokens - window``. Its prefix-cache hash stays (evictable), so hits remain valid."""
        window = self.config.sliding_window
        assert window is not None
        behind = (req.num_computed_tokens - window + 1) // self.block_size
        if behind > req.num_released_blocks:
            self.pool.free(reversed(req.block_table[req.num_released_blocks : behind]))
            req.num_released_blocks = behind

    def finish(self, req: Request, reason: str) -> None:
        """Release everything ``req`` holds; it leaves every queue. Idempotent."""
        if req.status is RequestStatus.FINISHED:
            return
        for queue in (self.running, self.waiting, self.swapped):
            if req in queue:
                queue.remove(req)
        if req.block_table:
            self.pool.free(reversed(req.live_blocks))
            req.block_table = []
            req.num_released_blocks = 0
        if req.swap_table:
            self.swap_pool.free(req.swap_table)  # type: ignore[union-attr]
            req.swap_table = []
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason

    def block_tables(self, extra: list[Request] = ()) -> list[list[int]]:  # type: ignore[assignment]
        """Every live device block table (for ``BlockPool.check_integrity``)."""
        return [r.live_blocks for r in [*self.running, *extra] if r.block_table]
