"""The decode graphs' persistent block table (``DecodeBuffers`` over ``table_mirror.TableRows``) presents, after
its device-side scatter and gather, exactly the rows the full per-step rebuild (``input_buffers._fill``) gives:
over thousands of random steps of new requests, in-place extensions, table replacements (swap, recompute,
prefix hits), finishes and preemptions, with far more requests over time than table rows, so rows are
reclaimed and recycled all along."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from kvserve.workers.core.sampling_params import SamplingParams
from kvserve.workers.engine.input_buffers import DecodeBuffers, _fill
from kvserve.workers.engine.request import Request
from kvserve.workers.engine.table_mirror import TableRows

BS, ROWS, WIDTH = 4, 8, 12  # block size, table rows (the largest bucket), blocks per row


class _Sim:
    """Requests mid-decode whose tables change the ways the scheduler changes them."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.running: list[Request] = []
        self.preempted: list[Request] = []
        self.made = 0

    def table(self, n: int) -> list[int]:
        return [self.rng.randrange(1, 1000) for _ in range(n)]

    def new(self) -> None:
        rng = self.rng
        req = Request(f"r{self.made}", [rng.randrange(100) for _ in range(rng.randrange(1, 30))], SamplingParams())
        self.made += 1
        req.num_computed_tokens = req.num_tokens - 1
        req.block_table = self.table(-(-req.num_tokens // BS))
        if rng.random() < 0.2:  # a prefix hit: leading positions store nowhere
            req.skip_store_below = rng.randrange(req.num_tokens + 1)
        self.running.append(req)

    def mutate(self) -> None:
        """One random table or request change."""
        rng, op = self.rng, self.rng.random()
        if op < 0.25 or not self.running:
            if len(self.running) < 3 * ROWS:
                self.new()
        elif op < 0.45:  # an extension in place, up to a lookahead block
            req = rng.choice(self.running)
            if len(req.block_table) < WIDTH:
                req.block_table.extend(self.table(rng.randrange(1, 3)))
                del req.block_table[WIDTH:]  # NOTE: a fresh list is never edited; this one was just extended
        elif op < 0.55:  # swapped out and in again: another list, other blocks, same length
            req = rng.choice(self.running)
            req.block_table = self.table(len(req.block_table))
        elif op < 0.65:  # finished (or aborted, exported)
            self.running.remove(rng.choice(self.running))
        elif op < 0.75:  # preempted (recompute): the table is dropped
            req = rng.choice(self.running)
            self.running.remove(req)
            req.block_table = []
            self.preempted.append(req)
        elif self.preempted:  # resumed: a new table of the length it needs now
            req = self.preempted.pop(rng.randrange(len(self.preempted)))
            req.block_table = self.table(-(-req.num_tokens // BS))
            self.running.append(req)

    def advance(self, batch: list[tuple[Request, int]]) -> None:
        """The decoded tokens land; a table grows in place when the next token needs a block; a full one ends."""
        for req, _ in batch:
            req.all_token_ids.append(self.rng.randrange(100))
            req.num_computed_tokens += 1
            if req.num_tokens > WIDTH * BS:
                self.running.remove(req)
            elif req.num_tokens > len(req.block_table) * BS:
                req.block_table.append(self.rng.randrange(1, 1000))


def _check_step(buffers: DecodeBuffers, batch: list[tuple[Request, int]], bucket: int) -> None:
    buffers.stage(batch, BS, bucket)
    ids, positions, attn = buffers.inputs(bucket)
    n, ref = len(batch), _fill(batch, BS)
    expect = np.zeros((bucket, WIDTH), dtype=np.int64)  # the full rebuild from the lists, zero-padded
    for j, (req, _) in enumerate(batch):
        expect[j, : len(req.block_table)] = req.block_table
    assert np.array_equal(attn.decode_block_tables.numpy(), expect)
    assert attn.slot_mapping.tolist() == ref.slots.tolist() + [-1] * (bucket - n)
    assert attn.decode_context_lens.tolist() == ref.ends.tolist() + [1] * (bucket - n)
    assert ids.tolist() == ref.ids.tolist() + [0] * (bucket - n)
    assert positions.tolist() == ref.positions.tolist() + [0] * (bucket - n)
    # The device table is the host twin's exact copy (the scatter wrote every change), its pad row zero.
    assert np.array_equal(buffers._ptable.numpy(), buffers.table.host)
    assert not buffers.table.host[buffers.table.pad_row].any()


@pytest.mark.parametrize("seed", range(3))
def test_rows_after_scatter_and_gather_equal_the_full_rebuild(seed: int) -> None:
    sim, buffers = _Sim(seed), DecodeBuffers(ROWS, WIDTH, torch.device("cpu"))
    rng, steps = sim.rng, 0
    while steps < 1500:
        for _ in range(rng.randrange(4)):
            sim.mutate()
        if not sim.running:
            continue
        chosen = rng.sample(sim.running, rng.randrange(1, min(ROWS, len(sim.running)) + 1))
        batch = [(req, 1) for req in chosen]
        _check_step(buffers, batch, rng.randrange(len(batch), ROWS + 1))
        sim.advance(batch)
        steps += 1
    assert sim.made > 10 * ROWS  # far more requests over time than rows: rows were recycled many times


def test_a_batch_keeps_its_rows_and_the_least_recently_used_row_is_reclaimed() -> None:
    rows = TableRows(3, 4)
    a, b, c, d = [1], [2, 3], [4], [5, 6, 7]
    first = rows.assign([a, b, c])[0].tolist()
    assert sorted(first) == [0, 1, 2]
    assert rows.assign([b, c])[0].tolist() == first[1:]  # same lists, same rows, nothing written
    assert rows.assign([b, c])[1].size == 0
    got, flat, values = rows.assign([d, c])  # a's row (unread longest) goes to d, fully rewritten
    assert got.tolist() == [first[0], first[2]]
    assert flat.tolist() == [first[0] * 4 + k for k in range(3)] and values.tolist() == [5, 6, 7]
    got, flat, values = rows.assign([b, [8], a])  # a new list: a fresh row; a's old row is d's now
    assert rows.host[got[1]].tolist() == [8, 0, 0, 0]  # the recycled row's old entries are zeroed
    assert rows.host[got[2]].tolist() == [1, 0, 0, 0]
    assert {id(t) for t in rows.row_tables() if t is not None} == {id(b), id(a), id(rows.row_tables()[got[1]])}


def test_a_step_uploads_only_the_entries_appended_since_the_row_was_written() -> None:
    rows = TableRows(4, 8)
    a, b = [3, 4, 5], [6]
    got, flat, _ = rows.assign([a, b])
    assert flat.size == 4  # both new: whole rows
    assert rows.assign([a, b])[1].size == 0  # nothing changed: nothing to write
    a.append(7)
    b.extend([8, 9])
    got2, flat, values = rows.assign([b, a])
    assert got2.tolist() == got.tolist()[::-1]
    assert sorted(zip(flat.tolist(), values.tolist(), strict=True)) == sorted(
        [(got[0] * 8 + 3, 7), (got[1] * 8 + 1, 8), (got[1] * 8 + 2, 9)]
    )
    assert rows.assign([a])[1].size == 0 and rows.assign([b])[1].size == 0  # rows kept across other batches
