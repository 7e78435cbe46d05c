"""The engine: one ``step()`` = schedule, run the model, sample, update.

``LLMEngine`` is the streaming core a worker drives; ``LLM`` is the offline convenience API::

    llm = LLM(model="path/to/hf_dir", block_size=16, kv_cache_memory="2GiB")
    outs = llm.generate(["Hello", [1, 2, 3]], SamplingParams(max_tokens=64, temperature=0.0))
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import operator
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from kvserve.workers.core.request import WorkerRequest
from kvserve.workers.core.sampling_params import SamplingParams
from kvserve.workers.core.sizes import blocks_for
from kvserve.workers.engine.block_pool import BlockPool
from kvserve.workers.engine.config import EngineConfig
from kvserve.workers.engine.cuda_graphs import decode_buckets
from kvserve.workers.engine.kv_cache import KVCache, bytes_per_block, kv_storage_dtype
from kvserve.workers.engine.memory_budget import CudaMeter, ProfileShape, profile_kv_blocks
from kvserve.workers.engine.migration import MigrationState, rebuild_output_text
from kvserve.workers.engine.model_runner import PENDING, Launched, ModelRunner
from kvserve.workers.engine.outputs import CompletionOutput, RequestOutput
from kvserve.workers.engine.progress import RequestProgress
from kvserve.workers.engine.request import Request, RequestStatus
from kvserve.workers.engine.sampler import Sampler, make_token_rng
from kvserve.workers.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from kvserve.workers.engine.stats import EngineStats, engine_stats
from kvserve.workers.engine.stop_checker import advance_output
from kvserve.workers.engine.tier_cost import TierCostModel
from kvserve.workers.engine.tiered_cache import TieredCache
from kvserve.workers.host import cpu_features
from kvserve.workers.models.loader import load_model
from kvserve.workers.models.model import CausalLM
from kvserve.workers.models.model_config import ModelConfig, parse_dtype
from kvserve.workers.text.tokenizer import IncrementalDetokenizer, load_tokenizer

logger = logging.getLogger(__name__)


class LLMEngine:
    """A paged-KV engine for one device. Not thread-safe: one thread owns it (docs/architecture.md)."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = torch.device(
            ("cuda" if torch.cuda.is_available() else "cpu") if config.device == "auto" else config.device
        )
        self.model_config = ModelConfig.from_dir(config.model)
        mc = self.model_config
        self.dtype = mc.dtype if config.dtype == "auto" else parse_dtype(config.dtype)
        self.max_model_len = config.max_model_len or mc.max_position_embeddings
        torch.manual_seed(config.seed)
        self.model = self._load_model(max(self.max_model_len, mc.max_position_embeddings))
        if config.cpu_weights != "fp32" and (self.device.type != "cpu" or self.dtype != torch.float32):
            raise ValueError(f"cpu_weights={config.cpu_weights} applies to a float32 model on CPU, "
                             f"not {str(self.dtype).removeprefix('torch.')} on {self.device}")  # fmt: skip
        self.model.cpu_weights = config.cpu_weights
        self.tokenizer = load_tokenizer(config.model)
        # NOTE: every end id stops (a chat model ends its turn with <|im_end|>, not its primary EOS).
        self.eos_token_ids = frozenset(
            (self.tokenizer.eos_token_ids if self.tokenizer is not None else ()) or mc.eos_token_ids
        )
        # NOTE: bf16 weights compute other K/V than fp32 ones, so their prefix blocks must never meet (the host
        # tier is shared by a node's workers): the mode is part of the id the block hashes include.
        self.model_id = (config.model_id or str(Path(config.model).resolve())) + (
            "" if config.cpu_weights == "fp32" else f"#cpu_weights={config.cpu_weights}"
        )

        self.kv_dtype = kv_storage_dtype(config.kv_cache_dtype, self.dtype)
        # NOTE: the model's own config: a tensor-parallel rank's (kvserve/workers/parallel) has its KV heads only.
        block_bytes = bytes_per_block(self.model.config, config.block_size, self.kv_dtype)
        num_blocks = self._num_blocks(block_bytes)
        num_swap_blocks = config.swap_bytes // block_bytes
        logger.info(
            "KV cache (%s): %d blocks x %d tokens = %d tokens (%.1f MiB); swap: %d blocks",
            str(self.kv_dtype).removeprefix("torch."), num_blocks, config.block_size,
            num_blocks * config.block_size, num_blocks * block_bytes / 2**20, num_swap_blocks,
        )  # fmt: skip
        if self.device.type == "cpu":  # NOTE: a benchmark row must say which ISA its levers chose for
            logger.info("CPU: %s", cpu_features.current().describe())
        self.kv_cache = KVCache(
            self.model.config, num_blocks, config.block_size, self.kv_dtype, self.device, num_swap_blocks
        )
        # Contiguous reservation models pre-paging engines, which shared nothing between requests.
        caching = config.enable_prefix_caching and config.allocator == "paged"
        self.pool = BlockPool(num_blocks, caching)
        self.swap_pool = BlockPool(num_swap_blocks, enable_caching=False) if num_swap_blocks else None
        self.scheduler = Scheduler(
            SchedulerConfig.from_engine(config, max_model_len=self.max_model_len, sliding_window=mc.sliding_window),
            self.pool,
            self.swap_pool,
            self.model_id,
        )
        self.runner = self._make_runner()
        if self.device.type == "cuda" and not config.enforce_eager:
            self.enable_decode_graphs()
        # NOTE: pack_for_cpu either packs bf16 as asked (cpu_gemm.choose raises where it cannot) or packs nothing
        if config.cpu_weights == "bf16" and self.model.gemm_choice is None:
            raise ValueError("cpu_weights=bf16: the CPU GEMMs could not be packed (oneDNN off or unavailable)")
        self.requests: dict[str, Request] = {}
        self.exporting: dict[str, Request] = {}  # paused by export_request, awaiting finish_export
        self.num_steps = 0
        # Overlapped scheduling (config.async_scheduling): the step launched but not yet read back, and the
        # outputs a drain between steps produced (returned by the next step()).
        self._in_flight: tuple[SchedulerOutput, Launched] | None = None
        self._drained: list[RequestOutput] = []
        self.tier_cost = TierCostModel(config.block_size)
        self.tiers: TieredCache | None = None
        if config.tiers_enabled:
            self.tiers = self._make_tiers()
            self.scheduler.tier = self.tiers
            self._probe_tier_costs()

    def _load_model(self, max_positions: int) -> CausalLM:
        """The model this engine runs (a tensor-parallel engine loads its rank's shard instead)."""
        return load_model(self.config.model, self.dtype, self.device, max_positions)

    def _make_runner(self) -> ModelRunner:
        """The runner of this engine's steps (a tensor-parallel engine's broadcasts each step's inputs)."""
        return ModelRunner(self.model, self.kv_cache, Sampler())

    def _make_tiers(self) -> TieredCache:
        """The host/disk tiers of this engine's cache (a tensor-parallel engine's: of every rank's shard)."""
        return TieredCache(self.config, self.kv_cache, self.pool, self.model_id, self.tier_cost)

    def _probe_runner(self, num_blocks: int) -> ModelRunner:
        """A runner over a scratch cache of ``num_blocks`` blocks for the start-up probe (a tensor-parallel
        engine's runs its group's step on free blocks of its own pool instead)."""
        scratch = KVCache(self.model.config, num_blocks, self.config.block_size, self.kv_dtype, self.device)
        return ModelRunner(self.model, scratch, Sampler())

    @torch.inference_mode()
    def _probe_tier_costs(self) -> None:
        """Measure, on this model and machine, a block's recompute (a prefill of a few blocks in a scratch
        cache) and its load from each tier, so the first request already gets the right choice."""
        assert self.tiers is not None
        bs = self.config.block_size
        blocks = max(1, min(4, self.max_model_len // bs))
        runner = self._probe_runner(blocks)
        vocab = self.model_config.vocab_size
        for _ in range(2):  # the first run warms up (allocations, kernel choice); the second is measured
            probe = Request("__tier_probe__", [i % vocab for i in range(1, blocks * bs + 1)],
                            SamplingParams(max_tokens=1, temperature=0.0))  # fmt: skip
            probe.block_table = list(range(blocks))
            t0 = time.perf_counter()
            runner.execute(SchedulerOutput(scheduled=[(probe, blocks * bs)]))
            seconds = time.perf_counter() - t0
        del runner
        self.tier_cost.record_prefill(blocks * bs, seconds)
        self.tiers.probe(block_id=0)  # the pool is empty: block 0 holds nothing yet
        c = self.tier_cost
        logger.info("tier cost model: recompute %.3f ms/block; %s", 1e3 * (c.recompute_s_per_block() or 0.0),
                    ", ".join(f"{t} load {1e3 * s:.3f} ms/block (ratio {c.ratio(t):.3f})"
                              for t, s in c.load_s_per_block.items()))  # fmt: skip

    def _num_blocks(self, block_bytes: int) -> int:
        c = self.config
        if c.num_gpu_blocks is not None:
            return c.num_gpu_blocks
        if self.device.type == "cuda" and c.kv_cache_memory is None:
            return self._profile_cuda_blocks(block_bytes)
        n = c.kv_cache_bytes // block_bytes
        if n <= 0:
            raise ValueError(f"kv_cache_memory={c.kv_cache_memory!r} holds no {block_bytes}-byte KV block")
        return n

    def _profile_cuda_blocks(self, block_bytes: int) -> int:
        """KV blocks that fit in ``gpu_memory_utilization`` x card memory next to this engine's own use: its
        weights, its largest step's activation peak and its decode graphs' pool, no more than is free
        (``memory_budget.profile_kv_blocks``)."""
        shape = ProfileShape.of(self.config, self.kv_dtype, self.max_model_len)
        memory, n = profile_kv_blocks(CudaMeter(self.device), self.model, shape, block_bytes)
        logger.info("CUDA memory: %s -> %d KV blocks", memory.describe(), n)
        return n

    def enable_decode_graphs(self, buckets: Sequence[int] | None = None) -> None:
        """Decode steps replay graphs captured per padded batch size (``cuda_graphs``; default buckets
        ``decode_buckets(max_num_seqs)``). The engine calls it at start-up on CUDA unless ``enforce_eager``;
        on CPU it installs the graphs' eager twin (tests: the same padding and static buffers)."""
        buckets = list(buckets) if buckets is not None else decode_buckets(self.config.max_num_seqs)
        t0 = time.perf_counter()
        self.runner.capture_decode_graphs(buckets, self.max_model_len)
        logger.info("decode graphs for batch sizes %s ready in %.1f s", buckets, time.perf_counter() - t0)

    # ---- requests ------------------------------------------------------------------------
    def add_request(self, request: WorkerRequest) -> Request:
        """Validate and queue a request, or resume one (replay after its worker died).

        Args:
            request: the one message a request enters a worker as (kvserve/workers/core/request.py):
                ``request_id`` unique among this engine's live requests; ``prompt`` the original
                prompt (text or token ids); ``params`` with ``max_tokens`` the whole budget, streamed
                tokens included; ``priority`` (larger is more important); ``cache_salt`` (prefix-cache
                isolation key); ``resume_output_ids``: output tokens the client already has (replay):
                the request continues exactly after them. Their K/V is recomputed (like a recompute
                preemption); outputs report ``num_output_tokens`` counting them; the seeded RNG draws
                what it would have drawn for token ``len(resume_output_ids)``; text held back (a stop
                string's prefix, a split UTF-8 character) is rebuilt and released as the original
                would have. Empty for a new request.

        Returns:
            The queued request.

        Raises:
            ValueError: bad input (nothing allocated), including a resume whose tokens are out of
                the vocabulary, use up the budget, or already hit a stop rule.
        """
        request_id, params = request.request_id, request.params
        prompt = request.prompt if isinstance(request.prompt, str) else list(request.prompt)
        resume_output_ids, priority, cache_salt = request.resume_output_ids, request.priority, request.cache_salt
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        token_ids = self.encode(prompt)
        if len(token_ids) > self.max_model_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens, more than max_model_len={self.max_model_len}")
        self.scheduler.check_fits(len(token_ids), params.max_tokens)
        outputs = self._check_resume(resume_output_ids, params) if resume_output_ids else []
        req = self._continued_request(request_id, token_ids, outputs, params, priority, cache_salt)
        if outputs:
            req.detokenizer, req.output_text = rebuild_output_text(
                self.tokenizer, token_ids, outputs, params, self.eos_token_ids, self.max_model_len
            )
        self.requests[request_id] = req
        self.scheduler.add(req)
        return req

    def _check_resume(self, output_ids: Sequence[int], params: SamplingParams) -> list[int]:
        try:
            ids = self.encode(output_ids)  # same integer / vocabulary checks as a prompt
        except ValueError as e:
            raise ValueError(f"resume_output_ids: {e}".replace("prompt ", "")) from e
        if len(ids) >= params.max_tokens:
            raise ValueError(f"resume has {len(ids)} output tokens; max_tokens={params.max_tokens} leaves none to do")
        return ids

    def _continued_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        output_ids: list[int],
        params: SamplingParams,
        priority: int,
        cache_salt: str | None,
        arrival_time: float | None = None,
    ) -> Request:
        """A request that has produced ``output_ids`` (none: a new one), with its RNG and a fresh
        detokenizer; a continued request's caller sets the detokenizer and shown text."""
        req = Request(
            request_id, list(prompt_ids), params, priority=priority, cache_salt=cache_salt,
            output_token_ids=list(output_ids),
        )  # fmt: skip
        if arrival_time is not None:
            req.arrival_time = arrival_time
        # NOTE: the RNG is a function of (seed, output index): a continued request draws token
        # len(output_ids) next, exactly as the original would have; nothing else is carried.
        req.rng = make_token_rng(params.seed, self.device)
        if self.tokenizer is not None:
            req.detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_ids)
        return req

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        """Prompt text or ids -> validated token ids (ValueError naming the problem)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompt given but the model has no tokenizer.json; pass token ids")
            token_ids = self.tokenizer.encode(prompt)
        else:
            if any(isinstance(t, bool) for t in prompt):
                raise ValueError("prompt token ids must be integers, not booleans")
            try:
                # operator.index takes ints and numpy integers, refuses floats and strings.
                token_ids = [operator.index(t) for t in prompt]
            except TypeError as e:
                raise ValueError(f"prompt token ids must be integers: {e}") from e
        if not token_ids:
            raise ValueError("prompt is empty")
        vocab = self.model_config.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad!r} is outside the vocabulary [0, {vocab})")
        return token_ids

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free its blocks; None if it is unknown or already finished."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if req.output_token_ids and req.output_token_ids[-1] == PENDING:  # in flight: never streamed
            req.output_token_ids.pop()
            req.all_token_ids.pop()
        self.scheduler.finish(req, "abort")
        return self._output(req, (), "")

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0 or self._in_flight is not None or bool(self._drained)

    # ---- the step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one batch. Returns news for every request that produced a token or finished."""
        if self.config.async_scheduling:
            return self._step_overlapped()
        scheduled = self.scheduler.schedule()
        if self.tiers is not None:  # blocks this schedule evicted: out to the tiers before anything rewrites them
            self.tiers.spill_evicted()
        self.publish_tier_events()
        # Swaps before the forward (a block swapped out now may be rewritten by it), and even in a
        # step that runs nothing: a preemption can swap out every running request, and a copy not
        # made now is lost, leaving garbage to swap back in (and to cache under a hash).
        self.kv_cache.swap_out(scheduled.swap_out)
        self.kv_cache.swap_in(scheduled.swap_in)
        if scheduled.is_empty:
            return []
        t0 = time.perf_counter()
        sampled = self.runner.execute(scheduled)
        if self.tiers is not None:
            self._measure_prefill(scheduled, time.perf_counter() - t0)
        grew = self.scheduler.update(scheduled, sampled)
        self.num_steps += 1
        return [self._on_new_token(req) for req in grew]

    def _step_overlapped(self) -> list[RequestOutput]:
        """One step of overlapped scheduling (vLLM V1's async scheduling, SGLang's overlap scheduler).

        Step N is in flight (on CUDA: queued, not synchronised). The host schedules step N+1 meanwhile: a
        request sampled in step N holds a ``PENDING`` token, so it decodes again, reading that token from
        step N's ids on the device. Then the host reads step N's ids (the one sync), streams them and
        checks stops; step N+1's tokens come back one step later.

        Contract: no output carries a token past a stop. A stop found late (EOS, stop token or string, an
        abort) finishes the request at once (its blocks go back); the token step N+1 computed for it is
        dropped when N+1 is read. Requests that will stop on length are not scheduled again (nothing to drop).

        Preemption needs no drain: a schedule that preempts admits and swaps in nothing, so a victim's
        ``PENDING`` is resolved (below) before any schedule could hash it, and no K/V was ever written for it
        (a swap copies computed positions only, queued behind step N on the same stream). The router's
        commands between steps, which must see host ids (export, import, preempt), drain first (``_drain``):
        correct over clever.
        """
        outputs, self._drained = self._drained, []
        prev = self._in_flight
        held = self._finishing_on_length()
        for req in held:
            self.scheduler.detach(req)
        scheduled = self.scheduler.schedule()
        for req in held:
            self.scheduler.reattach(req)
        if self.tiers is not None:
            self.tiers.spill_evicted()
        self.publish_tier_events()
        self.kv_cache.swap_out(scheduled.swap_out)  # before the forward: see step()
        self.kv_cache.swap_in(scheduled.swap_in)
        launched = None if scheduled.is_empty else self.runner.launch(scheduled, prev[1] if prev else None)
        self._in_flight = None
        if prev is not None:  # step N's ids, read while N+1 runs
            outputs += self._resolve(*prev)
        if launched is not None:
            self.runner.start_fetch(launched)
            self._record_launch(scheduled, launched)
        return outputs

    def _record_launch(self, scheduled: SchedulerOutput, launched: Launched) -> None:
        """Advance the requests of a launched step as if its tokens were known (``PENDING`` stands in);
        a request that finished meanwhile (a stop found late, an abort) is left alone."""
        sampled: list[int | None] = [None] * len(scheduled.scheduled)
        for i in launched.rows:
            sampled[i] = PENDING
        keep = [i for i, (req, _) in enumerate(scheduled.scheduled) if req.status is not RequestStatus.FINISHED]
        self.scheduler.update(
            SchedulerOutput(scheduled=[scheduled.scheduled[i] for i in keep]), [sampled[i] for i in keep]
        )
        self.num_steps += 1
        self._in_flight = (scheduled, launched)

    def _resolve(self, scheduled: SchedulerOutput, launched: Launched) -> list[RequestOutput]:
        """Read a launched step's ids, put each in place of its ``PENDING`` and stream it (stop checks).
        A request finished since the launch gets nothing: its token is past its stop."""
        outputs = []
        for req, token in zip(launched.reqs, self.runner.collect(launched), strict=True):
            if req.status is RequestStatus.FINISHED:
                continue
            assert req.output_token_ids[-1] == PENDING, req.request_id
            req.output_token_ids[-1] = req.all_token_ids[-1] = token
            outputs.append(self._on_new_token(req))
        return outputs

    def _drain_now(self) -> list[RequestOutput]:
        """Resolve the step in flight: afterwards every request's tokens are known on the host."""
        prev, self._in_flight = self._in_flight, None
        return self._resolve(*prev) if prev is not None else []

    def _drain(self) -> None:
        """Drain before a command between steps that must see host ids (preemption, export, import);
        its outputs go out with the next ``step()``."""
        self._drained += self._drain_now()

    def _finishing_on_length(self) -> list[Request]:
        """Running requests whose pending token is their last (max_tokens or the model's length): their
        stop is certain, so they are not scheduled again."""
        return [
            r
            for r in self.scheduler.running
            if r.output_token_ids
            and r.output_token_ids[-1] == PENDING
            and (r.num_output_tokens >= r.sampling_params.max_tokens or r.num_tokens >= self.max_model_len)
        ]

    def _measure_prefill(self, scheduled: SchedulerOutput, seconds: float) -> None:
        """Feed the tier cost model with a step that was mostly prefill (a decode token is far cheaper
        than a prompt token in a long chunk, so mixed steps would understate recompute)."""
        prefill = sum(n for _, n in scheduled.scheduled if n > 1)
        if prefill >= self.config.block_size and 2 * prefill >= scheduled.num_batched_tokens:
            self.tier_cost.record_prefill(scheduled.num_batched_tokens, seconds)

    def _on_new_token(self, req: Request) -> RequestOutput:
        token = req.output_token_ids[-1]
        reason, delta = advance_output(
            req.output_token_ids, req.detokenizer, req.output_text, req.sampling_params, self.eos_token_ids,
            req.num_tokens >= self.max_model_len,
        )  # fmt: skip
        req.output_text += delta
        if reason is not None:
            self.scheduler.finish(req, reason)
            del self.requests[req.request_id]
        logprobs = (req.new_logprobs,) if req.new_logprobs is not None else ()
        req.new_logprobs = None
        return self._output(req, (token,), delta, logprobs)

    @staticmethod
    def _output(
        req: Request, new_ids: tuple[int, ...], delta: str, logprobs: tuple[dict[int, float], ...] = ()
    ) -> RequestOutput:
        return RequestOutput(
            request_id=req.request_id,
            new_token_ids=new_ids,
            text_delta=delta,
            finish_reason=req.finish_reason,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=max(req.num_cached_tokens, 0),
            num_output_tokens=req.num_output_tokens,
            num_preemptions=req.num_preemptions,
            num_swaps=req.num_swaps,
            new_logprobs=logprobs,
        )

    # ---- router commands (between steps) ---------------------------------------------------
    def preempt_request(self, request_id: str, mode: str | None = None) -> bool:
        """Preempt a running request now (swap copies run at once). False if not running."""
        self._drain()
        req = self.requests.get(request_id)
        copies = self.scheduler.preempt(req, mode) if req is not None else None
        if copies is None:
            return False
        self.kv_cache.swap_out(copies)
        return True

    def export_request(self, request_id: str) -> MigrationState | None:
        """Pause a request and return its full state (KV on the host). None if unknown.

        The request keeps its blocks until ``finish_export``: migrated -> freed, else resumed.
        """
        self._drain()
        req = self.requests.get(request_id)
        if req is None or request_id in self.exporting:
            return None
        self.scheduler.detach(req)
        self.exporting[request_id] = req
        kv, scales = None, None
        if req.swap_table:
            kv, scales = self.kv_cache.read_blocks(req.swap_table, swapped=True)
        elif req.block_table and req.num_computed_tokens:
            kv, scales = self.kv_cache.read_blocks(
                req.block_table[: blocks_for(req.num_computed_tokens, self.config.block_size)]
            )
        detok = req.detokenizer
        return MigrationState(
            request_id=req.request_id,
            prompt_token_ids=list(req.prompt_token_ids),
            output_token_ids=list(req.output_token_ids),
            sampling_params=req.sampling_params,
            priority=req.priority,
            cache_salt=req.cache_salt,
            arrival_time=req.arrival_time,
            num_computed_tokens=req.num_computed_tokens if kv is not None else 0,
            block_size=self.config.block_size,
            model_id=self.model_id,
            kv_blocks=kv,
            kv_scales=scales,
            output_text=req.output_text,
            detokenizer=detok.snapshot() if detok is not None else None,
            num_cached_tokens=req.num_cached_tokens,
            num_preemptions=req.num_preemptions,
            num_swaps=req.num_swaps,
        )

    def finish_export(self, request_id: str, migrated: bool) -> bool:
        """After an export: free the request (it lives elsewhere now) or resume it here."""
        req = self.exporting.pop(request_id, None)
        if req is None:
            return False
        if migrated:
            self.scheduler.finish(req, "migrated")
            self.requests.pop(request_id, None)  # an abort may have removed it meanwhile
        else:
            self.scheduler.reattach(req)
        return True

    def import_request(self, state: MigrationState) -> bool | None:
        """Continue an exported request here. None ("not now") if its blocks do not fit.

        Raises ValueError if the state cannot belong to this engine (block size, model, id clash).
        """
        self._drain()
        if state.block_size != self.config.block_size:
            raise ValueError(f"block size {state.block_size} != this worker's {self.config.block_size}")
        if state.model_id != self.model_id:
            raise ValueError(f"model {state.model_id!r} != this worker's {self.model_id!r}")
        if state.request_id in self.requests:
            raise ValueError(f"request id {state.request_id!r} is already in use")
        if state.kv_blocks is not None:
            self.kv_cache.check_blocks(state.kv_blocks, state.kv_scales)
        req = self._continued_request(
            state.request_id, state.prompt_token_ids, state.output_token_ids, state.sampling_params,
            state.priority, state.cache_salt, state.arrival_time,
        )  # fmt: skip
        req.num_cached_tokens = state.num_cached_tokens
        req.num_preemptions, req.num_swaps = state.num_preemptions, state.num_swaps
        if self.tokenizer is not None and state.detokenizer is not None:
            req.detokenizer = IncrementalDetokenizer.restore(self.tokenizer, state.detokenizer)
            req.output_text = state.output_text
        elif state.output_token_ids:
            # No snapshot (an exporter without a tokenizer): rebuild as a replay would.
            req.detokenizer, req.output_text = rebuild_output_text(
                self.tokenizer, req.prompt_token_ids, req.output_token_ids, req.sampling_params,
                self.eos_token_ids, self.max_model_len,
            )  # fmt: skip
        if state.kv_blocks is not None:
            blocks = self.scheduler.admit_imported(req, state.num_computed_tokens)
            if blocks is None:
                return None
            if self.tiers is not None:  # the fresh blocks may have been evicted just now
                self.tiers.spill_evicted()
            self.kv_cache.write_blocks(blocks[: state.kv_blocks[0].shape[1]], state.kv_blocks, state.kv_scales)
        else:
            self.scheduler.add(req)
        self.requests[req.request_id] = req
        return True

    def publish_tier_events(self) -> None:
        """Move the tier writer's events (host/disk stored, removed) into the pool's event stream."""
        if self.tiers is not None:
            self.tiers.publish_events()

    def close(self) -> None:
        """Finish pending tier writes and stop their thread (the engine stays usable without spills)."""
        if self.tiers is not None:
            self.tiers.close()
            self.pool.record_evictions = False
            self.scheduler.tier = None
            self.tiers = None

    def make_stats(self) -> EngineStats:
        """This engine's pool, queues, tiers and running totals as of now (its thread only): what its
        worker reports (kvserve/workers/engine/stats.py)."""
        return engine_stats(self)

    def check_integrity(self) -> None:
        """Pool invariants plus ref counts == block-table references (tests call this every step)."""
        self.pool.check_integrity(self.scheduler.block_tables(list(self.exporting.values())))
        if self.swap_pool is not None:
            self.swap_pool.check_integrity([r.swap_table for r in self.scheduler.swapped])


