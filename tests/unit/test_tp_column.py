"""A worker's tensor-parallel size: `kvserve top`'s tp column (Hello -> WorkerStatus) and auto workers."""

from __future__ import annotations

import re

from kvserve.cluster.top import render_text
from kvserve.protos.kvserve.v1 import pressure_pb2 as ppb
from kvserve.protos.kvserve.v1 import serving_pb2 as spb
from kvserve.workers.core.identity import WorkerIdentity


def test_identity_carries_the_group_size() -> None:
    ident = WorkerIdentity("w", "m", 16, 64, 128, 1000, tensor_parallel_size=4)
    hello = ident.to_hello("inc")
    assert hello.tensor_parallel_size == 4
    assert WorkerIdentity.from_hello(hello).tensor_parallel_size == 4
    hello.ClearField("tensor_parallel_size")  # a worker older than the field: one rank
    assert WorkerIdentity.from_hello(hello).tensor_parallel_size == 1


def test_top_shows_the_tp_column() -> None:
    workers = [
        spb.WorkerStatus(
            worker_id=f"worker-{i}",
            healthy=True,
            tensor_parallel_size=n,
            report=ppb.PressureReport(total_blocks=48, free_blocks=48),
        )  # fmt: skip
        for i, n in enumerate((4, 1))
    ]
    text = render_text(None, spb.ClusterStatus(timestamp_ms=1, workers=workers), width=220)
    header = next(ln for ln in text.splitlines() if ln.startswith("worker "))
    col = header.index(" tp") + 3  # right-justified: the value ends where the header does
    rows = {ln.split()[0]: ln for ln in text.splitlines() if re.match(r"worker-\d", ln)}
    assert rows["worker-0"][col - 1] == "4" and rows["worker-1"][col - 1] == "1"


def test_auto_workers_take_tp_gpus_each() -> None:
    """`workers: auto` on GPUs: one worker per tensor_parallel_size GPUs (8 GPUs at TP=4: 2 workers)."""
    from kvserve.cluster.config import ClusterConfig

    cfg = ClusterConfig.from_dict({"model": "/m", "engine": {"tensor_parallel_size": 4}})
    assert cfg.engine.tensor_parallel_size == 4
    assert cfg.num_workers(num_gpus=8) == 2 and cfg.num_workers(num_gpus=4) == 1
    assert ClusterConfig.from_dict({"model": "/m"}).num_workers(num_gpus=8) == 8
