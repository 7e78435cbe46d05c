"""Persistent step inputs: a step's token ids, positions and attention metadata are written into buffers
allocated once (host staging, pinned on CUDA) and reach the device with one copy per buffer.

Two layouts, one filling rule (``_fill``):

- ``StepBuffers`` (every eager step): one int64 and one int32 staging area, packed per step
  (``[ids | positions | slots | sample rows]`` and ``[context lens | cu_seqlens_q | decode table |
  prefill table]``), so a step uploads two copies whatever its shape; the step's tensors are views.
  They grow (rarely, by doubling) when a step needs more room.
- ``DecodeBuffers`` (the decode graphs): fixed addresses, because a captured CUDA graph reads the
  device tensors it was captured on. Rows past the real batch are padding that reads block 0 and
  stores nowhere (slot -1), so a padded row never writes into a real block. Block tables are not
  rebuilt per step: each decoding request keeps a row of a persistent device table, a step uploads
  only the entries that changed there (one scatter) and one gather lays the batch's rows out for the
  graph (``table_mirror.TableRows`` is the host side).

NOTE (contract): staging is rewritten by the next step, so on CUDA each buffer records an event after its
upload and waits for it before writing staging again (a step that samples nothing, e.g. a prefill chunk,
ends without the token read-back that would otherwise have synchronised).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvserve.workers.engine.attention_metadata import AttentionMetadata
from kvserve.workers.engine.request import Request
from kvserve.workers.engine.table_mirror import TableRows


@dataclass
class StepInputs:
    """One step's model inputs (views of persistent device buffers) and what gets sampled."""

    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    attn: AttentionMetadata
    sample_rows: torch.Tensor  # [num_sampled] int64, rows of the hidden states to sample
    sample_reqs: list[int]  # their indices into the batch


@dataclass
class _Filled:
    """Host-side (numpy) step layout shared by both buffer kinds."""

    ids: np.ndarray  # [num_tokens] int64
    positions: np.ndarray
    slots: np.ndarray
    ends: np.ndarray  # [num_reqs] context length after the step
    cu: np.ndarray  # [num_reqs] cumulative token counts
    table: np.ndarray  # [num_reqs, width] int64, zero-padded
    num_decodes: int
    sample_reqs: list[int]