def make_engine(config: EngineConfig) -> LLMEngine:
    """The engine ``config`` asks for: ``LLMEngine``, or with ``tensor_parallel_size`` > 1 the rank-0 engine of
    a group whose other ranks it starts (kvserve/workers/parallel/engine.py)."""
    if config.tensor_parallel_size == 1:
        return LLMEngine(config)
    from kvserve.workers.parallel.engine import TPEngine

    return TPEngine(config)


class LLM:
    """Offline batch generation over an ``LLMEngine``. Keyword args are ``EngineConfig`` fields."""

    def __init__(self, model: str | EngineConfig, **kwargs: object) -> None:
        if isinstance(model, EngineConfig):
            if kwargs:
                raise TypeError("give engine arguments either as an EngineConfig or as keywords, not both")
            config = model
        else:
            fields = {f.name for f in dataclasses.fields(EngineConfig)}
            unknown = set(kwargs) - fields
            if unknown:
                raise TypeError(f"unknown engine arguments {sorted(unknown)}; valid: {sorted(fields - {'model'})}")
            config = EngineConfig(model=model, **kwargs)  # type: ignore[arg-type]
        self.engine = make_engine(config)
        self._ids = itertools.count()

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        return cls(config)

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        check_integrity: bool = False,
    ) -> list[CompletionOutput]:
        """Generate for every prompt; results in input order. Invalid prompts raise before any runs."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params = sampling_params or SamplingParams()
        params_list = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(params_list)} sampling params for {len(prompts)} prompts")
        engine = self.engine
        ids = [f"llm-{next(self._ids)}" for _ in prompts]
        added: list[str] = []
        try:
            for rid, prompt, p in zip(ids, prompts, params_list, strict=True):
                engine.add_request(WorkerRequest(rid, prompt, p))
                added.append(rid)
        except ValueError:
            for rid in added:
                engine.abort_request(rid)
            raise
        results = {rid: CompletionOutput(rid, engine.requests[rid].prompt_token_ids, [], "", None, 0, 0) for rid in ids}
        with RequestProgress(len(ids), use_tqdm, "generating") as advance:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    res = results[out.request_id]
                    res.token_ids.extend(out.new_token_ids)
                    if out.new_logprobs:
                        res.logprobs = res.logprobs if res.logprobs is not None else []
                        res.logprobs.extend(out.new_logprobs)
                    res.text += out.text_delta
                    res.num_cached_tokens = out.num_cached_tokens
                    res.num_preemptions = out.num_preemptions
                    if out.finished:
                        res.finish_reason = out.finish_reason
                        advance()
                if check_integrity:
                    engine.check_integrity()
        return [results[rid] for rid in ids]
