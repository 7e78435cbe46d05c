"""Batch -> input tensors -> model -> sampled tokens. Never touches free lists or queues."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence

import torch

from kvserve.workers.engine.attention_metadata import AttentionMetadata
from kvserve.workers.engine.cuda_graphs import DecodeGraphs
from kvserve.workers.engine.host_ids import HostIds
from kvserve.workers.engine.input_buffers import StepBuffers
from kvserve.workers.engine.kv_cache import KVCache
from kvserve.workers.engine.request import Request
from kvserve.workers.engine.sampler import Sampler
from kvserve.workers.engine.scheduler import SchedulerOutput
from kvserve.workers.host.host_tuning import ThreadGovernor, keep_freed_heap_memory
from kvserve.workers.models.model import CausalLM

logger = logging.getLogger(__name__)


class ModelRunner:
    """Turns a ``SchedulerOutput`` into one forward pass and returns one sampled token per request
    whose computed tokens reach its end (None for a request still mid-prefill).

    Inputs go through persistent buffers (``input_buffers``); after ``capture_decode_graphs`` a
    pure-decode step replays a captured graph (``cuda_graphs``), any other step runs eagerly."""

    def __init__(self, model: CausalLM, kv_cache: KVCache, sampler: Sampler) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.sampler = sampler
        self.device = kv_cache.device
        self.block_size = kv_cache.block_size
        if self.device.type == "cpu":
            if not keep_freed_heap_memory():
                logger.info("mallopt unavailable: big CPU buffers are re-faulted every step")
            if model.pack_for_cpu():
                logger.info("CPU GEMMs: %s", model.cpu_gemm_summary())
        self.governor = ThreadGovernor.create() if self.device.type == "cpu" else None
        self.buffers = StepBuffers(self.device)
        self.host_ids = HostIds(self.device)
        self.decode_graphs: DecodeGraphs | None = None  # set by capture_decode_graphs

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> list[int | None]:
        """One step, synchronously: launch it and read its ids. ``sampled[i]`` is the token of
        ``out.scheduled[i]`` (None: mid-prefill)."""
        launched = self.launch(out)
        self.start_fetch(launched)
        tokens = self.collect(launched)
        sampled: list[int | None] = [None] * len(out.scheduled)
        for i, tok in zip(launched.rows, tokens, strict=True):
            sampled[i] = tok
        return sampled

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput, feed: Launched | None = None) -> Launched:
        """Queue a step's forward and sampling; the sampled ids stay on the device (nothing syncs on CUDA).

        Args:
            out: the batch.
            feed: the previous step, still in flight (overlapped scheduling): a decode whose input token
                is ``PENDING`` (the host does not know it yet) takes it from ``feed.ids`` on the device.
                The ids are then cloned, so the next graph replay cannot overwrite them before they are read.
        """
        # Decodes first: the attention dispatch expects [decode tokens | prefill chunks].
        order = sorted(range(len(out.scheduled)), key=lambda i: out.scheduled[i][1] != 1)
        batch = [out.scheduled[i] for i in order]
        fix = _pending_inputs(batch, feed)
        graphs = self.decode_graphs
        greedy_ids: torch.Tensor | None = None  # the graph's greedy head, where a graph ran
        if graphs is not None and batch and batch[-1][1] == 1 and graphs.bucket(len(batch)) is not None:
            # Every request decodes one token: the padded static buffers and the bucket's graph.
            hidden, greedy_ids, sample_reqs = graphs.run(batch, self.block_size, fix)
            if len(sample_reqs) < len(batch):
                hidden, greedy_ids = hidden[sample_reqs], greedy_ids[sample_reqs]
        else:
            input_ids, positions, attn, sample_rows, sample_reqs = self.prepare_inputs(batch)
            if fix is not None:
                fix(input_ids)
            hidden = self.model(input_ids, positions, self.kv_cache.layers, attn, self.kv_cache.layer_scales)
            if sample_reqs and len(sample_rows) != hidden.shape[0]:
                hidden = hidden[sample_rows]
        reqs = [batch[j][0] for j in sample_reqs]
        launched = Launched(reqs=reqs, rows=[order[j] for j in sample_reqs])
        if reqs:
            params = [r.sampling_params for r in reqs]
            if all(p.greedy and p.logprobs is None for p in params):
                ids = greedy_ids if greedy_ids is not None else self.model.greedy_token_ids(hidden)
                if feed is not None and greedy_ids is not None:
                    ids = ids.clone()
            else:
                launched.logits = self.model.compute_logits(hidden)
                ids = self.sampler.sample(launched.logits, params, [r.generator for r in reqs])
            launched.ids = ids
        if self.governor is not None:
            self.governor.step_done()
        return launched

    def start_fetch(self, launched: Launched) -> None:
        """Queue the device→host copy of ``launched``'s ids (at most one outstanding: ``HostIds``' one buffer)."""
        if launched.ids is not None:
            self.host_ids.start(launched.ids)

    @torch.inference_mode()
    def collect(self, launched: Launched) -> list[int]:
        """Wait for ``launched``'s ids on the host (the step's one sync) and attach the logprobs asked for.
        Returns one id per ``launched.reqs``."""
        if launched.ids is None:
            return []
        tokens = self.host_ids.wait()
        if launched.logits is not None:
            _attach_logprobs(launched.logits, tokens, launched.reqs)
            launched.logits = None
        return tokens

    def prepare_inputs(
        self, batch: list[tuple[Request, int]]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor, list[int]]:
        """Flat inputs of a batch ordered [decodes | prefill chunks], written into the runner's persistent
        buffers (``input_buffers.StepBuffers``: one upload per dtype; valid until the next step).

        Returns token ids and positions ``[num_tokens]``, the attention metadata, the rows whose
        hidden state gets sampled (``[num_sampled]`` int64) and their indices into ``batch``.
        """
        s = self.buffers.stage(batch, self.block_size)
        return s.input_ids, s.positions, s.attn, s.sample_rows, s.sample_reqs

    def capture_decode_graphs(self, buckets: Sequence[int], max_model_len: int) -> None:
        """Capture the decode forward for each padded batch size in ``buckets`` (CUDA graphs; on CPU
        their eager twin, ``cuda_graphs.EagerGraph``). From then on a step whose requests all decode
        one token, at most ``max(buckets)`` of them, replays the smallest bucket that holds it.

        The KV cache must not be reallocated afterwards (the graphs hold its addresses).
        """
        cache = self.kv_cache

        def forward(ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata) -> tuple[torch.Tensor, ...]:
            hidden = self.model(ids, positions, cache.layers, attn, cache.layer_scales)
            return hidden, self.model.greedy_token_ids(hidden)

        graphs = DecodeGraphs(forward, buckets, -(-max_model_len // self.block_size), self.device)
        graphs.capture()
        self.decode_graphs = graphs


# A sampled token the host does not know yet (overlapped scheduling): its id is on the device.
PENDING = -1


@dataclasses.dataclass
class Launched:
    """A step whose forward and sampling are queued: ``ids[k]`` (device) is the token of ``reqs[k]``,
    which is ``out.scheduled[rows[k]]``."""

    reqs: list[Request]
    rows: list[int]
    ids: torch.Tensor | None = None  # [len(reqs)] int64, on the device
    logits: torch.Tensor | None = None  # kept for logprobs where the sampler ran


def _pending_inputs(
    batch: list[tuple[Request, int]], feed: Launched | None
) -> Callable[[torch.Tensor], None] | None:
    """The device-side fix of a batch's input ids: each decode row (decodes are the first rows, one token
    each) whose last token is ``PENDING`` reads it from ``feed.ids``. None when no row needs it.

    NOTE: pending rows need not be contiguous: a new request with a full prefix hit also decodes one
    token, and a more important one sorts before the pending ones."""
    if feed is None or feed.ids is None:
        return None
    src = {id(r): k for k, r in enumerate(feed.reqs)}
    rows, from_ = [], []
    for j, (req, n) in enumerate(batch):
        if n == 1 and req.all_token_ids[-1] == PENDING:
            rows.append(j)
            from_.append(src[id(req)])
    if not rows:
        return None
    ids = feed.ids
    index = torch.tensor([rows, from_], dtype=torch.int64).to(ids.device, non_blocking=True)

    def fix(input_ids: torch.Tensor) -> None:
        input_ids.index_copy_(0, index[0], ids.index_select(0, index[1]).to(input_ids.dtype))

    return fix


def _attach_logprobs(logits: torch.Tensor, tokens: list[int], reqs: list[Request]) -> None:
    """``req.new_logprobs`` = {sampled token: logprob} plus the top ``logprobs`` tokens, for the
    requests that asked (log-softmax of the raw logits, as vLLM reports them)."""
    rows = [i for i, r in enumerate(reqs) if r.sampling_params.logprobs is not None]
    if not rows:
        return
    logprobs = torch.log_softmax(logits[rows].float(), dim=-1)
    chosen = logprobs.gather(1, torch.tensor([tokens[i] for i in rows], device=logits.device).view(-1, 1))
    k = max(reqs[i].sampling_params.logprobs or 0 for i in rows)
    top_values, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0].long())
    for j, i in enumerate(rows):
        n = reqs[i].sampling_params.logprobs or 0
        entry = dict(zip(top_ids[j, :n].tolist(), top_values[j, :n].tolist(), strict=True))
        entry[tokens[i]] = float(chosen[j, 0])
        reqs[i].new_logprobs = entry
