"""The one message rank 0 sends the other ranks per step: the batch's flat inputs (token ids, positions,
slot mapping, block tables, context lengths, the rows to sample). Two broadcasts per message: a fixed
header of sizes, then one packed int64 payload; never anything per layer. A step that swaps blocks
between the device pool and host swap space sends the (device, host) block pairs first, one message each way."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from kvserve.workers.engine.attention_metadata import AttentionMetadata

STEP, STOP, SWAP_OUT, SWAP_IN, READ_BLOCKS, WRITE_BLOCKS = 1, 2, 3, 4, 5, 6
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


def send_stop(device: torch.device) -> None:
    """Tell the followers to leave their loop (the group is closing)."""
    header = torch.zeros(_HEADER, dtype=torch.int64, device=device)
    header[0] = STOP
    dist.broadcast(header, src=0)


def send_swap(kind: int, mapping: list[tuple[int, int]], device: torch.device) -> None:
    """Broadcast a swap's (device block, host block) pairs (``kind`` SWAP_OUT or SWAP_IN) from rank 0."""
    payload = torch.tensor([b for pair in mapping for b in pair], dtype=torch.int64, device=device)
    header = torch.zeros(_HEADER, dtype=torch.int64, device=device)
    header[0], header[8] = kind, payload.numel()
    dist.broadcast(header, src=0)
    dist.broadcast(payload, src=0)


def send_blocks_op(kind: int, block_ids: list[int], swapped: bool, device: torch.device) -> None:
    """Broadcast a migration's block read (``READ_BLOCKS``) or write (``WRITE_BLOCKS``) from rank 0; the
    blocks' data then moves in the collectives of ``LeaderKVCache.read_blocks``/``write_blocks``."""
    payload = torch.tensor([int(swapped), *block_ids], dtype=torch.int64, device=device)
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