def _fill(batch: list[tuple[Request, int]], block_size: int) -> _Filled:
    """The vectorised layout of a batch ordered [decodes | prefill chunks] (the only per-request Python:
    list appends and slices and one row copy each, from the request's table mirror:
    kvserve/workers/engine/table_mirror.py; no per-row numpy scalar writes). Padding a block table with
    block 0 is safe: kernels never read past a sequence's context length."""
    bs = block_size
    num_reqs = len(batch)
    ids: list[int] = []
    first: list[int] = []
    counts_l: list[int] = []
    skip_l: list[int] = []
    sample_reqs: list[int] = []
    tables = [req.table_mirror.view(req.block_table) for req, _ in batch]
    width = max(map(len, tables), default=0)
    table = np.zeros((num_reqs, width), dtype=np.int64)
    for j, (req, n) in enumerate(batch):
        start = req.num_computed_tokens
        tokens = req.all_token_ids
        ids += tokens[start : start + n]
        first.append(start)
        counts_l.append(n)
        skip_l.append(req.skip_store_below)
        table[j, : len(tables[j])] = tables[j]
        if start + n == len(tokens):
            sample_reqs.append(j)
    starts = np.array(first, dtype=np.int64)
    counts = np.array(counts_l, dtype=np.int64)
    skip = np.array(skip_l, dtype=np.int64)
    ends = starts + counts
    num_tokens = len(ids)
    # positions: start_j, start_j + 1, ... for each request j, concatenated.
    row = np.repeat(np.arange(num_reqs), counts)  # [num_tokens] request of each token
    cu = np.cumsum(counts)
    pos = np.arange(num_tokens, dtype=np.int64) + np.repeat(starts - (cu - counts), counts)
    slots = table[row, pos // bs] * bs + pos % bs
    slots[pos < skip[row]] = -1
    num_dec = int((counts == 1).sum())  # decodes (one new token) come first
    return _Filled(np.asarray(ids, dtype=np.int64), pos, slots, ends, cu, table, num_dec, sample_reqs)


def _width(context_lens: np.ndarray, block_size: int) -> int:
    """Block-table columns the contexts reach."""
    return int(-(-context_lens.max() // block_size)) if len(context_lens) else 0


def _staging(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host buffer; pinned where the device is CUDA (so its upload can be asynchronous)."""
    return torch.zeros(n, dtype=dtype, pin_memory=device.type == "cuda")


class _UploadFence:
    """On CUDA: the event after the last upload from a staging buffer, waited for before it is rewritten."""

    def __init__(self, device: torch.device) -> None:
        self._event = torch.cuda.Event() if device.type == "cuda" else None

    def before_write(self) -> None:
        if self._event is not None:
            self._event.synchronize()  # NOTE: no-op where nothing was recorded yet

    def after_upload(self) -> None:
        if self._event is not None:
            self._event.record()


class StepBuffers:
    """The eager steps' inputs: two staging areas (int64, int32) and their device twins, packed per step.

    On CPU the device buffers are the staging buffers themselves (nothing to upload).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._host = {torch.int64: _staging(0, torch.int64, device), torch.int32: _staging(0, torch.int32, device)}
        self._dev = dict(self._host)
        self._fence = _UploadFence(device)

    def _area(self, dtype: torch.dtype, n: int) -> tuple[np.ndarray, torch.Tensor]:
        """Staging (numpy view) and device buffer of at least ``n`` elements."""
        if self._host[dtype].numel() < n:
            size = 1 << max(n - 1, 255).bit_length()  # NOTE: doubling: a few reallocations over a run
            self._host[dtype] = _staging(size, dtype, self.device)
            on_host = self.device.type == "cpu"
            self._dev[dtype] = self._host[dtype] if on_host else torch.zeros(size, dtype=dtype, device=self.device)
        return self._host[dtype].numpy(), self._dev[dtype]

    def stage(self, batch: list[tuple[Request, int]], block_size: int) -> StepInputs:
        """Write the batch's inputs and upload them (one copy per dtype); return views of the device buffers."""
        f = _fill(batch, block_size)
        self._fence.before_write()
        t, r, d = len(f.ids), len(f.ends), f.num_decodes
        p = r - d
        s = len(f.sample_reqs)
        dec_w, pre_w = _width(f.ends[:d], block_size), _width(f.ends[d:], block_size)
        n64 = 3 * t + s
        n32 = r + (p + 1) + d * dec_w + p * pre_w
        h64, d64 = self._area(torch.int64, n64)
        h32, d32 = self._area(torch.int32, n32)
        h64[0:t], h64[t : 2 * t], h64[2 * t : 3 * t] = f.ids, f.positions, f.slots
        h64[3 * t : n64] = f.cu[f.sample_reqs] - 1
        h32[0:r] = f.ends
        cu_off, dec_off = r, 2 * r - d + 1
        h32[cu_off] = 0
        h32[cu_off + 1 : dec_off] = f.cu[d:] - d
        pre_off = dec_off + d * dec_w
        h32[dec_off:pre_off].reshape(d, dec_w)[:] = f.table[:d, :dec_w]
        h32[pre_off:n32].reshape(p, pre_w)[:] = f.table[d:, :pre_w]
        if d64 is not self._host[torch.int64]:
            d64[:n64].copy_(self._host[torch.int64][:n64], non_blocking=True)
            d32[:n32].copy_(self._host[torch.int32][:n32], non_blocking=True)
            self._fence.after_upload()
        attn = AttentionMetadata(
            slot_mapping=d64[2 * t : 3 * t],
            num_decode_tokens=d,
            decode_block_tables=d32[dec_off:pre_off].view(d, dec_w),
            decode_context_lens=d32[0:d],
            prefill_block_tables=d32[pre_off:n32].view(p, pre_w),
            prefill_cu_seqlens_q=d32[cu_off:dec_off],
            prefill_context_lens=d32[d:r],
        )
        return StepInputs(d64[0:t], d64[t : 2 * t], attn, d64[3 * t : n64], f.sample_reqs)


class DecodeBuffers:
    """The decode graphs' static inputs for up to ``max_batch`` sequences of up to ``max_blocks`` blocks.

    ``inputs(batch_size)`` gives the views a graph is captured on (or, on CPU, replayed with); ``stage``
    fills the first rows with a decode batch and pads the rest up to the bucket.

    Block tables live in a persistent device table (``[max_batch + 1, max_blocks]`` int32) whose rows the
    decoding requests keep across steps (``table_mirror.TableRows`` holds the host side). A step uploads only
    what changed there, as packed (flat index, value) entries scattered on the device, plus each batch row's
    table row; one gather then lays the batch's rows out in the static ``[max_batch, max_blocks]`` table the
    graphs read (padding rows gather the all-zero last row). Per graph step: one copy of the static inputs,
    the gather, and where a table changed one more copy and the scatter; then the replay.
    """

    def __init__(self, max_batch: int, max_blocks: int, device: torch.device) -> None:
        self.max_batch, self.max_blocks, self.device = max_batch, max_blocks, device
        m = max_batch
        self.table = TableRows(m, max_blocks)
        # One static area, uploaded with one copy: int64 ids | positions | slots, then int32 context lens |
        # table rows. Padding rows: id 0 at position 0, stored nowhere, context 1 (block 0 of the zero row).
        self._hstatic = _staging(32 * m, torch.uint8, device)
        self._dstatic = torch.zeros(32 * m, dtype=torch.uint8, device=device)
        self._h64 = self._hstatic.numpy()[: 24 * m].view(np.int64)
        self._h32 = self._hstatic.numpy()[24 * m :].view(np.int32)
        self._d64 = self._dstatic[: 24 * m].view(torch.int64)
        self._d32 = self._dstatic[24 * m :].view(torch.int32)
        self._h64[2 * m :], self._h32[:m], self._h32[m:] = -1, 1, self.table.pad_row
        self._dstatic.copy_(self._hstatic)
        self._rows = self._d32[m:]  # [max_batch] the table row of each batch row
        self._ptable = torch.zeros(m + 1, max_blocks, dtype=torch.int32, device=device)  # persistent
        self._dtable = torch.zeros(m, max_blocks, dtype=torch.int32, device=device)  # what the graphs read
        # The step's table entries: int64 flat indices | int32 values (grown by doubling, read by no graph).
        self._hdelta = _staging(0, torch.uint8, device)
        self._ddelta = self._hdelta
        self._empty_tables = torch.zeros(0, max_blocks, dtype=torch.int32, device=device)
        self._empty_lens = torch.zeros(0, dtype=torch.int32, device=device)
        self._cu0 = torch.zeros(1, dtype=torch.int32, device=device)
        self._fence = _UploadFence(device)

    @staticmethod
    def device_bytes(max_batch: int, max_blocks: int) -> int:
        """What ``__init__`` allocates on the device (the static area, the persistent and the static tables, the
        empty prefill views): what the KV pool's sizing leaves room for (``memory_budget.ProfileShape``). The
        step's delta entries grow on demand and are not counted (a few KiB)."""
        return 32 * max_batch + (2 * max_batch + 1) * max_blocks * 4 + 4

    def inputs(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Token ids, positions and metadata of a ``batch_size``-row decode (fresh views of the static
        buffers: the CPU reference kernels key per-step caches on the tensor objects)."""
        b, m = batch_size, self.max_batch
        attn = AttentionMetadata(
            slot_mapping=self._d64[2 * m : 2 * m + b],
            num_decode_tokens=b,
            decode_block_tables=self._dtable[:b],
            decode_context_lens=self._d32[:b],
            prefill_block_tables=self._empty_tables,
            prefill_cu_seqlens_q=self._cu0,
            prefill_context_lens=self._empty_lens,
        )
        return self._d64[:b], self._d64[m : m + b], attn

    def stage(self, batch: list[tuple[Request, int]], block_size: int, batch_size: int) -> list[int]:
        """Write a decode batch (every count 1, ``len(batch) <= batch_size <= max_batch``) into the first
        rows, pad up to ``batch_size``, upload; return the batch indices whose token gets sampled."""
        n, b, m, bs = len(batch), batch_size, self.max_batch, block_size
        ids: list[int] = []
        first: list[int] = []
        skip_l: list[int] = []
        tables: list[list[int]] = []
        sample_reqs: list[int] = []
        for j, (req, c) in enumerate(batch):
            assert c == 1, c
            start, tokens = req.num_computed_tokens, req.all_token_ids
            ids.append(tokens[start])
            first.append(start)
            skip_l.append(req.skip_store_below)
            tables.append(req.block_table)
            if start + 1 == len(tokens):
                sample_reqs.append(j)
        assert n <= b <= m, (n, b, m)
        starts = np.array(first, dtype=np.int64)
        skip = np.array(skip_l, dtype=np.int64)
        ends = starts + 1
        rows, flat, values = self.table.assign(tables)
        slots = self.table.host[rows, starts // bs] * bs + starts % bs
        slots[starts < skip] = -1
        self._fence.before_write()
        h64, h32 = self._h64, self._h32
        h64[:n], h64[n:b] = ids, 0
        h64[m : m + n], h64[m + n : m + b] = starts, 0
        h64[2 * m : 2 * m + n], h64[2 * m + n : 2 * m + b] = slots, -1
        h32[:n], h32[n:b] = ends, 1
        h32[m : m + n], h32[m + n : m + b] = rows, self.table.pad_row
        self._dstatic.copy_(self._hstatic, non_blocking=True)
        k = len(flat)
        if k:
            hdelta, ddelta = self._delta_area(12 * k)
            hdelta[: 8 * k].view(np.int64)[:] = flat
            hdelta[8 * k : 12 * k].view(np.int32)[:] = values
            if ddelta is not self._hdelta:
                ddelta[: 12 * k].copy_(self._hdelta[: 12 * k], non_blocking=True)
            index, vals = ddelta[: 8 * k].view(torch.int64), ddelta[8 * k : 12 * k].view(torch.int32)
            self._ptable.view(-1).index_put_((index,), vals)
        torch.index_select(self._ptable, 0, self._rows[:b], out=self._dtable[:b])
        self._fence.after_upload()
        return sample_reqs

    def _delta_area(self, nbytes: int) -> tuple[np.ndarray, torch.Tensor]:
        """Staging (numpy view) and device buffer of at least ``nbytes`` bytes for the step's table entries."""
        if self._hdelta.numel() < nbytes:
            size = 1 << max(nbytes - 1, 4095).bit_length()  # NOTE: doubling: a few reallocations over a run
            self._hdelta = _staging(size, torch.uint8, self.device)
            on_host = self.device.type == "cpu"
            self._ddelta = self._hdelta if on_host else torch.zeros(size, dtype=torch.uint8, device=self.device)
        return self._hdelta.numpy(), self._ddelta
