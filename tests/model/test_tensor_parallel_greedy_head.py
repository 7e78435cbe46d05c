"""The decode graphs' greedy head under tensor parallelism (``ShardedCausalLM.greedy_token_ids_every_rank``):
per-rank argmax and one all-gather of (max logit, id) pairs give, on every rank, the argmax of the gathered
full logits: the last rank's zero padding rows never win (every real logit negative here), and a tie across
ranks goes to the lowest id. Two real gloo ranks (spawned processes) over a 37-token vocabulary (19 rows per
rank, one of them padding)."""

from __future__ import annotations

import dataclasses
import socket
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kvserve.workers.models.model_config import ModelConfig
from kvserve.workers.parallel import group
from kvserve.workers.parallel.layers import ShardedCausalLM
from kvserve.workers.parallel.sharding import ShardPlan

VOCAB, ROWS = 37, 6


def _rank(rank: int, model_dir: str, address: str, out: str) -> None:
    group.join(rank, 2, address, torch.device("cpu"))
    try:
        full = dataclasses.replace(ModelConfig.from_dir(Path(model_dir)), vocab_size=VOCAB, tie_word_embeddings=False)
        model = ShardedCausalLM(ShardPlan(full, rank, 2), 64).eval()
        g = torch.Generator().manual_seed(0)
        weight = -torch.rand(VOCAB, full.hidden_size, generator=g) - 0.1  # every real logit < 0 (hidden > 0)
        weight[20] = weight[5] = -0.01  # rows 5 (rank 0) and 20 (rank 1): equal, the largest logit of every row
        hidden = torch.rand(ROWS, full.hidden_size, generator=g) + 0.1
        start, rows = rank * 19, min(19, VOCAB - rank * 19)
        with torch.no_grad():
            model.lm_head.weight.zero_()
            model.lm_head.weight[:rows] = weight[start : start + rows]
            ids = model.greedy_token_ids_every_rank(hidden)
            logits = model.compute_logits(hidden)  # rank 0: the full (cut) logits
        if rank == 0:
            torch.save({"ids": ids, "argmax": logits.argmax(dim=-1), "vocab": logits.shape[1]}, out)
        else:
            torch.save({"ids": ids}, out + ".1")
    finally:
        group.leave()


def test_every_rank_greedy_head_equals_full_argmax(tiny_llama_dir: Path, tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    out = str(tmp_path / "ids.pt")
    mp.spawn(_rank, args=(str(tiny_llama_dir), address, out), nprocs=2, join=True)
    got, other = torch.load(out), torch.load(out + ".1")
    assert got["vocab"] == VOCAB
    assert got["argmax"].tolist() == [5] * ROWS  # the tie: the lowest id
    assert got["ids"].tolist() == got["argmax"].tolist()
    assert other["ids"].tolist() == got["argmax"].tolist()  # every rank has the ids
    assert not dist.is_initialized()
