"""The one message rank 0 sends the other ranks per step: the batch's flat inputs (token ids, positions,
slot mapping, block tables, context lengths, the rows to sample). Two broadcasts per message: a fixed
header of sizes, then one packed int64 payload; never anything per layer. A step that swaps blocks
between the device pool and host swap space sends the (device, host) block pairs first, one message each way.

A decode step that replays a decode graph sends ``GRAPH_STEP`` instead: the rows rank 0 staged in its static
buffers (bucket-padded ids, positions, slots, context lengths, the block-table columns they reach); each
rank copies them into its own static buffers and replays the same bucket. ``CAPTURE`` tells the ranks to
capture their graphs (same buckets, same order: the captures' collectives pair up)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from kvserve.workers.engine.attention_metadata import AttentionMetadata

STEP, STOP, SWAP_OUT, SWAP_IN, READ_BLOCKS, WRITE_BLOCKS, CAPTURE, GRAPH_STEP, TIER_SPILL, TIER_LOAD, TIER_FLUSH = (
    range(1, 12)
)
TIER_NAMES = ("host", "disk")  # TIER_LOAD's tiers, as a bit mask in this order
_U64 = 1 << 64
_HEADER = 10  # kind, tokens, decode tokens, decodes, decode table width, prefills, prefill width, sampled, payload


@dataclass
class StepMessage:
    """What a follower needs to run the step's forward exactly as rank 0 does."""

    kind: int
    input_ids: torch.Tensor | None = None  # [num_tokens] int64
    positions: torch.Tensor | None = None  # [num_tokens] int64
    attn: AttentionMetadata | None = None
    sample_rows: torch.Tensor | None = None  # [num_sampled] int64; empty: nothing sampled this step
    pairs: list[tuple[int, int]] | None = None  # SWAP_OUT / SWAP_IN: (device block, host block)
    block_ids: list[int] | None = None  # READ_BLOCKS / WRITE_BLOCKS (migration)
    swapped: bool = False  # READ_BLOCKS: from host swap space
    buckets: list[int] | None = None  # CAPTURE: the decode graphs' batch sizes
    max_blocks: int = 0  # CAPTURE: their block-table width
    graph: GraphRows | None = None  # GRAPH_STEP
    hashes: list[int] | None = None  # TIER_SPILL / TIER_LOAD: block hashes (unsigned 64-bit), with block_ids
    tiers: list[str] | None = None  # TIER_LOAD: the tiers rank 0 reads, in order


@dataclass
class GraphRows:
    """A graph step's static-buffer rows as rank 0 staged them (padding rows included)."""

    batch_size: int  # the bucket replayed
    num_real: int  # rows of real requests (the rest is padding)
    input_ids: torch.Tensor  # [batch_size] int64
    positions: torch.Tensor  # [batch_size]
    slots: torch.Tensor  # [batch_size]
    context_lens: torch.Tensor  # [batch_size]
    block_table: torch.Tensor  # [batch_size, width]: the columns the contexts reach
    sample_rows: torch.Tensor  # [num_sampled] rows whose logits rank 0 reads
    logits: bool  # rank 0 computes the sampled rows' full logits after the replay (one more gather)


def send_stop(device: torch.device) -> None:
    """Tell the followers to leave their loop (the group is closing)."""
    header = torch.zeros(_HEADER, dtype=torch.int64, device=device)
    header[0] = STOP
    dist.broadcast(header, src=0)


def send_swap(kind: int, mapping: list[tuple[int, int]], device: torch.device) -> None:
    """Broadcast a swap's (device block, host block) pairs (``kind`` SWAP_OUT or SWAP_IN) from rank 0."""
    _send(kind, [b for pair in mapping for b in pair], device)


def send_blocks_op(kind: int, block_ids: list[int], swapped: bool, device: torch.device) -> None:
    """Broadcast a migration's block read (``READ_BLOCKS``) or write (``WRITE_BLOCKS``) from rank 0; the
    blocks' data then moves in the collectives of ``LeaderKVCache.read_blocks``/``write_blocks``."""
    _send(kind, [int(swapped), *block_ids], device)


def send_capture(buckets: list[int], max_blocks: int, device: torch.device) -> None:
    """Tell the ranks to capture decode graphs for ``buckets`` with ``max_blocks``-wide block tables."""
    _send(CAPTURE, [max_blocks, *buckets], device)


def send_graph_step(rows: GraphRows) -> None:
    """Broadcast a graph step's staged rows from rank 0 (views of its static buffers)."""
    width = rows.block_table.shape[1]
    parts = [rows.input_ids, rows.positions, rows.slots, rows.context_lens, rows.block_table.reshape(-1),
             rows.sample_rows]  # fmt: skip
    payload = torch.cat([p.to(torch.int64) for p in parts])
    header = [GRAPH_STEP, rows.batch_size, rows.num_real, width, rows.sample_rows.numel(), int(rows.logits), 0, 0,
              payload.numel(), 0]  # fmt: skip
    dist.broadcast(torch.tensor(header, dtype=torch.int64, device=payload.device), src=0)
    dist.broadcast(payload, src=0)


