"""Batch -> input tensors -> model -> sampled tokens. Never touches free lists or queues."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import time

import numpy as np
import torch

from workers.attention_metadata import AttentionMetadata
from workers.kv_cache import KVCache
from workers.model import CausalLM
from workers.request import Request
from workers.sampler import Sampler
from workers.scheduler import SchedulerOutput

logger = logging.getLogger(__name__)


def keep_freed_heap_memory() -> bool:
    """Ask glibc malloc to keep freed big buffers for reuse instead of returning them to the OS.

    NOTE: a CPU forward allocates the same multi-MB activations every step (logits alone are
    ``num_seqs x vocab`` floats). By default glibc serves each from a fresh ``mmap`` and unmaps it on
    free, so every step page-faults its whole working set in again (measured: a quarter of the CPU
    time went to the kernel). Raising the mmap and trim thresholds lets the heap recycle them. Process
    wide, harmless for other code; returns False where there is no glibc.
    """
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        m_trim_threshold, m_mmap_threshold = -1, -3
        return bool(libc.mallopt(m_mmap_threshold, 1 << 30) and libc.mallopt(m_trim_threshold, 1 << 31 - 1))
    except (OSError, AttributeError, TypeError):
        return False


class ThreadGovernor:
    """torch's intra-op thread count on a CPU shared with other processes: all of ``max_threads``
    while they run unhindered, one while another process competes for the cores.

    NOTE: every parallel torch op ends at an OpenMP barrier. When another process holds one of our
    cores, each op waits for the descheduled thread: measured on the tiny workload, a mean step of
    13 ms becomes 40 ms with one busy competitor, where a single thread takes 20 ms. The signal is our
    threads' run-queue wait (runnable, not running) from ``/proc/self/task/*/schedstat``, checked
    over windows of steps. A single thread cannot see a competitor on another core, so every
    ``PROBE_S`` seconds a short synthetic probe (a few ms of parallel GEMMs) asks again.
    """

    WINDOW_S = 0.1  # decide after this much wall time of steps
    CONTENDED = 0.1  # run-queue wait per thread per second of wall time above which we back off
    PROBE_S = 2.0

    def __init__(self, max_threads: int) -> None:
        self.max_threads = max_threads
        self.threads = max_threads
        self._window_start = time.perf_counter()
        self._wait_start = _runqueue_wait_s() or 0.0
        self._next_probe = 0.0
        self._probe_input = torch.randn(384, 384)

    @classmethod
    def create(cls) -> ThreadGovernor | None:
        """A governor for this process, or None (one thread, no schedstat, or KVSERVE_THREAD_GOVERNOR=0)."""
        if torch.get_num_threads() < 2 or os.environ.get("KVSERVE_THREAD_GOVERNOR", "1") == "0":
            return None
        return cls(torch.get_num_threads()) if _runqueue_wait_s() is not None else None

    def step_done(self) -> None:
        """Call after each step: backs off at the end of a contended window, probes when due."""
        now = time.perf_counter()
        if self.threads == 1:
            if now >= self._next_probe:
                self._probe()
            return
        elapsed = now - self._window_start
        if elapsed < self.WINDOW_S:
            return
        wait = _runqueue_wait_s() or 0.0
        if self._contended(wait - self._wait_start, elapsed):
            self._set(1)
            self._next_probe = now + self.PROBE_S
        self._window_start, self._wait_start = time.perf_counter(), wait

    def _contended(self, wait_s: float, wall_s: float) -> bool:
        return wait_s > self.CONTENDED * wall_s * self.threads

    def _probe(self) -> None:
        self._set(self.max_threads)
        t0, w0 = time.perf_counter(), _runqueue_wait_s() or 0.0
        for _ in range(16):
            torch.mm(self._probe_input, self._probe_input)
        now, wait = time.perf_counter(), _runqueue_wait_s() or 0.0
        if self._contended(wait - w0, now - t0):
            self._set(1)
            self._next_probe = now + self.PROBE_S
        self._window_start, self._wait_start = now, wait

    def _set(self, threads: int) -> None:
        if threads != self.threads:
            logger.debug("intra-op threads %d -> %d", self.threads, threads)
            torch.set_num_threads(threads)
            self.threads = threads


def _runqueue_wait_s() -> float | None:
    """Seconds this process's threads have spent runnable but not running (Linux schedstat), or None."""
    total = 0
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                total += int(f.read().split()[1])
        except (OSError, IndexError, ValueError):
            continue  # a thread that just exited
    return total / 1e9


