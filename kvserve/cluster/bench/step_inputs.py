"""`kvserve bench step-inputs`: the host's cost of laying out one decode step's inputs, per batch size.

Two rows per batch size:

- ``us_per_step``: ``StepBuffers.stage`` (every eager step: token ids, positions, slots, context lengths and block
  tables, packed into the staging buffers), the same batch staged ``--steps`` times.
- ``graph_us_per_step``: ``DecodeBuffers.stage`` (the decode graphs' static buffers and their device block table),
  over a decode that advances: every step each request gains a token and, every ``BLOCK_SIZE`` tokens, a block,
  so the step uploads what a real decode would.

Synthetic decode batches (one new token per request; contexts drawn from ``--contexts``, block 16, table entries
scattered as a pool hands them out), after a warm-up, on CPU tensors: the layout is host work wherever the step then
runs (on CPU the "device" copies, scatter and gather run here too). On a GPU this time is part of every step's wall
(and what overlapped scheduling has to hide). Medians of ``--runs`` runs.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from kvserve.workers.core.sampling_params import SamplingParams
from kvserve.workers.engine.input_buffers import DecodeBuffers, StepBuffers
from kvserve.workers.engine.request import Request

BLOCK_SIZE = 16
WARMUP = 10


def decode_batch(batch_size: int, lo: int, hi: int, seed: int = 0) -> list[tuple[Request, int]]:
    """``batch_size`` requests mid-decode with contexts in [lo, hi), each scheduled for one token."""
    rng = random.Random(seed)
    batch = []
    for i in range(batch_size):
        context = rng.randrange(lo, hi)
        req = Request(f"r{i}", [rng.randrange(32000) for _ in range(context)], SamplingParams(max_tokens=1 << 20))
        req.num_computed_tokens = context - 1
        req.block_table = rng.sample(range(1 << 20), -(-context // BLOCK_SIZE))
        batch.append((req, 1))
    return batch


def time_stage(batch_size: int, lo: int, hi: int, steps: int) -> float:
    """Microseconds per ``StepBuffers.stage`` of one decode batch (after the warm-up steps)."""
    buffers, batch = StepBuffers(torch.device("cpu")), decode_batch(batch_size, lo, hi)
    for _ in range(WARMUP):
        buffers.stage(batch, BLOCK_SIZE)
    start = time.perf_counter()
    for _ in range(steps):
        buffers.stage(batch, BLOCK_SIZE)
    return (time.perf_counter() - start) / steps * 1e6


def advance(batch: list[tuple[Request, int]], next_block: list[int]) -> None:
    """Each request's decoded token lands; a request whose next token starts a block gets one more."""
    for req, _ in batch:
        req.all_token_ids.append(0)
        req.num_computed_tokens += 1
        if req.num_tokens > len(req.block_table) * BLOCK_SIZE:
            req.block_table.append(next_block[0])
            next_block[0] += 1


def time_graph_stage(batch_size: int, lo: int, hi: int, steps: int) -> float:
    """Microseconds per ``DecodeBuffers.stage`` of an advancing decode batch (the advance is not timed)."""
    batch, next_block = decode_batch(batch_size, lo, hi), [1 << 20]
    buffers = DecodeBuffers(batch_size, -(-(hi + WARMUP + steps) // BLOCK_SIZE), torch.device("cpu"))
    total = 0.0
    with torch.inference_mode():
        for i in range(WARMUP + steps):
            start = time.perf_counter()
            buffers.stage(batch, BLOCK_SIZE, batch_size)
            if i >= WARMUP:
                total += time.perf_counter() - start
            advance(batch, next_block)
    return total / steps * 1e6


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batches", default="1,32,256", help="decode batch sizes (comma-separated)")
    p.add_argument("--contexts", default="200,4096", help="context lengths drawn from [lo, hi)")
    p.add_argument("--steps", type=int, default=200, help="steps timed per run")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    lo, hi = (int(x) for x in args.contexts.split(","))
    rows = []
    for b in (int(x) for x in args.batches.split(",")):
        runs = [time_stage(b, lo, hi, args.steps) for _ in range(args.runs)]
        graph = [time_graph_stage(b, lo, hi, args.steps) for _ in range(args.runs)]
        rows.append({
            "batch": b, "us_per_step": round(statistics.median(runs), 1), "runs": [round(r, 1) for r in runs],
            "graph_us_per_step": round(statistics.median(graph), 1), "graph_runs": [round(r, 1) for r in graph],
        })  # fmt: skip
        if not args.json:
            r = rows[-1]
            print(f"batch {b:4d}: {r['us_per_step']:9.1f} us per step (runs {r['runs']}); decode graphs "
                  f"{r['graph_us_per_step']:9.1f} us (runs {r['graph_runs']})", flush=True)  # fmt: skip
    if args.json:
        print(json.dumps({"block_size": BLOCK_SIZE, "contexts": [lo, hi], "rows": rows}))
    return 0