def send_tier_spill(evicted: list[tuple[int, int]], device: torch.device) -> None:
    """Broadcast the (block id, block hash) pairs rank 0's pool evicted: every rank spills its heads of them."""
    _send(TIER_SPILL, [b for b, _ in evicted] + [_signed(h) for _, h in evicted], device)


def send_tier_load(hashes: list[int], block_ids: list[int], tiers: list[str], device: torch.device) -> None:
    """Broadcast a tier load: the hashes to find in ``tiers`` (in order) and the fresh blocks for them."""
    mask = sum(1 << TIER_NAMES.index(t) for t in tiers)
    _send(TIER_LOAD, [mask, *block_ids, *(_signed(h) for h in hashes)], device)


def send_tier_flush(device: torch.device) -> None:
    """Tell the ranks to wait for their tier writes (``GroupTieredCache.flush``)."""
    _send(TIER_FLUSH, [], device)


def _signed(h: int) -> int:
    """A 64-bit block hash as an int64 (``receive`` undoes it)."""
    return h - _U64 if h >= 1 << 63 else h


def _send(kind: int, values: list[int], device: torch.device) -> None:
    payload = torch.tensor(values, dtype=torch.int64, device=device)
    header = torch.zeros(_HEADER, dtype=torch.int64, device=device)
    header[0], header[8] = kind, payload.numel()
    dist.broadcast(header, src=0)
    dist.broadcast(payload, src=0)


def send_step(
    input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata, sample_rows: torch.Tensor
) -> None:
    """Broadcast one step's inputs from rank 0 (its staged buffers: valid until its next step)."""
    a = attn
    parts = [
        input_ids, positions, a.slot_mapping, a.decode_block_tables.reshape(-1), a.decode_context_lens,
        a.prefill_block_tables.reshape(-1), a.prefill_cu_seqlens_q, a.prefill_context_lens, sample_rows,
    ]  # fmt: skip
    payload = torch.cat([p.to(torch.int64) for p in parts])
    header = [STEP, input_ids.numel(), a.num_decode_tokens, a.decode_block_tables.shape[0],
              a.decode_block_tables.shape[1], a.prefill_block_tables.shape[0], a.prefill_block_tables.shape[1],
              sample_rows.numel(), payload.numel(), 0]  # fmt: skip
    dist.broadcast(torch.tensor(header, dtype=torch.int64, device=payload.device), src=0)
    dist.broadcast(payload, src=0)


def receive(device: torch.device) -> StepMessage:
    """A follower's side of ``send_step``/``send_stop`` (blocks until rank 0 sends)."""
    header = torch.empty(_HEADER, dtype=torch.int64, device=device)
    dist.broadcast(header, src=0)
    kind, tokens, num_decode, decodes, dwidth, prefills, pwidth, sampled, size, _ = header.tolist()
    if kind == STOP:
        return StepMessage(kind)
    payload = torch.empty(size, dtype=torch.int64, device=device)
    dist.broadcast(payload, src=0)
    if kind == CAPTURE:
        flat = payload.tolist()
        return StepMessage(kind, buckets=flat[1:], max_blocks=flat[0])
    if kind == TIER_FLUSH:
        return StepMessage(kind)
    if kind == TIER_SPILL:
        flat = payload.tolist()
        half = len(flat) // 2
        return StepMessage(kind, block_ids=flat[:half], hashes=[h % _U64 for h in flat[half:]])
    if kind == TIER_LOAD:
        mask, *flat = payload.tolist()
        half = len(flat) // 2
        tiers = [t for i, t in enumerate(TIER_NAMES) if mask >> i & 1]
        return StepMessage(kind, block_ids=flat[:half], hashes=[h % _U64 for h in flat[half:]], tiers=tiers)
    if kind == GRAPH_STEP:
        b, n, width, num_sampled, logits = tokens, num_decode, decodes, dwidth, prefills
        ids, pos, slots, lens, table, rows = payload.split([b, b, b, b, b * width, num_sampled])
        graph = GraphRows(b, n, ids, pos, slots, lens.to(torch.int32), table.view(b, width).to(torch.int32), rows,
                          bool(logits))  # fmt: skip
        return StepMessage(kind, graph=graph)
    if kind in (SWAP_OUT, SWAP_IN):
        flat = payload.tolist()
        return StepMessage(kind, pairs=list(zip(flat[::2], flat[1::2], strict=True)))
    if kind in (READ_BLOCKS, WRITE_BLOCKS):
        flat = payload.tolist()
        return StepMessage(kind, block_ids=flat[1:], swapped=bool(flat[0]))
    sizes = [tokens, tokens, tokens, decodes * dwidth, decodes, prefills * pwidth, prefills + 1, prefills, sampled]
    ids, pos, slots, dtab, dlen, ptab, cu, plen, rows = payload.split(sizes)
    i32 = torch.int32
    attn = AttentionMetadata(
        slot_mapping=slots,
        num_decode_tokens=num_decode,
        decode_block_tables=dtab.view(decodes, dwidth).to(i32),
        decode_context_lens=dlen.to(i32),
        prefill_block_tables=ptab.view(prefills, pwidth).to(i32),
        prefill_cu_seqlens_q=cu.to(i32),
        prefill_context_lens=plen.to(i32),
    )
    return StepMessage(kind, ids, pos, attn, rows)