class ModelRunner:
    """Turns a ``SchedulerOutput`` into one forward pass and returns one sampled token per request
    whose computed tokens reach its end (None for a request still mid-prefill)."""

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
                logger.info("projections repacked for oneDNN")
        self.governor = ThreadGovernor.create() if self.device.type == "cpu" else None

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> list[int | None]:
        # Decodes first: the attention dispatch expects [decode tokens | prefill chunks].
        order = sorted(range(len(out.scheduled)), key=lambda i: out.scheduled[i][1] != 1)
        batch = [out.scheduled[i] for i in order]
        input_ids, positions, attn, sample_rows, sample_reqs = self.prepare_inputs(batch)
        hidden = self.model(input_ids, positions, self.kv_cache.layers, attn, self.kv_cache.layer_scales)
        sampled: list[int | None] = [None] * len(out.scheduled)
        if sample_reqs:
            reqs = [batch[j][0] for j in sample_reqs]
            hidden = hidden if len(sample_rows) == hidden.shape[0] else hidden[sample_rows]
            params = [r.sampling_params for r in reqs]
            if all(p.greedy and p.logprobs is None for p in params):
                tokens = self.model.greedy_tokens(hidden)
            else:
                logits = self.model.compute_logits(hidden)
                tokens = self.sampler(logits, params, [r.generator for r in reqs])
                _attach_logprobs(logits, tokens, reqs)
            for j, tok in zip(sample_reqs, tokens, strict=True):
                sampled[order[j]] = tok
        if self.governor is not None:
            self.governor.step_done()
        return sampled

    def prepare_inputs(
        self, batch: list[tuple[Request, int]]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor, list[int]]:
        """Flat inputs of a batch ordered [decodes | prefill chunks].

        Returns token ids and positions ``[num_tokens]``, the attention metadata, the rows whose
        hidden state gets sampled (``[num_sampled]`` int64) and their indices into ``batch``.
        """
        bs = self.block_size
        num_reqs = len(batch)
        ids: list[int] = []
        starts = np.empty(num_reqs, dtype=np.int64)
        counts = np.empty(num_reqs, dtype=np.int64)
        skip = np.empty(num_reqs, dtype=np.int64)
        sample_reqs: list[int] = []
        tables = [req.block_table for req, _ in batch]
        width = max(map(len, tables), default=0)
        table = np.zeros((num_reqs, width), dtype=np.int64)
        # NOTE: the only per-request Python: list slices and one row copy each; the per-token work
        # (positions, slots) is vectorised below. Padding with block 0 is safe: kernels never read
        # past a sequence's context length.
        for j, (req, n) in enumerate(batch):
            start = req.num_computed_tokens
            ids += req.all_token_ids[start : start + n]
            starts[j], counts[j], skip[j] = start, n, req.skip_store_below
            table[j, : len(tables[j])] = tables[j]
            if start + n == req.num_tokens:
                sample_reqs.append(j)
        num_tokens = len(ids)
        ends = starts + counts
        # positions: start_j, start_j + 1, ... for each request j, concatenated.
        row = np.repeat(np.arange(num_reqs), counts)  # [num_tokens] request of each token
        cu = np.cumsum(counts)
        pos = np.arange(num_tokens, dtype=np.int64) + np.repeat(starts - (cu - counts), counts)
        slots = table[row, pos // bs] * bs + pos % bs
        slots[pos < skip[row]] = -1
        num_dec = int((counts == 1).sum())  # decodes (one new token) come first
        dev = self.device
        attn = AttentionMetadata(
            slot_mapping=_to(slots, dev),
            num_decode_tokens=num_dec,
            decode_block_tables=_to(_trim(table[:num_dec], ends[:num_dec], bs), dev, torch.int32),
            decode_context_lens=_to(ends[:num_dec], dev, torch.int32),
            prefill_block_tables=_to(_trim(table[num_dec:], ends[num_dec:], bs), dev, torch.int32),
            prefill_cu_seqlens_q=_to(np.concatenate(([0], cu[num_dec:] - num_dec)), dev, torch.int32),
            prefill_context_lens=_to(ends[num_dec:], dev, torch.int32),
        )
        sample_rows = _to(cu[sample_reqs] - 1, dev)
        return _to(np.asarray(ids, dtype=np.int64), dev), _to(pos, dev), attn, sample_rows, sample_reqs


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


def _trim(table: np.ndarray, context_lens: np.ndarray, block_size: int) -> np.ndarray:
    """The columns of a block table its sequences' contexts reach."""
    width = int(-(-context_lens.max() // block_size)) if len(context_lens) else 0
    return table[:, :width]


def _to(a: np.ndarray, device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a)).to(device=device, dtype=dtype)
